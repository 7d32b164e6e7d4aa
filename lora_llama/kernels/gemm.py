"""x·Wᵀ for float32 and bfloat16 on the CPU through oneDNN, where PyTorch would call MKL's sgemm.

MKL picks its kernels by CPU vendor: on AMD EPYC CPUs its sgemm runs at about 175 GFLOP/s with 2 threads, where
oneDNN's JIT kernels, which PyTorch ships too and which pick by instruction set, run
the same float32 products at about 380 (bench/gemm.py measures both; on Intel CPUs
the two are expected to be close). The products with the frozen weights (the base
projections, forward and input-gradient, and the vocabulary projection of the loss)
are most of a LoRA step's work, so they (and the small LoRA products) go through `linear`.

`linear` has no autograd: it is for hand-written forward and backward passes, and for
work under no_grad. Everything it does not cover goes to F.linear (other devices and
dtypes, an x whose rows are not contiguous in memory, in = 0, builds without oneDNN).
`frozen_linear` adds the input's gradient for a frozen weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _probe():
    """oneDNN's linear (the op inductor uses on CPU) when this torch build has it and it reads a
    transposed weight view (gy·W) correctly."""
    x, w = torch.arange(6.0).view(2, 3), torch.arange(12.0).view(3, 4)
    try:
        op = torch.ops.mkldnn._linear_pointwise
        ok = torch.equal(op(x, w.t(), None, "none", [], ""), x @ w)
        return op if ok else None
    except (AttributeError, RuntimeError):
        return None


def _supported_dtypes(op) -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN has a kernel for on this CPU: float32 always; bfloat16 (float32 accumulation, ~1.5x
    F.linear's, bench/gemm.py) where the CPU has AVX-512 at least (on AVX2-only CPUs it has no bf16 primitive)."""
    if op is None:
        return ()
    x, w = torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(4, 3, dtype=torch.bfloat16)
    try:
        bf16 = torch.equal(op(x, w, None, "none", [], ""), torch.full((2, 4), 3.0, dtype=torch.bfloat16))
    except RuntimeError:
        bf16 = False
    return (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)


_ONEDNN = _probe()
ONEDNN_DTYPES = _supported_dtypes(_ONEDNN)


# wrapped as our own op for torch.compile: inductor would lower oneDNN's op, which it supports for frozen graphs
# only, while it calls a custom op as it is (eager calls oneDNN's op directly)
@torch.library.custom_op("lora_llama::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _ONEDNN(x, weight, bias, "none", [], "")


@_onednn_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def copies_transposed(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `linear` copies a transposed view of a weight of this dtype row-major first (bf16 on a CPU without a
    oneDNN bf16 primitive): a caller that writes the weight itself can write its transpose row-major instead."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and dtype not in ONEDNN_DTYPES


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·weightᵀ + bias, x (..., in), weight (out, in), which may be a transposed view (W.t() for gy·W)."""
    # oneDNN slows down ~100x on a weight whose rows are strided (a view of a wider tensor): those go to F.linear
    if (
        _ONEDNN is not None
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in ONEDNN_DTYPES
        and x.dim() >= 2
        and x.stride(-1) == 1
        and (bias is None or bias.dtype == x.dtype)
        and (weight.is_contiguous() or weight.t().is_contiguous())
        and x.shape[-1] > 0
    ):  # oneDNN has no primitive for an empty sum (in = 0)
        if torch.compiler.is_compiling():
            return _onednn_linear(x, weight, bias)
        return _ONEDNN(x, weight, bias, "none", [], "")  # eager: the custom op's dispatch costs 10-40 µs a call
    if x.device.type == "cpu" and weight.dtype == torch.bfloat16 and not weight.is_contiguous():
        # PyTorch's own bf16 kernel for gy·W (W a transposed view) runs ~70x slower than for a row-major weight on
        # CPUs without a oneDNN bf16 primitive (2048 x 5632, 128 rows, AVX2 EPYC: 11 s vs 0.15 s): copy it first
        weight = weight.contiguous()
    return F.linear(x, weight, bias)


class _FrozenLinear(torch.autograd.Function):
    """x·Wᵀ + b with W and b frozen: saves only W, and backward is one product, gy·W."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return linear(grad, weight.t()) if ctx.needs_input_grad[0] else None, None, None


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·weightᵀ + bias with autograd for x only (weight and bias frozen): both products through `linear`."""
    return _FrozenLinear.apply(x, weight, bias)
