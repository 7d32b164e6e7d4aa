"""Training on several processes with torch.distributed (c10d), launched by torchrun.

Every rank holds the frozen base and the adapter; each takes its share of every global
micro-batch (`Ranks.share`), so N processes x batch b compute what one process computes on
batch N·b. The loss is divided by the target count of the whole global batch (`Ranks.sum`),
and the adapter's gradients are summed over ranks (`Ranks.sum_gradients`) before the update:
the same update as one process, to float-summation order. Only rank 0 writes files.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import UserError


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training processes (one process: rank 0 of 1)."""
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, items: list, per_rank: int) -> list:
        """This rank's consecutive slice of a global micro-batch of `per_rank` x world items."""
        return items[self.rank * per_rank:(self.rank + 1) * per_rank]

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks (float64, so counts stay exact)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=_device())
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """Whether any rank says yes: a NaN or a stop request on one rank stops them all together."""
        return bool(self.sum([float(flag)])[0]) if self.world > 1 else flag

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the adapter's gradients over ranks, flattened into one buffer (one collective, not one per tensor)."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def setup(device: str, timeout_s: float) -> tuple[Ranks, str]:
    """(Ranks, device) for this process: one process unless torchrun set RANK and WORLD_SIZE > 1.

    nccl with one GPU per local rank on CUDA, gloo on the CPU. A collective that waits longer
    than `timeout_s` (a dead or hung rank) raises instead of blocking forever."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks(), device
    if not dist.is_available():
        raise UserError("this torch build has no torch.distributed; run one process")
    cuda = device in ("auto", "cuda") and torch.cuda.is_available() or device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    elif device == "auto":
        device = "cpu"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return Ranks(dist.get_rank(), dist.get_world_size()), device


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def launch(nproc: int, argv: list[str]) -> int:
    """`lora-llama train ... --nproc-per-node N`: torchrun's launcher on this machine, N workers.
    Returns rank 0's exit code (torchrun's own is 1 for any failure), e.g. 2 for a NaN loss."""
    with tempfile.TemporaryDirectory(prefix="lora-llama-launch-") as tmp:
        code_file = Path(tmp) / "exit-code"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "lora_llama", *argv]
        code = subprocess.call(cmd, env={**os.environ, "LORA_LLAMA_EXIT_FILE": str(code_file)})
        return int(code_file.read_text()) if code_file.is_file() and code_file.read_text().strip() else code
