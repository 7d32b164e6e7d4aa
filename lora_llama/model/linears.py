"""How the model runs its linear layers: `run_linear` for one layer, and a projection for the layers that read one
input (q, k, v; gate, up). The model's own projection runs each layer; whoever wraps those layers may give the
model a projection of its own through `use_projection` (the lora folder's runs LoRA layers sharing an input as
one autograd node). The model knows only that a projection maps (x, layers) to the layers' outputs."""

from __future__ import annotations

import torch
import torch.nn as nn

from lora_llama.kernels.gemm import frozen_linear, linear


def run_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x), with a plain nn.Linear's products through `linear` when nothing needs its weights' gradients.

    Layers with hooks, under autocast, inside a compiled region (inductor writes their backward) or of other
    types (LoRA, quantized) are called as modules.
    """
    if (
        type(layer) is nn.Linear
        and not (layer._forward_hooks or layer._forward_pre_hooks)
        and not torch.is_autocast_enabled(x.device.type)
        and not torch.compiler.is_compiling()
    ):
        if not torch.is_grad_enabled():
            return linear(x, layer.weight, layer.bias)
        if not layer.weight.requires_grad and (layer.bias is None or not layer.bias.requires_grad):
            return frozen_linear(x, layer.weight, layer.bias)
    return layer(x)


def each_layer(x: torch.Tensor, layers) -> list[torch.Tensor]:
    """The model's own projection: each layer run on x."""
    return [run_linear(m, x) for m in layers]


def use_projection(model: nn.Module, projection) -> None:
    """Every module of the model that projects one input through several layers does it with `projection`,
    (x, layers) -> their outputs, from now on."""
    for module in model.modules():
        if "projection" in vars(module):
            module.projection = projection


def kept(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """x (B, T, ...) at the flat positions keep (N,) of (B, T), as (N, ...); all of x when keep is None."""
    return x if keep is None else x.flatten(0, 1).index_select(0, keep)
