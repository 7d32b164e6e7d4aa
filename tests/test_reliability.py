"""Faults users meet: preemption (SIGTERM), kills mid-write, full disks, two runs on one folder,
broken or hostile files, memory over long runs, and any recipe input."""

import errno
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import RECIPE, ROOT, chat_file, one_error_line
from lora_llama.cli import main

QA = [
    ("hi", "hello"),
    ("what is the capital", "paris"),
    ("to be", "or not to be"),
    ("the quick", "brown fox"),
    ("how are you", "i am fine"),
    ("the lazy", "dog"),
]
# dropout makes the RNG state part of what a resume must restore
COMMON = [
    "train.max_steps=24",
    "train.batch_size=2",
    "train.grad_accum=2",
    "lora.dropout=0.1",
    "train.save_every=4",
    "train.eval_every=1000",
    "train.lr=3e-3",
    "train.warmup_steps=3",
    "data.val_size=0",
]


@pytest.fixture
def data(tmp_path):
    return chat_file(tmp_path / "d.jsonl", QA)


def train_args(ckpt, data, out, *extra):
    return ["train", RECIPE, f"model.source={ckpt}", f"data.source={data}", f"output.dir={out}", *COMMON, *extra]


def run_cli(args, patch="", wait=True):
    """`lora-llama` in a fresh process; `patch` is Python run first (to slow steps down or inject a fault)."""
    code = f"import sys, os, time, signal\n{patch}\nfrom lora_llama.cli import main\nsys.exit(main({args!r}))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return proc.communicate(timeout=300) + (proc.returncode,) if wait else proc


def adapter(out):
    return load_file(out / "adapter" / "adapter_model.safetensors")


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


SLOW_STEPS = """import lora_llama.training.trainer as t
_step = t.Trainer.train_step
t.Trainer.train_step = lambda self: (time.sleep(0.15), _step(self))[1]
"""


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_rerun_matches_bit_for_bit(tiny_ckpt, data, tmp_path):
    *_, code = run_cli(train_args(tiny_ckpt, data, tmp_path / "full"))
    assert code == 0
    proc = run_cli(train_args(tiny_ckpt, data, tmp_path / "cut"), patch=SLOW_STEPS, wait=False)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and len(metrics.read_text().splitlines() if metrics.is_file() else []) < 7:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    stopped = [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()]
    step = int(out.split("stopped by SIGTERM at step ")[1].split(":")[0])
    assert 7 <= step < 24 and f"step-{step}" in stopped and "stopped by SIGTERM" in err
    assert not (tmp_path / "cut" / "adapter").exists()
    *_, code = run_cli(train_args(tiny_ckpt, data, tmp_path / "cut"))
    assert code == 0 and same(adapter(tmp_path / "full"), adapter(tmp_path / "cut"))

    def losses(out):
        return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    assert losses(tmp_path / "full") == losses(tmp_path / "cut")  # metrics.jsonl continues without repeats


@pytest.mark.slow
def test_kill_while_writing_a_checkpoint_resumes_from_the_previous_one(tiny_ckpt, data, tmp_path):
    *_, code = run_cli(train_args(tiny_ckpt, data, tmp_path / "full"))
    kill_at_8 = """import lora_llama.training.run_folder as rf, lora_llama.training.checkpoints as c
_save = rf.save_state
def save_then_die(folder, state):
    _save(folder, state)
    if "step-8" in str(folder):
        os.kill(os.getpid(), signal.SIGKILL)  # the state is written, trainer_state.json and the rename are not
c.save_state = save_then_die
"""
    *_, code = run_cli(train_args(tiny_ckpt, data, tmp_path / "cut"), patch=kill_at_8)
    assert code == -signal.SIGKILL
    ckpts = tmp_path / "cut" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".")) == ["step-4"]
    assert any(p.name.startswith(".step-8.tmp-") for p in ckpts.iterdir())  # the half-written one, hidden
    *_, code = run_cli(train_args(tiny_ckpt, data, tmp_path / "cut"))
    assert code == 0 and same(adapter(tmp_path / "full"), adapter(tmp_path / "cut"))
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]  # the leftover was removed
    # steps 5-8 were logged before the kill and again after the resume from step 4: each counts once
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "cut" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 25))
    logged = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 25))


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", str(args[1] if len(args) > 1 else "?"))


