"""Frozen 8-bit (and 4-bit) base linears through bitsandbytes.

The decoder blocks' linears become `Linear8bitLt` (LLM.int8(): int8 weights with
per-row scales, outlier features above `threshold` kept in 16-bit) while the
model loads, one shard at a time, so the full-precision model never exists.
Embeddings, norms and lm_head stay in the compute dtype. LoRA wraps these
layers unchanged: it calls them, never reads their weight.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .config import DECODER_TARGETS, HF_NAME, QUANTIZE_KINDS
from .errors import UserError

DECODER_LINEARS = tuple(HF_NAME[t] for t in DECODER_TARGETS)  # q_proj ... down_proj


def _bnb():
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError("quantize needs bitsandbytes: pip install bitsandbytes") from None
    return bnb


def check_supported(kind: str, device) -> None:
    if kind not in QUANTIZE_KINDS:
        raise UserError(f"unknown quantize {kind!r} (use {' or '.join(QUANTIZE_KINDS)})")
    if kind == "nf4" and torch.device(device).type != "cuda":
        # bitsandbytes' 4-bit CPU path fails in eval mode when out_features % 32 != 0, and a backward
        # after that silently returns no input gradient: refuse rather than train wrong adapters
        raise UserError("quantize nf4 needs a CUDA GPU (bitsandbytes' 4-bit CPU path is unreliable); use int8 on CPU")


def quantize_linear(linear: nn.Linear, kind: str, threshold: float = 6.0, device="cpu") -> nn.Module:
    """A frozen bitsandbytes copy of a float nn.Linear."""
    bnb = _bnb()
    w = linear.weight.data
    if kind == "int8":
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                has_fp16_weights=False, threshold=threshold, device="meta")
        q.weight = bnb.nn.Int8Params(w.to("cpu"), requires_grad=False, has_fp16_weights=False)
    else:
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=w.dtype, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(w.to("cpu"), requires_grad=False, quant_type="nf4")
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return q.to(device)  # moving Int8Params / Params4bit is what quantises them


def quantize_loaded_linears(model, kind: str, threshold: float = 6.0, device="cpu") -> None:
    """Quantise every decoder linear whose weight has been loaded (is no longer on `meta`)."""
    check_supported(kind, device)
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name in DECODER_LINEARS:
                lin = getattr(parent, name, None)
                if type(lin) is nn.Linear and lin.weight.device.type != "meta" and \
                        (lin.bias is None or lin.bias.device.type != "meta"):
                    setattr(parent, name, quantize_linear(lin, kind, threshold, device))


def dequantized(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """dequant(quant(W)) in float32: the weight a layer quantised by `quantize_linear` multiplies with,
    computed by bitsandbytes' own functions on the state it keeps (int8: per-row absmax; nf4: blocks of 64)."""
    bnb = _bnb()
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight.data = weight.detach().to(torch.float32)
    q = quantize_linear(lin, kind)
    if kind == "int8":
        return bnb.functional.int8_vectorwise_dequant(q.weight.CB, q.weight.SCB).float()
    return bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).float()


def tensor_bytes(module: nn.Module) -> int:
    """Bytes a module holds in parameters and buffers (int8 weights + their scales, for bitsandbytes)."""
    total = sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))
    total += sum(t.numel() * t.element_size() for t in module.buffers(recurse=False))
    scb = getattr(module.weight, "SCB", None)  # LLM.int8() row scales live on the weight
    quant_state = getattr(module.weight, "quant_state", None)
    if scb is not None:
        total += scb.numel() * scb.element_size()
    if quant_state is not None:
        total += quant_state.absmax.numel() * quant_state.absmax.element_size()
    return total


def base_weight_bytes(model, decoder_linears_only: bool = False) -> int:
    """Bytes held by the frozen base weights (LoRA A/B excluded); a tied weight is counted once."""
    seen, total = set(), 0
    for name, module in model.named_modules():
        w = module._parameters.get("weight")
        if w is None or "lora_" in name or id(w) in seen:
            continue
        if decoder_linears_only and name.removesuffix(".base_layer").rsplit(".", 1)[-1] not in DECODER_LINEARS:
            continue
        seen.add(id(w))
        total += tensor_bytes(module)
    return total
