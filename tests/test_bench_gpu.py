"""bench.gpu, the GPU benchmark, kept runnable: its FLOP count against the model's own parameter count, and the
whole bench on the CPU (a smoke test: a tiny model, one measured step a run) writing the lines the report reads."""

import json
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


@pytest.mark.slow
def test_the_bench_runs_end_to_end_on_the_cpu(tmp_path):
    """Every worker (matmul peak, lora-llama train on plain and nf4 bases, transformers+peft) and the report's rows."""
    from bench.training_rows import gpu_rows

    results = ROOT / "bench" / "results" / "gpu.jsonl"
    before = results.read_text() if results.is_file() else None
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu",
            "--device",
            "cpu",
            "--configs",
            "tiny,tiny-nf4",
            "--peers",
            "transformers+peft",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
            "--budget",
            "850",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["matmul_peak"] + ["run", "run", "summary"] * 2
    runs = [line for line in lines if line["kind"] == "run"]
    assert all(run["tokens_per_s"] > 0 and run["gpu_peak_mb"] > 0 for run in runs), runs
    assert [run["quantize"] for run in runs] == [None, None, "nf4", "nf4"]
    for summary in (line for line in lines if line["kind"] == "summary"):
        ours, peer = summary["runs"]["lora-llama"], summary["runs"]["transformers+peft"]
        assert summary["tokens_per_s_vs_transformers+peft"] == round(ours["tokens_per_s"] / peer["tokens_per_s"], 3)
        assert 0 < summary["mfu"] and summary["args"] == ["--configs", summary["config"]]
        (row,) = gpu_rows(summary)
        assert row[0].startswith(f"{summary['config']}, 2 x 64") and "tok/s" in row[1] and "MFU" in row[1]
    assert (results.read_text() if results.is_file() else None) == before  # a smoke test records nothing
