"""Hand-written forward/backward pieces of the elementwise kind: RMSNorm, RoPE, SwiGLU, recompute-on-backward.

Each saves less for backward and allocates fewer buffers than autograd's version of the
same formula; the formulas are in the docstrings, and tests check each against autograd
(gradcheck in float64). model/llama.py calls these and reads as architecture and maths. Training in bf16 on
the CPU, RMSNorm and SwiGLU take kernels/fused.py's compiled versions of the same formulas.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from lora_llama.kernels import fused


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _float_mul(x: torch.Tensor, s: torch.Tensor, xf: torch.Tensor | None = None) -> torch.Tensor:
    """x·s in at least float32 (s in that dtype too): in place on x's float copy (xf, made here if not given)
    when x needs one (bf16)."""
    xf = _at_least_float32(x) if xf is None else xf
    return xf.mul_(s) if xf is not x else xf * s


class _RMSNorm(torch.autograd.Function):
    """weight · (x / rms(x)), computed in float32 and cast back as HF does (the checkpoints were trained so).

    Saves x and the per-row 1/rms only. With x̂ = x/rms and gw = grad·weight, the input gradient is
        dx = (gw - x̂ · mean(gw · x̂)) / rms
    written into two buffers, where autograd's version makes about six. A bf16 x or grad is cast to
    float32 once, into the buffer the next step writes in place.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        if any(ctx.needs_input_grad) and fused.active(x):  # training in bf16 on the CPU: one compiled loop
            y, rstd = fused.rms_norm_forward(x, weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            return y
        xf = _at_least_float32(x)
        # mean(x²) as |x|²/n: no (..., dim) temporary (a pass over memory less; equal to ~1e-7)
        rstd = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        y = _float_mul(x, rstd, xf).to(x.dtype)
        return y.mul_(weight) if torch.promote_types(y.dtype, weight.dtype) == y.dtype else weight * y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        if fused.active(x, grad):
            return (*fused.rms_norm_backward(x, weight, rstd, grad, ctx.needs_input_grad[1]), None)
        x_hat = _float_mul(x, rstd)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (_at_least_float32(grad) * x_hat).flatten(0, -2).sum(0).to(weight.dtype)
        gw = _float_mul(
            grad, _at_least_float32(weight)
        )  # a float32 weight: a bf16 one would take a slow mixed-dtype path
        c = torch.linalg.vecdot(gw, x_hat).unsqueeze(-1) / x.shape[-1]  # mean(gw · x̂) per row
        grad_x = gw.sub_(x_hat.mul_(c)).mul_(rstd) if ctx.needs_input_grad[0] else None
        return (grad_x.to(x.dtype) if grad_x is not None else None), grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if torch.compiler.is_compiling():  # inside a compiled block inductor fuses the plain formula, both ways
        return fused.rms_norm_formula(x, weight, eps)[0]
    return _RMSNorm.apply(x, weight, eps)


class _Rope(torch.autograd.Function):
    """x·cos + rotate_half(x)·sin with rotate_half(x) = (-x2, x1), HF's layout, in one output buffer.

    With x = (x1, x2) by halves and cos, sin equal in both halves:
        out1 = x1·cos - x2·sin,  out2 = x2·cos + x1·sin
    and the backward is the inverse rotation:
        dx1 = g1·cos + g2·sin,   dx2 = g2·cos - g1·sin
    One allocation each way, where autograd's version makes five (products, negation, concatenation, sum).
    """

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _Rope.rotate(x, cos, sin, sign=1)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _Rope.rotate(grad, cos, sin, sign=-1), None, None

    @staticmethod
    def rotate(x, cos, sin, sign: int):
        h = x.shape[-1] // 2
        out = x * cos
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-sign)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:], value=sign)
        return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim); cos/sin: (B, 1, T, head_dim)."""
    if torch.compiler.is_compiling():
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return _Rope.apply(x, cos, sin)


def rotate_back(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of apply_rope's input from its output's (the inverse rotation), outside autograd."""
    return _Rope.rotate(grad, cos, sin, sign=-1)


class _SwiGLU(torch.autograd.Function):
    """silu(g)·u that keeps only g and u for backward and recomputes silu(g) there:
    one (B, T, intermediate) activation less per layer than autograd would store."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return silu_mul(g, u)

    @staticmethod
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        if fused.active(g, u, grad):
            return fused.swiglu_backward(g, u, grad)
        # d/dg = (grad·u)·silu'(g) by aten's fused silu_backward, d/du = grad·silu(g): four passes over memory where
        # the formula written out takes seven
        return torch.ops.aten.silu_backward(grad * u, g), F.silu(g).mul_(grad)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g)·u; without a graph to record, in place on a fresh silu(g)."""
    if torch.compiler.is_compiling():
        return fused.swiglu_formula(g, u)
    return _SwiGLU.apply(g, u) if g.requires_grad or u.requires_grad else F.silu(g).mul_(u)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g)·u of a training step (forward, and its recomputation in backward): compiled for bf16 on the CPU,
    else in place on a fresh silu(g) (one (B, T, intermediate) buffer, not two)."""
    return fused.swiglu_forward(g, u) if fused.active(g, u) else F.silu(g).mul_(u)


@contextlib.contextmanager
def recompute_when_saved(tensor: torch.Tensor, recompute, active: bool = True):
    """Inside the block, autograd keeps `tensor` (or any view of it) as a recipe, not as memory.

    For cheap tensors (a norm's output, the SwiGLU product) that LoRA-A layers save for their
    weight gradient: backward calls `recompute()` once, from inputs that are saved anyway.
    """
    if not (active and torch.is_grad_enabled()) or torch.compiler.is_compiling():  # compiled: the partitioner decides
        yield
        return
    storage, cache = tensor.untyped_storage().data_ptr(), {}

    def pack(t):
        if t.untyped_storage().data_ptr() == storage:
            return (cache, t.shape, t.stride(), t.storage_offset())
        # detached: a node that saves its own output must not hold that output's grad_fn (an uncollectable cycle)
        return t.detach()

    def unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        cache, shape, stride, offset = packed
        if "t" not in cache:
            with torch.no_grad():
                cache["t"] = recompute()
        return cache["t"].as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
