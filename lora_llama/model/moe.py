"""A mixture of experts in place of a layer's MLP, as transformers 5 computes it (modeling_mixtral.py,
modeling_qwen2_moe.py, modeling_qwen3_moe.py), and its load-balancing loss.

The router scores each token against every expert (softmax in float32), keeps the top k (renormalised where the
config says), and each token's output is the weighted sum of its k experts' SwiGLU MLPs. The experts are stored
as transformers 5 stores them: `experts.gate_up_proj` (E, 2I, H) and `experts.down_proj` (E, H, I). They are
computed grouped: the (token, expert) pairs sorted by expert, one product per expert over all its tokens, never
a loop over tokens. Qwen2-MoE adds a shared expert every token passes through, scaled by a sigmoid gate.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lora_llama.model.config import ModelArgs, MoeArgs


class Router(nn.Module):
    """`gate.weight` (E, H): (logits (N, E), top-k weights (N, k) float32, top-k experts (N, k))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.moe = args.moe
        self.weight = nn.Parameter(torch.zeros(args.moe.num_experts, args.dim))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top, experts


class Experts(nn.Module):
    """E SwiGLU MLPs in two stacked weights, computed grouped."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        e, i, h = args.moe.num_experts, args.moe.expert_dim, args.dim
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.gate_up_proj[expert])

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.down_proj[expert])

    @property
    def dims(self) -> tuple[int, int, int]:
        """(experts, intermediate size, hidden size)."""
        e, h, i = self.down_proj.shape
        return e, i, h

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return self.grouped(x, weights, experts, self.gate_up, self.down)

    def grouped(self, x, weights, experts, gate_up, down) -> torch.Tensor:
        return grouped_experts(x, weights, experts, self.num_experts, gate_up, down)


def grouped_experts(x, weights, experts, num_experts: int, gate_up, down) -> torch.Tensor:
    """x (N, H), weights and experts (N, k) -> (N, H): each token's weighted sum of its k experts' SwiGLU, whose
    products are gate_up(e, x) and down(e, h) (the experts' own, quantized, or with an adapter around them)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    outs = []
    for e, xe in enumerate(x.index_select(0, tokens).split(counts)):
        if counts[e]:
            g, u = gate_up(e, xe).chunk(2, dim=-1)
            outs.append(down(e, F.silu(g) * u))
    y = torch.cat(outs) * weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)


class SparseMoE(nn.Module):
    """The mixture in a layer's MLP place: `gate` (the router), `experts`, and Qwen2-MoE's `shared_expert` with
    its `shared_expert_gate`. The router's logits of each forward are kept in `record` when it is a list (the
    load-balancing loss reads them)."""

    def __init__(self, args: ModelArgs, shared_expert: nn.Module | None = None):
        super().__init__()
        self.gate = Router(args)
        self.experts = Experts(args)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False)
        self.record: list | None = None

    def forward(self, x: torch.Tensor, lean: bool = False) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, experts = self.gate(flat)
        if self.record is not None:
            self.record.append(logits)
        y = self.experts(flat, weights, experts)
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(F.linear(flat, self.shared_expert_gate.weight)) * self.shared_expert(flat, lean)
        return y.view(x.shape)


def load_balancing_loss(router_logits: list[torch.Tensor], moe: MoeArgs, keep: torch.Tensor | None = None):
    """Switch Transformer's load-balancing loss over every layer's router logits (N, E), as transformers'
    `load_balancing_loss_func` computes it: E · Σ_e (share of top-k picks that went to e) · (mean probability of
    e), over the tokens where keep (N,) is True (all when None)."""
    e = moe.num_experts
    picks, probs, rows = 0.0, 0.0, 0.0
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = F.one_hot(torch.topk(p, moe.top_k, dim=-1).indices, e).sum(1).float()  # (N, E) picks per token
        w = torch.ones_like(p[:, 0]) if keep is None else keep.float()
        picks, probs, rows = picks + (chosen * w[:, None]).sum(0), probs + (p * w[:, None]).sum(0), rows + w.sum()
    return e * torch.sum(picks / rows * probs / rows)


def router_loss(model, parts: int = 1) -> torch.Tensor | float:
    """router_aux_loss_coef times the load-balancing loss of the model's last forward, where its config asks for it
    (`output_router_logits`), else 0; divided by `parts` (the micro-batches and ranks it is summed over)."""
    moe = model.args.moe
    if moe is None or not moe.output_router_logits or not moe.router_aux_loss_coef or not model.router_logits:
        return 0.0
    return moe.router_aux_loss_coef * load_balancing_loss(model.router_logits, moe) / parts


# A checkpoint on the Hub (and transformers' save_pretrained) holds each expert's linears apart; the model holds
# them stacked. Checkpoint names -> (the stacked tensor, which part): gate and up are the two halves of gate_up_proj.
_EXPERT_LINEARS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def stacked_name(key: str) -> tuple[str, int, str] | None:
    """(the model's stacked tensor, expert, part) for one expert's linear in a checkpoint
    (`model.layers.L.mlp.experts.E.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.E.w1.weight`), else None."""
    parts = key.split(".")
    if len(parts) != 8 or parts[3] not in ("mlp", "block_sparse_moe") or parts[4] != "experts":
        return None
    if not parts[5].isdigit() or parts[6] not in _EXPERT_LINEARS or parts[7] != "weight":
        return None
    part = _EXPERT_LINEARS[parts[6]]
    stacked = "down_proj" if part == "down" else "gate_up_proj"
    return f"{'.'.join(parts[:3])}.mlp.experts.{stacked}", int(parts[5]), part


def native_name(key: str) -> str:
    """A checkpoint's name for a tensor the model holds under another: Mixtral's `block_sparse_moe` is `mlp`."""
    return key.replace(".block_sparse_moe.", ".mlp.", 1)


class ExpertStacks:
    """Each expert's linears read from a checkpoint, shard by shard, written into the model's stacked tensors;
    a stack is handed over (`done`) once every expert's part of it has been read."""

    def __init__(self, shapes: dict, dtype, device):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.stacks: dict[str, torch.Tensor] = {}
        self.filled: dict[str, set] = {}

    def add(self, key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Place one expert's linear; (name, stacked tensor) when its stack is complete."""
        name, expert, part = stacked_name(key)
        shape = self.shapes[name]
        if name not in self.stacks:
            self.stacks[name] = torch.empty(shape, dtype=self.dtype or tensor.dtype, device=self.device)
            self.filled[name] = set()
        half = shape[1] // 2
        rows = {"gate": slice(0, half), "up": slice(half, shape[1]), "down": slice(0, shape[1])}[part]
        into = self.stacks[name][expert, rows]
        if into.shape != tensor.shape:
            raise ValueError(f"{key} has shape {tuple(tensor.shape)}, config.json implies {tuple(into.shape)}")
        into.copy_(tensor)
        self.filled[name].add((expert, part))
        if len(self.filled[name]) < shape[0] * (1 if part == "down" else 2):
            return None
        del self.filled[name]
        return name, self.stacks.pop(name)

    def missing(self) -> list[str]:
        return sorted(self.stacks)
