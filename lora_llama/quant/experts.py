"""A mixture's experts held frozen in a quantized format: each expert's gate_up and down weight one
`QuantizedLinear`, made by the format's handler from the stacked float weights as they load. An MoE's bytes are
in its experts, so this is where the frozen base's 8 or 4 bits count."""

from __future__ import annotations

import torch
import torch.nn as nn

from lora_llama.model.moe import Experts, grouped_experts
from lora_llama.quant.handlers import QuantFormat
from lora_llama.quant.linear import QuantizedLinear


class QuantizedExperts(nn.Module):
    """`gate_up_proj` and `down_proj` as one QuantizedLinear per expert, computed grouped as `Experts` is."""

    def __init__(self, gate_up: list[QuantizedLinear], down: list[QuantizedLinear]):
        super().__init__()
        self.num_experts = len(gate_up)
        self.gate_up_proj, self.down_proj = nn.ModuleList(gate_up), nn.ModuleList(down)

    @classmethod
    def from_experts(cls, experts: Experts, fmt: QuantFormat) -> "QuantizedExperts":
        def each(stacked: torch.Tensor) -> list[QuantizedLinear]:
            out, inp = stacked.shape[1:]
            w = stacked.detach()
            return [QuantizedLinear.from_tensors(inp, out, fmt.name, fmt.quantize(w[e])) for e in range(len(w))]

        return cls(each(experts.gate_up_proj), each(experts.down_proj))

    @property
    def dims(self) -> tuple[int, int, int]:
        """(experts, intermediate size, hidden size)."""
        first = self.down_proj[0]
        return self.num_experts, first.in_features, first.out_features

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.gate_up_proj[expert](x)

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj[expert](h)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return self.grouped(x, weights, experts, self.gate_up, self.down)

    def grouped(self, x, weights, experts, gate_up, down) -> torch.Tensor:
        return grouped_experts(x, weights, experts, self.num_experts, gate_up, down)


def quantize_loaded_experts(model, fmt: QuantFormat) -> None:
    """Replace every mixture's experts whose weights have been loaded (are no longer on `meta`) by their quantized
    copy in `fmt`; adapted ones keep their adapter and get their frozen experts quantized."""
    for block in model.model.layers:
        holder, experts = block.mlp, getattr(block.mlp, "experts", None)
        if hasattr(experts, "base_layer"):
            holder, experts = experts, experts.base_layer
        if type(experts) is Experts and not experts.down_proj.is_meta and not experts.gate_up_proj.is_meta:
            setattr(
                holder,
                "base_layer" if holder is not block.mlp else "experts",
                QuantizedExperts.from_experts(experts, fmt),
            )
