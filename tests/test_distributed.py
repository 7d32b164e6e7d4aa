"""Two processes (torchrun, gloo on the CPU, one thread each) against one process with the same global batch."""

import json
import os
import re
import shutil
import time

import pytest
from safetensors.torch import load_file

from lora_llama.cli import main
from two_processes import (
    QA,
    RECIPE,
    args,
    assert_close_adapters,
    assert_same_runs,
    patched_script,
    rows,
    torchrun,
)

pytestmark = pytest.mark.distributed
SLOW = pytest.mark.slow  # `make test-slow`: the variants beyond one of each kind


@pytest.mark.parametrize(
    "strategy, packing",
    [("ddp", False), pytest.param("ddp", True, marks=SLOW), ("fsdp", False), pytest.param("fsdp", True, marks=SLOW)],
)
def test_two_processes_of_batch_2_equal_one_of_batch_4(tiny_ckpt, chat_data, tmp_path, strategy, packing):
    extra = ["data.packing=true", "data.max_seq_len=48"] if packing else []
    assert main(args(tiny_ckpt, chat_data, tmp_path / "one", 4, *extra)) == 0
    code, out, err = torchrun(args(tiny_ckpt, chat_data, tmp_path / "two", 2, f"train.distributed={strategy}", *extra))
    assert code == 0, err[-3000:]
    assert_same_runs(tmp_path / "one", tmp_path / "two", ("loss", "eval_loss"))
    assert f"2 processes ({strategy})" in out and out.count("eval loss") == 1  # rank 0 alone reports
    if strategy == "fsdp":  # each rank keeps half of the base's frozen weights
        held, whole = map(float, re.search(r"each rank holds ([\d.]+) MB of the base's ([\d.]+) MB", out).groups())
        assert abs(held / whole - 0.5) < 0.01, (held, whole)

    # the run folder is what one process writes
    def names(p):
        return sorted(str(f.relative_to(p)) for f in p.rglob("*") if "tensorboard" not in str(f))

    assert names(tmp_path / "one") == names(tmp_path / "two")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_killed_job_resumes_on_two_and_on_one_process(tiny_ckpt, chat_data, tmp_path, capsys, strategy):
    def args_2(out):
        return args(tiny_ckpt, chat_data, out, 2, f"train.distributed={strategy}")

    code, _, err = torchrun(args_2(tmp_path / "full"))
    assert code == 0, err[-3000:]
    kill = """import lora_llama.training.trainer as t
_step = t.Trainer.train_step
def step(self):
    if self.step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return _step(self)
t.Trainer.train_step = step
"""
    code, _, _ = torchrun(args_2(tmp_path / "cut"), patched_script(tmp_path, kill))
    assert code != 0
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    shutil.copytree(tmp_path / "cut", tmp_path / "cut1")
    code, _, err = torchrun(args_2(tmp_path / "cut"))  # the same command again
    assert code == 0, err[-3000:]
    assert_close_adapters(tmp_path / "full", tmp_path / "cut")
    # one process continues the same global batch with batch_size 4; with 2 it would change the data order
    assert main(args(tiny_ckpt, chat_data, tmp_path / "cut1", 2)) == 2
    assert "resume with train.batch_size=4" in capsys.readouterr().err
    assert main(args(tiny_ckpt, chat_data, tmp_path / "cut1", 4)) == 0
    assert_close_adapters(tmp_path / "full", tmp_path / "cut1")


def test_nan_on_one_rank_stops_every_rank_before_the_update(tiny_ckpt, chat_data, tmp_path):
    nan_on_rank_1 = """import lora_llama.objectives.sft as t
_loss = t.target_loss
calls = [0]
def loss(*a, **k):
    s, n = _loss(*a, **k)
    calls[0] += 1
    bad = os.environ["RANK"] == "1" and calls[0] == 7
    return (s * float("nan") if bad else s), n
t.target_loss = loss
"""
    code_file = tmp_path / "code"
    os.environ["LORA_LLAMA_EXIT_FILE"] = str(code_file)
    try:
        code, _, err = torchrun(
            args(tiny_ckpt, chat_data, tmp_path / "run", 2, "train.eval_every=1000"),
            patched_script(tmp_path, nan_on_rank_1),
        )
    finally:
        del os.environ["LORA_LLAMA_EXIT_FILE"]
    assert code != 0 and code_file.read_text() == "2"  # rank 0 stopped with the one-line error, exit 2
    errors = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("lora-llama train: error")]
    assert len(errors) == 1 and "non-finite loss (on another rank) at step" in errors[0]  # rank 0 speaks for the job
    step = int(errors[0].split(" at step ")[1].split(";")[0])
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{k}" for k in range(2, step, 2)]
    assert step > 2 and not (tmp_path / "run" / "adapter").exists()
    load_file(ckpts / f"step-{step - 1 - (step - 1) % 2}" / "adapter" / "adapter_model.safetensors")


def test_a_rank_that_dies_ends_the_job(tiny_ckpt, chat_data, tmp_path):
    crash_rank_1 = """import lora_llama.training.trainer as t
_step = t.Trainer.train_step
def step(self):
    if os.environ["RANK"] == "1" and self.step == 3:
        raise RuntimeError("rank 1 fails")
    return _step(self)
t.Trainer.train_step = step
"""
    start = time.perf_counter()
    code, _, err = torchrun(args(tiny_ckpt, chat_data, tmp_path / "run", 2), patched_script(tmp_path, crash_rank_1))
    assert code != 0 and "rank 1 fails" in err
    assert time.perf_counter() - start < 120  # not the 60 s collective timeout twice over, and never forever
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-2"]
    assert not [p for p in (tmp_path / "run").rglob(".*") if ".tmp-" in p.name]


