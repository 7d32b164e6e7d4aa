"""Several processes on one machine or several: `lora-llama train --nproc-per-node N` starts torchrun's launcher,
whose workers die with it, and rank 0 speaks for the job. Imports no torch (the CLI reads it before any work)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from lora_llama.errors import UserError


def speaks_for_job() -> bool:
    """Whether this process reports for the job: the only one, or rank 0 of torchrun's (RANK, as torch.distributed
    reads it)."""
    return os.environ.get("RANK", "0") == "0"


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent (torchrun's agent, or the launcher above it) exits,
    even by a SIGKILL that could not be passed on: no worker outlives its job holding the run lock (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the request took hold
        os.kill(os.getpid(), signal.SIGKILL)


PR_SET_PDEATHSIG = 1


def launcher_args(
    nproc: int, nnodes: int = 1, node_rank: int = 0, rdzv_endpoint: str | None = None, run_id: str = ""
) -> list[str]:
    """torchrun's options: this machine alone, or one of `nnodes` meeting at `rdzv_endpoint` (c10d rendezvous,
    whose store node 0 hosts). The rendezvous id is the same on every node: derived from the run's output.dir."""
    if nnodes == 1:
        return ["--standalone", f"--nproc-per-node={nproc}"]
    if not rdzv_endpoint:
        raise UserError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (node 0's address, the same on every node)")
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} is not in 0..{nnodes - 1}")
    return [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id=lora-llama-{hashlib.sha1(run_id.encode()).hexdigest()[:12]}",
        f"--rdzv-conf=is_host={int(node_rank == 0)}",
    ]


def launch(torchrun_args: list[str], argv: list[str]) -> int:
    """`lora-llama train ... --nproc-per-node N [--nnodes ...]`: torchrun's launcher with `torchrun_args`.
    Returns rank 0's exit code when rank 0 runs on this machine (torchrun's own is 1 for any failure), e.g. 2
    for a NaN loss. torchrun is SIGKILLed if this launcher dies, and its workers with it."""
    with tempfile.TemporaryDirectory(prefix="lora-llama-launch-") as tmp:
        code_file = Path(tmp) / "exit-code"
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "lora_llama", *argv]
        code = subprocess.call(
            cmd, env={**os.environ, "LORA_LLAMA_EXIT_FILE": str(code_file)}, preexec_fn=die_with_parent
        )
        return int(code_file.read_text()) if code_file.is_file() and code_file.read_text().strip() else code
