"""bench.gpu and the device call, kept runnable: the FLOP count against the model's own parameter count, the call's
time budget, and the whole call rehearsed on the CPU (tiny models, one measured step a run) writing the lines the
report reads."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT


@pytest.mark.parametrize("config", ["8b", "1b", "135m"])
def test_model_flops_count_every_frozen_linear_lm_head_and_causal_attention(config):
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.gpu import CONFIGS, model_flops

    shapes, batch, seq, _, _ = CONFIGS[config]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shapes))
    linears = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers.")
    )
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    # forward + input gradient: 2 x 2 FLOPs a weight a token; attention: QKᵀ and PV (2 x 2 x T² x d a head), half
    # of it causal, backward twice the forward
    attention = 3 * (4 * seq * seq * head_dim / 2) * c.num_attention_heads * c.num_hidden_layers * batch
    want = 4 * batch * seq * (linears + model.lm_head.weight.numel()) + attention
    assert model_flops(shapes, batch, seq) == want


def test_a_budget_shortens_the_last_run_and_skips_the_rest(monkeypatch):
    """--budget: a run gets at most what is left; once under MIN_RUN_S is left, runs are marked skipped, not
    started, so the bench writes its summaries before the device call's own limit cuts it."""
    import bench.gpu as gpu

    given = []
    monkeypatch.setattr(gpu, "run_worker", lambda kind, timeout, **kw: given.append(timeout) or {"step_s": 1.0})
    clock = [1000.0]
    monkeypatch.setattr(gpu.time, "perf_counter", lambda: clock[0])
    budget = gpu.Budget(200)
    assert gpu.budgeted(budget, "ours", 170) == {"step_s": 1.0} and given == [170]  # 200 s left: its own timeout
    clock[0] += 100
    gpu.budgeted(budget, "peer", 170)
    assert given[-1] == pytest.approx(100)  # 100 s left: cut to them
    clock[0] += 100 - gpu.MIN_RUN_S + 1
    assert "skipped" in gpu.budgeted(budget, "peer", 170)["error"] and len(given) == 2
    assert not gpu.Budget(None).spent() and gpu.Budget(None).left() == float("inf")


def call(tmp_path, *parts, **env):
    """bash bench/gpu_call.sh on the CPU (DEVICE=cpu: tiny shapes, this checkout's .venv) into tmp_path/out."""
    out = tmp_path / "out"
    settings = {**os.environ, "DEVICE": "cpu", "OUT": str(out), "PY": sys.executable, **env}
    r = subprocess.run(["bash", "bench/gpu_call.sh", *parts], cwd=ROOT, env=settings, capture_output=True, text=True)
    return r, out


def test_a_part_that_would_not_fit_is_left_for_the_next_call(tmp_path):
    r, out = call(tmp_path, "tests", "8b-nf4", CALL_S="30")  # under MIN_S (45 s) for any part
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "left.txt").read_text().split() == ["tests", "8b-nf4"]
    assert "not started" in (out / "call.log").read_text()
    r, _ = call(tmp_path, "8x")
    assert r.returncode == 2 and "unknown part 8x" in r.stdout


@pytest.mark.slow
def test_the_device_call_rehearses_on_the_cpu(tmp_path):
    """Call 1 as a GPU machine runs it, every part, on tiny shapes: the CUDA tests listed with their outcomes (all
    skipped here), each bench.gpu configuration's run and summary lines (lora-llama train on plain and nf4 bases,
    transformers+peft; a Qwen3-MoE with int8 experts against peft's target_parameters), bench.grpo on a model the
    script makes; bench/results untouched."""
    from bench.training_rows import gpu_rows

    before = {p.name: p.read_text() for p in (ROOT / "bench" / "results").glob("*.jsonl")}
    r, out = call(tmp_path, CALL_S="900")
    assert r.returncode == 0, r.stderr[-2000:]
    log = (out / "call.log").read_text()
    for part in ("tests", "135m", "8b", "8b-nf4", "1b", "moe", "grpo"):
        assert f"gpu_call: {part}: exit 0" in log, log[-3000:]
    assert (out / "left.txt").read_text() == ""
    tests = (out / "tests.txt").read_text()
    assert "SKIPPED" in tests and "skipped" in tests.splitlines()[-1]
    lines = [json.loads(line) for line in (out / "gpu.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["matmul_peak", "run", "run", "summary"] * 5
    runs = [line for line in lines if line["kind"] == "run"]
    assert all(run["tokens_per_s"] > 0 and run["gpu_peak_mb"] > 0 for run in runs), runs
    assert [run["quantize"] for run in runs] == [None, None, None, None, "nf4", "nf4", None, None, "int8", "int8"]
    for summary in (line for line in lines if line["kind"] == "summary"):
        ours, peer = summary["runs"]["lora-llama"], summary["runs"]["transformers+peft"]
        assert summary["tokens_per_s_vs_transformers+peft"] == round(ours["tokens_per_s"] / peer["tokens_per_s"], 3)
        assert 0 < summary["mfu"] and summary["args"] == ["--configs", summary["config"]]
        (row,) = gpu_rows(summary)
        assert row[0].startswith(f"{summary['config']}, 2 x 64") and "tok/s" in row[1] and "MFU" in row[1]
    grpo = json.loads((out / "grpo-results.jsonl").read_text().splitlines()[-1])
    assert grpo["runs"]["lora-llama"]["step_s"] > 0 and "--no-peer" in grpo["args"]
    assert {p.name: p.read_text() for p in (ROOT / "bench" / "results").glob("*.jsonl")} == before