def test_bad_recipe_fails_before_any_process_starts(tmp_path, capsys):
    assert main(["train", RECIPE, "train.distributed=ring", "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert "train.distributed" in err and len(err.strip().splitlines()) == 1


def test_fsdp_on_a_gguf_files_own_blocks_equals_one_process(chat_data, tmp_path):
    """model.quantize source: each rank keeps its own rows of the file's blocks, K super-blocks and blocks of 32
    alike (q and k rows put back in HF's order first)."""
    from helpers import build_checkpoint, gguf_with_blocks
    from lora_llama.outputs.export import export_gguf

    ckpt = build_checkpoint(tmp_path / "ckpt", hidden_size=256, intermediate_size=512)
    export_gguf(str(ckpt), tmp_path / "f16.gguf", progress=False)
    gguf = gguf_with_blocks(
        tmp_path / "f16.gguf",
        tmp_path / "mixed.gguf",
        {"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0", "ffn_down": "Q5_K"},
    )
    assert main(args(gguf, chat_data, tmp_path / "one", 4, "model.quantize=source")) == 0
    code, out, err = torchrun(
        args(gguf, chat_data, tmp_path / "two", 2, "train.distributed=fsdp", "model.quantize=source")
    )
    assert code == 0, err[-3000:]
    assert_same_runs(tmp_path / "one", tmp_path / "two", ("loss", "eval_loss"))
    held, whole = map(float, re.search(r"each rank holds ([\d.]+) MB of the base's ([\d.]+) MB", out).groups())
    assert held < 0.6 * whole, (held, whole)


def test_fsdp_refuses_an_adapted_lm_head_before_training(tiny_ckpt, chat_data, tmp_path):
    code, _, err = torchrun(
        args(tiny_ckpt, chat_data, tmp_path / "run", 2, "train.distributed=fsdp", "lora.targets=[q,v,lm_head]")
    )
    errors = [line for line in err.splitlines() if line.startswith("lora-llama train: error")]
    assert code == 2 and len(errors) == 1 and "lm_head is not supported" in errors[0], err[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "quantize", ["int8", *(pytest.param(q, marks=SLOW) for q in ("nf4", "nf4-double", "int8-dora"))]
)
def test_fsdp_on_a_quantized_base_equals_one_process(tiny_ckpt, chat_data, tmp_path, quantize):
    """Each rank quantizes only its own rows of the checkpoint; the result is one process's on the same base.
    DoRA needs whole weights for its magnitude: each rank loads the base whole, then shards it."""
    extra = [f"model.quantize={quantize.split('-')[0]}"] + ["model.nf4_double_quant=true"] * ("double" in quantize)
    extra += ["lora.use_dora=true"] * ("dora" in quantize)
    assert main(args(tiny_ckpt, chat_data, tmp_path / "one", 4, *extra)) == 0
    code, out, err = torchrun(args(tiny_ckpt, chat_data, tmp_path / "two", 2, "train.distributed=fsdp", *extra))
    assert code == 0, err[-3000:]
    assert_same_runs(tmp_path / "one", tmp_path / "two", ("loss", "eval_loss"))
    held, whole = map(float, re.search(r"each rank holds ([\d.]+) MB of the base's ([\d.]+) MB", out).groups())
    assert held < 0.6 * whole, (held, whole)


@pytest.mark.parametrize(
    "objective, strategy, packing",
    [
        pytest.param("dpo", "ddp", False, marks=SLOW),
        ("dpo", "fsdp", False),
        pytest.param("orpo", "fsdp", False, marks=SLOW),
        ("kto", "ddp", False),
        ("dpo", "ddp", True),
        pytest.param("kto", "fsdp", True, marks=SLOW),
    ],
)
def test_preference_objectives_on_two_processes_equal_one(tiny_ckpt, tmp_path, objective, strategy, packing):
    """The reference pass (adapter off, no grad) and the per-pair loss over the global batch on two ranks; KTO's
    KL estimate over the global batch too; packed batches alike."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": q, "chosen": a, "rejected": QA[(i + 5) % len(QA)][1]}) + "\n"
            for i, (q, a) in enumerate(QA)
        )
    )
    dpo = [f"train.objective={objective}", "data.format=preference", "train.lr=1e-2", f"data.packing={packing}"]
    assert main(args(tiny_ckpt, pairs, tmp_path / "one", 4, *dpo)) == 0
    code, _, err = torchrun(args(tiny_ckpt, pairs, tmp_path / "two", 2, f"train.distributed={strategy}", *dpo))
    assert code == 0, err[-3000:]
    compared = ("loss", "rewards/margins", "eval_loss", "eval_rewards/margins")
    compared += ("kl",) if objective == "kto" else ("rewards/accuracies",)
    assert_same_runs(tmp_path / "one", tmp_path / "two", compared)
    assert any(abs(r.get("rewards/margins", 0)) > 1e-3 for r in rows(tmp_path / "one"))  # the adapter did move
    if objective == "kto":
        assert any(r.get("kl", 0) > 0 for r in rows(tmp_path / "one"))  # an estimate that is not clamped away
