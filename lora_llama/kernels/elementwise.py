"""Hand-written forward/backward pieces: RMSNorm, RoPE, SwiGLU, recompute-on-backward, the fused LoRA node.

Each saves less for backward and allocates fewer buffers than autograd's version of the
same formula; the formulas are in the docstrings, and tests check each against autograd
(gradcheck in float64). model.py and lora.py call these and read as architecture and maths. Training in bf16 on
the CPU, RMSNorm and SwiGLU take fused.py's compiled versions of the same formulas.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn.functional as F

from lora_llama.kernels import fused
from lora_llama.kernels.gemm import linear, run_linear


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
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
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
        return F.silu(g) * u
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


def _weight(source, dtype, transposed: bool = False) -> torch.Tensor:
    """A frozen weight (or its transpose), or a quantized layer's weight dequantized into dtype just for the product
    at hand (`transient_weight`: valid until the next one is made)."""
    if isinstance(source, torch.Tensor):
        return source.t() if transposed else source
    return source.transient_weight(dtype, transposed)


class _SharedInputLoRA(torch.autograd.Function):
    """y_i = x·W_iᵀ + b_i + s_i·(x·A_iᵀ)·B_iᵀ with W_i frozen, for layers reading one x; params: (W_i, b_i, A_i, B_i)*.

    Forward reads x once for all A (stacked) and saves only x and a = x·[A_1; A_2; ...]ᵀ.
    Backward does no work for the W_i and writes the whole input gradient into one buffer
    (Σ gy_i·W_i, then += ga·[A_i]), where autograd allocates one per path and adds them.
    A W_i may be a quantized layer (anything with `transient_weight(dtype)`): its weight is dequantized for the
    forward product and again for the input gradient, never kept.
    """

    @staticmethod
    def forward(ctx, x, scales, *params):
        layers = [params[i : i + 4] for i in range(0, len(params), 4)]
        lora_a = torch.cat([p[2] for p in layers]) if len(layers) > 1 else layers[0][2]  # (Σr, in)
        # bf16-mixed: A and B are float32 master weights, used in x's dtype (x and W0 share it)
        a = linear(x, lora_a.to(x.dtype))  # (N, Σr)
        ends = list(itertools.accumulate(p[3].shape[1] for p in layers))
        ctx.cols = [slice(e - p[3].shape[1], e) for e, p in zip(ends, layers)]  # layer i's columns of a
        ys = [
            linear(x, _weight(w0, x.dtype), bias).addmm_(a[:, cols], lora_b.to(x.dtype).t(), alpha=scale)  # (N, out_i)
            for (w0, bias, _, lora_b), cols, scale in zip(layers, ctx.cols, scales)
        ]
        ctx.layers = {i: p for i, p in enumerate(params) if p is not None and not isinstance(p, torch.Tensor)}
        ctx.save_for_backward(x, a, lora_a, *[None if i in ctx.layers else p for i, p in enumerate(params)])
        ctx.scales = scales
        ctx.set_materialize_grads(False)  # an output outside the loss gets None, not a zero-filled gradient
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads_y):
        x, a, lora_a, *params = ctx.saved_tensors
        params = [ctx.layers.get(i, p) for i, p in enumerate(params)]
        dtype = x.dtype  # of the products; the gradients of A and B are returned in their own dtype
        need = ctx.needs_input_grad[2:]  # per params entry
        grads, grad_x = [None] * len(params), None
        ga = torch.zeros_like(a)  # gradient reaching a, (N, Σr)
        for i, (gy, cols, scale) in enumerate(zip(grads_y, ctx.cols, ctx.scales)):
            if gy is None:
                continue
            lora_b = params[4 * i + 3]
            ga[:, cols] = linear(gy, lora_b.to(dtype).t()).mul_(scale)
            if need[4 * i + 3]:
                # B_i: (out_i, r) = gyᵀ·a, as (aᵀ·gy)ᵀ: a product over the N rows goes to oneDNN as small·(big view)ᵀ
                grads[4 * i + 3] = linear(a[:, cols].t().contiguous(), gy.t()).t().to(lora_b.dtype).mul_(scale)
            if ctx.needs_input_grad[0]:
                gx = linear(gy, _weight(params[4 * i], dtype, transposed=True))  # gy·W_i
                grad_x = gx if grad_x is None else grad_x.add_(gx)
        reached = [gy is not None and need[4 * i + 2] for i, gy in enumerate(grads_y)]
        if any(reached):
            grad_lora_a = linear(ga.t().contiguous(), x.t()).to(lora_a.dtype)  # (Σr, in) = gaᵀ·x: one product for all A
            for i, cols in enumerate(ctx.cols):
                grads[4 * i + 2] = grad_lora_a[cols] if reached[i] else None  # as autograd: None, not zeros
        if grad_x is not None:
            grad_x.addmm_(ga, lora_a.to(dtype))
        return (grad_x, None, *grads)


def low_rank_linears(x: torch.Tensor, nodes: list[tuple]) -> tuple[torch.Tensor, ...]:
    """One autograd node for layers reading x (N, in); nodes: (W0, b, A, B, scale) per layer."""
    return _SharedInputLoRA.apply(x, tuple(n[4] for n in nodes), *[t for n in nodes for t in n[:4]])


def project(x: torch.Tensor, layers) -> list[torch.Tensor]:
    """The outputs of linear layers that read the same x (q, k, v; gate, up).

    A layer that offers a low-rank node (`layer.low_rank_node(x2)` returning (W0, b, A, B, scale),
    as LoRA layers do on their plain path) joins the others in one autograd node when all of
    them offer one; anything else (plain or quantised layers, dropout, autocast) runs layer by layer.
    """
    x2 = x.reshape(-1, x.shape[-1])
    # compiled, each layer runs its plain formula and inductor writes the backward
    fusable = len(layers) > 1 and not torch.compiler.is_compiling()
    nodes = [getattr(m, "low_rank_node", lambda _: None)(x2) for m in layers] if fusable else [None]
    if all(n is not None for n in nodes):
        return [y.view(*x.shape[:-1], y.shape[-1]) for y in low_rank_linears(x2, nodes)]
    return [run_linear(m, x) for m in layers]
