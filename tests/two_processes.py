"""Helpers for tests that run `lora-llama train` on two processes (torchrun, gloo on the CPU, one thread each) and
compare the runs: the data, the shared settings, the launch, the comparison of run folders."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from safetensors.torch import load_file

from helpers import RECIPE, ROOT

# examples of clearly different lengths, so padding differs between one batch of 4 and two of 2.
# lr 1e-3: Adam turns float-order noise in near-zero gradients into steps of about lr (3e-5 at lr 1e-2)
QA = [
    ("hi", "hello"),
    ("what is the capital of france", "paris is"),
    ("to be", "or not to be, that is the question"),
    ("the", "fox"),
    ("how are you today", "i am fine, thank you"),
    ("the lazy", "dog"),
    ("hello", "world"),
    ("that is", "the question of the day"),
    ("quick", "brown fox jumps over the lazy dog"),
    ("a", "b"),
    ("what is the question", "to be or not"),
    ("where", "here"),
]


COMMON = [
    "train.max_steps=6",
    "train.grad_accum=2",
    "train.warmup_steps=0",
    "train.lr=1e-3",
    "train.eval_every=3",
    "train.save_every=2",
    "data.val_size=0.25",
    "data.packing=false",  # one example a row: the tests count rows per rank
    "lora.r=4",
    "lora.dropout=0.0",
    "lora.targets=[q,k,v,o,gate,up,down]",
    "train.collective_timeout_s=60",
    "train.precision=fp32",
    "model.device=cpu",
]  # one process and two agree to 1e-5: float32 on gloo


def args(ckpt, data, out, batch, *extra):
    return [
        "train",
        RECIPE,
        f"model.source={ckpt}",
        f"data.source={data}",
        f"output.dir={out}",
        f"train.batch_size={batch}",
        *COMMON,
        *extra,
    ]


def torchrun(argv, script=None, timeout=240):
    """2 processes: through `lora-llama train --nproc-per-node 2`, or torchrun on a script that patches first.

    A worker that dies of SIGSEGV is run again once, from the run folder as it was before: gloo/FSDP2 on
    the CPU crashed so once in CI (rank 1 of the fsdp resume test, while rank 0 gathered a checkpoint;
    no crash in 100+ runs here). Its report (faulthandler's Python stack of each thread) is kept as a warning."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    if script is None:
        cmd = [sys.executable, "-m", "lora_llama", *argv, "--nproc-per-node", "2"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), *argv]
    out = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("output.dir=")))
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        if out.exists():
            shutil.copytree(out, before)
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if "Signal 11 (SIGSEGV)" in r.stderr:
            start = max(r.stderr.find("Fatal Python error"), 0)
            warnings.warn(f"a worker crashed (SIGSEGV); run again once. Its report:\n{r.stderr[start : start + 12000]}")
            shutil.rmtree(out, ignore_errors=True)
            if before.exists():
                shutil.copytree(before, out)
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def patched_script(tmp_path, patch: str):
    path = tmp_path / "patched_train.py"
    path.write_text(f"import os, sys, signal\n{patch}\nfrom lora_llama.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    return path


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_runs(one, two, keys):
    """The same steps logged in both run folders, each key within 1e-5, and the adapters as close as rounding
    lets Adam keep them (`assert_close_adapters`)."""
    a_rows, b_rows = rows(one), rows(two)
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows]
    for a, b in zip(a_rows, b_rows):
        for key in keys:
            if key in a:
                assert abs(a[key] - b[key]) < 1e-5, (key, a, b)
    assert_close_adapters(one, two)


# the share of an update that rounding may leave different between two runs (the docstring below argues it)
UPDATE_SHARE = 1e-2


def assert_close_adapters(one: Path, two: Path) -> None:
    """Two runs' final adapters differ by at most UPDATE_SHARE of how far the first run moved them since its
    oldest kept checkpoint, in norm over all tensors.

    Two runs that sum the same gradients in another order (other process counts, reduction trees, kernels) get
    gradients equal to about 1e-7 relative, and the losses they log agree to 1e-5. The weights need another
    bound: Adam divides each gradient entry by its own running RMS, so an entry whose gradient is within
    rounding of zero steps by up to lr in either direction, in a run of any size and on any CPU. Those entries
    barely move the loss (their gradient is ~0) and are few, so their share of the update's norm is small;
    a real fault (a row seen twice or missed, a rank's gradient left out, a wrong normalisation) changes every
    entry's step and gives a share of order one."""
    since = sorted((one / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    assert since, f"{one} keeps no checkpoint to measure its update from (set train.save_every)"
    x, y = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (one, two))
    start = load_file(since[0] / "adapter" / "adapter_model.safetensors")
    assert x.keys() == y.keys() == start.keys()
    differ = sum(float((x[k].double() - y[k].double()).square().sum()) for k in x) ** 0.5
    moved = sum(float((x[k].double() - start[k].double()).square().sum()) for k in x) ** 0.5
    assert moved > 0, f"the adapter did not move after {since[0].name}: nothing to compare"
    assert differ <= UPDATE_SHARE * moved, (differ, moved)
