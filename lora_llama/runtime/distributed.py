"""Training on several processes with torch.distributed (c10d), launched by torchrun.

Each rank takes its share of every global micro-batch (`Ranks.share`), so N processes x batch b
compute what one process computes on batch N·b. The loss is divided by the target count of the
whole global batch (`Ranks.sum`), and the adapter's gradients are summed over ranks
(`Ranks.sum_gradients`) before the update: the same update as one process, to float-summation order. ddp keeps the
whole frozen base on every rank; fsdp (`shard_model`) gives each rank 1/world of it. Only rank 0 writes files.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lora_llama.errors import UserError
from lora_llama.runtime.auto import resolve_device


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
        return items[self.rank * per_rank : (self.rank + 1) * per_rank]

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks (float64, so counts stay exact)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=_device())
        dist.all_reduce(t)
        return t.tolist()

    def sum_named(self, values: dict[str, list[float]]) -> dict[str, list[float]]:
        """`sum` over named lists of numbers in one collective, read back by name."""
        flat = self.sum([v for vs in values.values() for v in vs])
        out, start = {}, 0
        for name, vs in values.items():
            out[name], start = flat[start : start + len(vs)], start + len(vs)
        return out

    def any(self, flag: bool) -> bool:
        """Whether any rank says yes: a NaN or a stop request on one rank stops them all together."""
        return bool(self.sum([float(flag)])[0]) if self.world > 1 else flag

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the adapter's gradients over ranks, flattened into one buffer (one collective, not one per tensor)."""
        if self.world == 1 or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def choose_strategy(requested: str, ranks: Ranks, device: str, weight_bytes: int, quantized: bool) -> str:
    """ "auto": fsdp when the base would not fit one GPU (weights over 80% of its memory), ddp otherwise."""
    if requested != "auto" or ranks.world == 1:
        return requested
    if quantized or not device.startswith("cuda"):
        return "ddp"
    return "fsdp" if weight_bytes > 0.8 * torch.cuda.get_device_properties(device).total_memory else "ddp"


def shard_model(model) -> None:
    """fsdp: FSDP2 (`fully_shard`) on every decoder block, on an untied embedding and lm_head each, and on the
    root, so each rank keeps 1/world of the frozen weights, of the LoRA parameters and of the optimizer state,
    and a whole weight exists only while its module runs: a block during its forward and its backward, the
    embedding during its lookup, lm_head while the loss reads it (`gathered`). Tied, the embedding and
    lm_head stay with the root, gathered from its forward to its backward."""
    from torch.distributed.fsdp import fully_shard

    from lora_llama.quant.linear import QuantizedLinear, shardable

    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            shardable(module)
    for block in model.model.layers:
        fully_shard(block, reshard_after_forward=True)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        fully_shard(model.model.embed_tokens, reshard_after_forward=True)  # ids have no gradient: no backward
        fully_shard(model.lm_head, reshard_after_forward=False)  # freed by the loss, or after its backward
    fully_shard(model, reshard_after_forward=False)


def sharded(model) -> bool:
    """Whether fsdp has cut the model into shards (its forwards are then collectives)."""
    return any(hasattr(p, "device_mesh") for p in model.parameters())


def sum_shard_gradients(params: list[torch.Tensor], ranks: Ranks) -> None:
    """fsdp reduces gradients to their mean over ranks; the loss is already divided by the global target
    count, so the sum is wanted: x world (a custom divide factor would need PREMUL_SUM, which gloo lacks)."""
    for p in params:
        if p.grad is not None and hasattr(p.grad, "to_local"):
            p.grad.to_local().mul_(ranks.world)


def replicated(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The trainable parameters that no fully_shard owns (their gradients are summed by sum_gradients)."""
    from torch.distributed.tensor import DTensor

    return [p for p in params if not isinstance(p, DTensor)]


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every rank calls it); other tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_bytes(tensors) -> int:
    """Bytes this rank holds of the given tensors (its shard of a sharded one)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def full_optimizer_state(optimizer) -> dict:
    """The optimizer's state_dict with every sharded moment gathered whole (a collective): the same
    format whatever the number of processes, so a run can resume on another."""
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: full(v) for k, v in st.items()} for i, st in sd["state"].items()}
    return sd


def load_optimizer_state(optimizer, sd: dict) -> None:
    """load_state_dict, then the moments of sharded parameters cut into this rank's shard."""
    from torch.distributed.tensor import distribute_tensor

    optimizer.load_state_dict(sd)
    for p, st in optimizer.state.items():
        if hasattr(p, "device_mesh"):
            for k, v in st.items():
                if torch.is_tensor(v) and not hasattr(v, "device_mesh") and v.shape == p.shape:
                    st[k] = distribute_tensor(v.to(p.to_local().device), p.device_mesh, p.placements)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, ranks: Ranks) -> float:
    """torch's clip_grad_norm_ for a mix of sharded and whole gradients: the norm over all of them."""
    grads = [p.grad for p in params if p.grad is not None]

    def local(g):
        return g.to_local() if hasattr(g, "to_local") else g

    sharded = sum(float(local(g).float().pow(2).sum()) for g in grads if hasattr(g, "to_local"))
    whole = sum(float(g.float().pow(2).sum()) for g in grads if not hasattr(g, "to_local"))
    total = (ranks.sum([sharded])[0] + whole) ** 0.5
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        local(g).mul_(coef)
    return total


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def setup(device: str, timeout_s: float) -> tuple[Ranks, str]:
    """(Ranks, device) for this process: one process unless torchrun set RANK and WORLD_SIZE > 1.

    nccl with one GPU per local rank on CUDA, gloo on the CPU. A collective that waits longer
    than `timeout_s` (a dead or hung rank) raises instead of blocking forever."""
    device = resolve_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks(), device
    if not dist.is_available():
        raise UserError("this torch build has no torch.distributed; run one process")
    cuda = device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return Ranks(dist.get_rank(), dist.get_world_size()), device


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def gathered(module):
    """fsdp: a module sharded on its own (it has `unshard`) is gathered inside the block and freed after it, so
    lm_head's whole weight exists only while the loss reads it; any other module as it is."""
    if not hasattr(module, "unshard"):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()
