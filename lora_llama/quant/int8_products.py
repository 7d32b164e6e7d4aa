"""int8 x int8 products for an int8 base's gate and up projections on the CPU (`model.int8_products`).

The frozen weight's int8 codes multiply int8 activations directly (torch._int_mm: VNNI or AMX-INT8 where the CPU
has them, int32 sums), where the plain path dequantizes the weight to bf16 for a bf16 product:

    forward          x ≈ sx·qx, one scale per row (absmax / 127):   y = (qx · Wqᵀ) · sx · sw
    input gradient   gy·W = (gy·diag(sw)) · Wq, the scaled rows quantized the same way

Each quantization and each scaling back is one compiled loop (kernels/fused.py), so the step pays for no float32
temporaries. Nothing is saved for backward (the weight is frozen: only the input gradient is needed). Only the
projections whose inputs come straight from an RMSNorm take it: the down projection's input, SwiGLU's output,
carries outliers that per-row int8 rounds away: on the default recipe, a trial with it in int8 too (not a benchmark
kept here) ended 1.6% higher in held-out loss; without it, under 1% (`python -m bench.quant`'s int8-products).
"""

from __future__ import annotations

import torch

from lora_llama.kernels import fused

PROJECTIONS = ("gate_proj", "up_proj")  # their inputs: the post-attention RMSNorm's output


def _quantized_rows(x: torch.Tensor, column_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, float32 scale per row) of x·diag(column_scale), rounded to nearest, absmax / 127 a row."""
    scaled = x.float() * column_scale
    scale = scaled.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
    return (scaled / scale).round().to(torch.int8), scale


def _scaled_back(sums: torch.Tensor, row_scale: torch.Tensor, column_scale: torch.Tensor) -> torch.Tensor:
    return (sums.float() * row_scale * column_scale).to(torch.bfloat16)


_quantize = fused.compiled(_quantized_rows, slower="int8 products run slower", dynamic=True)
_scale_back = fused.compiled(_scaled_back, slower="int8 products run slower", dynamic=True)


def applies(x: torch.Tensor) -> bool:
    """bf16 rows on the CPU, outside torch.compile, with the compiled loops working."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and fused.compiling()


def product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (N, in) bf16 times the (out, in) weight codes·scales, transposed: (N, out) bf16."""
    # detached: x requires grad in training and not in eval, and dynamo would compile a graph for each
    qx, sx = _quantize(x.detach(), torch.ones((), dtype=torch.float32))
    return _scale_back(torch._int_mm(qx, codes.t()), sx, scales.float()[None, :])


def input_gradient(gy: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gy (N, out) times the weight: (N, in) bf16, the weight's row scales folded into gy before it is quantized."""
    qg, sg = _quantize(gy, scales.float()[None, :])
    return _scale_back(torch._int_mm(qg, codes), sg, torch.ones((), dtype=torch.float32))


class Int8Product(torch.autograd.Function):
    """x·Wᵀ + b for a frozen int8 weight, in int8 products both ways; x (N, in), 2-D (a view made inside a Function
    could not be added to in place by the layers above)."""

    @staticmethod
    def forward(ctx, x, codes, scales, bias):
        ctx.codes, ctx.scales = codes, scales  # frozen buffers, not activations: nothing is saved for backward
        y = product(x, codes, scales)
        return y.add_(bias.to(y.dtype)) if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return input_gradient(grad.contiguous(), ctx.codes, ctx.scales), None, None, None


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) through Int8Product: (..., out)."""
    y = Int8Product.apply(x.reshape(-1, x.shape[-1]), codes, scales, bias)
    return y.view(*x.shape[:-1], codes.shape[0])
