"""LoRA on a mixture's experts, held as peft holds `target_parameters` adapters (peft's ParamWrapper), so peft,
vLLM and lora-llama load each other's adapters unchanged.

Each of the stacked expert weights (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)) gets rank-r factors for
every expert, stacked: lora_A (r·E, in) holds expert e's A in rows e·r .. (e+1)·r; lora_B (out, r·E) holds its B
in the columns e, E + e, 2E + e, ...; ΔW_e = scale · B_e · A_e. The router stays frozen. Unlike peft, which adds
every expert's ΔW to the stacked weight before each forward, the update runs inside the grouped product: each
expert's tokens pass through its own A_e and B_e, and no weight-sized delta is ever made.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lora_llama.errors import UserError
from lora_llama.lora.init import init_adapter
from lora_llama.lora.settings import lora_scale
from lora_llama.model.moe import Experts

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # in the order peft's target_parameters lists them


def expert_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int, expert: int | None = None):
    """(A_e (r, in), B_e (out, r)) of one expert from peft's stacked lora_A (r·E, in) and lora_B (out, r·E); with
    expert None, every expert's: (A (E, r, in), B (out, r, E))."""
    a = lora_a.view(experts, lora_a.shape[0] // experts, -1)
    b = lora_b.view(lora_b.shape[0], lora_b.shape[1] // experts, experts)
    return (a, b) if expert is None else (a[expert], b[:, :, expert])


class StackedLoRA(nn.Module):
    """Rank-r factors of E experts' (out, in) weights, stacked as peft stacks them."""

    def __init__(self, experts: int, out_features: int, in_features: int, r: int, init):
        super().__init__()
        self.experts = experts
        self.lora_A = nn.Linear(in_features, r * experts, bias=False)
        self.lora_B = nn.Linear(r * experts, out_features, bias=False)
        init_adapter(self.lora_A, self.lora_B, init)

    def update(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        a, b = expert_factors(self.lora_A.weight, self.lora_B.weight, self.experts, expert)
        return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))

    def delta(self, scale: float) -> torch.Tensor:
        """Every expert's scale · B_e · A_e, (E, out, in)."""
        a, b = expert_factors(self.lora_A.weight, self.lora_B.weight, self.experts)
        return torch.einsum("ore,eri->eoi", b, a) * scale


class LoRAExperts(nn.Module):
    """A mixture's experts (`base_layer`) with LoRA on both stacked weights."""

    def __init__(self, base: Experts, r: int, alpha: float, rslora: bool = False, init=True):
        super().__init__()
        if init not in (True, False, "gaussian"):
            raise UserError(f"LoRA on experts starts from init_lora_weights true, false or gaussian, not {init!r}")
        self.base_layer = base
        e, i, h = base.dims
        self.gate_up_proj = StackedLoRA(e, 2 * i, h, r, init)
        self.down_proj = StackedLoRA(e, h, i, r, init)
        self.r, self.alpha, self.rslora, self.init = r, alpha, rslora, init
        self.dropout, self.use_dora = 0.0, False  # neither works on stacked experts (nor in peft)
        self.scale = lora_scale(r, alpha, rslora)
        self.disabled = self.merged = False

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer.gate_up(expert, x) + self.gate_up_proj.update(expert, x) * self.scale

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        return self.base_layer.down(expert, h) + self.down_proj.update(expert, h) * self.scale

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        if self.disabled or self.merged:
            return self.base_layer(x, weights, experts)
        return self.base_layer.grouped(x, weights, experts, self.gate_up, self.down)

    @torch.no_grad()
    def merge(self, sign: int = 1) -> None:
        """Add (or with sign -1, take back) every expert's ΔW into the stacked weights."""
        for name in EXPERT_WEIGHTS:
            w = getattr(self.base_layer, name)
            if not isinstance(w, torch.Tensor):
                raise UserError(
                    "merging LoRA into quantized experts needs their original weights: use lora-llama merge"
                )
            w.add_(getattr(self, name).delta(self.scale).to(w.dtype), alpha=sign)
        self.merged = sign > 0


def expert_modules(model) -> dict[str, LoRAExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRAExperts)}
