"""Jobs over several nodes on localhost (c10d rendezvous) and the launcher's end: two nodes equal two processes of one,
a killed launcher takes every worker with it."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import ROOT
from lora_llama.cli import main
from two_processes import (
    RECIPE,
    args,
    assert_same_runs,
    torchrun,
)

pytestmark = pytest.mark.distributed


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_localhost_equal_two_processes_of_one_node(tiny_ckpt, chat_data, tmp_path):
    """`--nnodes 2 --node-rank R --rdzv-endpoint` (c10d rendezvous), one process a node, against one node x 2."""
    code, _, err = torchrun(args(tiny_ckpt, chat_data, tmp_path / "one-node", 2))
    assert code == 0, err[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    endpoint = f"localhost:{free_port()}"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lora_llama",
                *args(tiny_ckpt, chat_data, tmp_path / "two-nodes", 2),
                "--nnodes",
                "2",
                "--node-rank",
                str(r),
                "--rdzv-endpoint",
                endpoint,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    results = [(p.wait(timeout=240), *p.communicate()) for p in nodes]
    assert all(code == 0 for code, _, _ in results), [e[-2000:] for _, _, e in results]
    assert sum("2 processes (ddp)" in out for _, out, _ in results) == 1  # rank 0, on one of the nodes, reports
    assert_same_runs(tmp_path / "one-node", tmp_path / "two-nodes", ("loss", "eval_loss"))


def test_several_nodes_need_an_endpoint(tmp_path, capsys):
    assert main(["train", RECIPE, f"output.dir={tmp_path / 'run'}", "--nnodes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rdzv-endpoint" in err[0]


def workers_of(out: Path) -> list[int]:
    """Pids of the processes whose command line names this run folder."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(out) in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(proc.name))
        except OSError:  # a process that ended while we looked
            pass
    return found


@pytest.mark.slow
def test_killing_the_launcher_ends_every_worker_and_resume_is_exact(tiny_ckpt, chat_data, tmp_path):
    """SIGKILL of `lora-llama train --nproc-per-node 2`: torchrun and both workers gone within 10 s, the run lock
    free, and `--resume` gives the uninterrupted run's adapter."""
    slow = tmp_path / "slow"  # each worker's step takes 0.5 s more, so the kill lands mid-run
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import os, time\nif 'RANK' in os.environ:\n    import lora_llama.training.trainer as t\n"
        "    _step = t.Trainer.train_step\n"
        "    t.Trainer.train_step = lambda self: (time.sleep(0.5), _step(self))[1]\n"
    )

    def argv(out):
        return args(tiny_ckpt, chat_data, out, 2, "train.max_steps=12", "train.eval_every=100")

    code, _, err = torchrun(argv(tmp_path / "full"))
    assert code == 0, err[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{slow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cut = tmp_path / "cut"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lora_llama", *argv(cut), "--nproc-per-node", "2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while not (cut / "checkpoints" / "step-4").is_dir() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launcher.poll() is None and len(workers_of(cut)) >= 3  # the launcher, torchrun and two workers
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while workers_of(cut) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert workers_of(cut) == []
    assert not (cut / "adapter").exists()
    code, _, err = torchrun(argv(cut) + ["--resume"])  # the lock is free: a run holding it would be refused
    assert code == 0, err[-3000:]
    full, resumed = (load_file(p / "adapter" / "adapter_model.safetensors") for p in (tmp_path / "full", cut))
    assert full.keys() == resumed.keys() and all(full[k].equal(resumed[k]) for k in full)  # bit for bit