@pytest.mark.parametrize("writer", ["checkpoint", "final adapter"])
def test_a_full_disk_while_training_is_one_line_and_keeps_the_last_checkpoint(
    tiny_ckpt, data, tmp_path, monkeypatch, capsys, writer
):
    import safetensors.torch

    real = safetensors.torch.save_file
    calls = []

    def failing(tensors, path, *a, **k):
        calls.append(str(path))
        in_checkpoint = "checkpoints" in str(path)
        if (writer == "checkpoint" and in_checkpoint and "step-8" in str(path)) or (
            writer == "final adapter" and not in_checkpoint
        ):
            enospc(tensors, path)
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    out = tmp_path / "run"
    assert main(train_args(tiny_ckpt, data, out)) == 2
    err = capsys.readouterr().err
    assert one_error_line(err) and "No space left on device" in err
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == (["step-4"] if writer == "checkpoint" else ["step-20", "step-24"])
    load_file(out / "checkpoints" / ckpts[-1] / "adapter" / "adapter_model.safetensors")  # intact
    assert not [p for p in out.rglob(".*") if ".tmp-" in p.name] and not (out / "adapter").exists()


def test_a_failed_merge_write_leaves_nothing(tiny_ckpt, data, tmp_path, monkeypatch, capsys):
    import lora_llama.outputs.merge

    assert main(train_args(tiny_ckpt, data, tmp_path / "run", "train.max_steps=2")) == 0
    monkeypatch.setattr(
        lora_llama.outputs.merge,
        "write_safetensors_streaming",
        lambda path, *a, **k: (_ for _ in ()).throw(OSError(errno.EFBIG, "File too large", str(path))),
    )
    code = main(
        [
            "merge",
            "--base",
            str(tiny_ckpt),
            "--adapter",
            str(tmp_path / "run" / "adapter"),
            "--out",
            str(tmp_path / "merged"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "File too large" in err and one_error_line(err)
    assert [p.name for p in tmp_path.iterdir() if "merged" in p.name] == []


@pytest.mark.slow
def test_a_failed_cache_write_leaves_nothing(smollm2, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    # transformers' modeling_utils binds save_file when first imported: imported before the patch, it keeps the real
    # one (else this test, run first, would break every later checkpoint save of the pytest run)
    importlib.import_module("transformers.modeling_utils")

    monkeypatch.setenv("LORA_LLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(
        safetensors.torch,
        "save_file",
        lambda t, path, **k: (_ for _ in ()).throw(OSError(errno.EACCES, "Permission denied", str(path))),
    )
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and one_error_line(err)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_one_run_per_folder(tiny_ckpt, data, tmp_path, capsys):
    from lora_llama.training.run_folder import run_lock

    out = tmp_path / "run"
    with run_lock(out):  # as a live run holds it
        start = time.perf_counter()
        assert main(train_args(tiny_ckpt, data, out, "train.max_steps=2")) == 2
        err = capsys.readouterr().err
        assert f"in use by a running `lora-llama train` (pid {os.getpid()})" in err
        assert time.perf_counter() - start < 5 and not out.exists()
    # the lock file of a run that died (pid written, no flock held) is taken over
    (tmp_path / ".run.lock").write_text("999999\n")
    assert main(train_args(tiny_ckpt, data, out, "train.max_steps=2")) == 0


def test_resume_loads_no_pickle(tiny_ckpt, data, tmp_path, monkeypatch):
    import pickle

    out = tmp_path / "run"
    assert main(train_args(tiny_ckpt, data, out, "train.max_steps=4")) == 0
    shutil.rmtree(out / "adapter")  # as if stopped after the last checkpoint
    assert sorted(p.name for p in (out / "checkpoints" / "step-4").iterdir()) == [
        "adapter",
        "state.json",
        "state.safetensors",
        "trainer_state.json",
    ]

    def forbidden(*a, **k):
        raise AssertionError("a pickle was loaded")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, forbidden)
    assert main(train_args(tiny_ckpt, data, out, "train.max_steps=6", "--resume")) == 0


def corrupt_checkpoint_cases(ckpt):
    return {
        "truncated state": (ckpt / "state.safetensors", lambda p: p.write_bytes(p.read_bytes()[:100])),
        "state json": (ckpt / "state.json", lambda p: p.write_text("{broken")),
        "trainer state": (ckpt / "trainer_state.json", lambda p: p.write_text(json.dumps({"step": "x"}))),
        "adapter tensors": (ckpt / "adapter" / "adapter_model.safetensors", lambda p: p.write_bytes(b"\0" * 7)),
    }


@pytest.mark.parametrize("case", list(corrupt_checkpoint_cases(ROOT)))
def test_a_broken_checkpoint_names_the_file(tiny_ckpt, data, tmp_path, capsys, case):
    out = tmp_path / "run"
    assert main(train_args(tiny_ckpt, data, out, "train.max_steps=4")) == 0
    shutil.rmtree(out / "adapter")
    path, damage = corrupt_checkpoint_cases(out / "checkpoints" / "step-4")[case]
    damage(path)
    capsys.readouterr()
    assert main(train_args(tiny_ckpt, data, out, "train.max_steps=6", "--resume")) == 2
    err = capsys.readouterr().err
    assert path.name in err and one_error_line(err)


@pytest.mark.slow
def test_memory_stays_flat_over_300_steps(tiny_ckpt, data, tmp_path):
    """RSS after each logged step; growth from step 50 (warm) to step 300 under 5%."""
    record = """import lora_llama.training.run_folder as t
_write = t.MetricsLog.write
RSS = []
def write(self, record):
    _write(self, record)
    RSS.append(int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]))
    if record.get("step") == 300:
        print("RSS", RSS[50], RSS[-1], flush=True)
t.MetricsLog.write = write
"""
    out, err, code = run_cli(
        train_args(
            tiny_ckpt, data, tmp_path / "run", "train.max_steps=300", "train.save_every=100", "lora.dropout=0.0"
        ),
        patch=record,
    )
    assert code == 0, err[-2000:]
    warm, end = map(int, out.split("RSS ")[1].split()[:2])
    print(f"RSS after step 50: {warm} kB, after step 300: {end} kB ({100 * (end / warm - 1):+.2f}%)")
    assert end < 1.05 * warm, (warm, end)


def test_a_resume_drops_the_logs_written_after_its_checkpoint(tiny_ckpt, tmp_path, capsys):
    """metrics.jsonl and samples.jsonl (eval.prompts' answers) keep one line per step across a resume: what the
    stopped run wrote after its checkpoint goes."""
    data = chat_file(tmp_path / "d.jsonl", QA)
    run = tmp_path / "run"
    argv = ["train", RECIPE, f"model.source={tiny_ckpt}", f"data.source={data}", "data.packing=false"]
    argv += ["train.eval_every=1", "train.save_every=2", "eval.prompts=[hi]", f"output.dir={run}"]
    assert main([*argv, "train.max_steps=2"]) == 0
    for name in ("metrics.jsonl", "samples.jsonl"):  # as if the run had gone on past step 2 and been killed
        with open(run / name, "a") as f:
            f.write(json.dumps({"step": 3, "samples": {"hi": "x"}, "loss": 9.0}) + "\n")
    assert main([*argv, "train.max_steps=4", "--resume"]) == 0
    capsys.readouterr()
    samples = [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples == [0, 1, 2, 3, 4]
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r.get("loss") != 9.0 for r in losses) and max(r["step"] for r in losses) == 4
