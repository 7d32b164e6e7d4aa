"""The fused LoRA node: the frozen base's product and the low-rank update of every layer that shares an input (q, k, v;
gate, up) in one autograd node, which saves the input once and computes each gradient from it."""

from __future__ import annotations

import itertools

import torch

from lora_llama.kernels.gemm import linear


def _weight(source, dtype, transposed: bool = False) -> torch.Tensor:
    """A frozen weight (or its transpose), or the one a function `source(dtype, transposed)` makes just for the
    product at hand (a quantized layer's, dequantized: valid until the next one is made)."""
    if isinstance(source, torch.Tensor):
        return source.t() if transposed else source
    return source(dtype, transposed)


class _SharedInputLoRA(torch.autograd.Function):
    """y_i = x·W_iᵀ + b_i + s_i·(x·A_iᵀ)·B_iᵀ with W_i frozen, for layers reading one x; params: (W_i, b_i, A_i, B_i)*.

    Forward reads x once for all A (stacked) and saves only x and a = x·[A_1; A_2; ...]ᵀ.
    Backward does no work for the W_i and writes the whole input gradient into one buffer
    (Σ gy_i·W_i, then += ga·[A_i]), where autograd allocates one per path and adds them.
    A W_i may be a function (dtype, transposed) -> weight, as a quantized layer's dequantization is: its weight is
    made for the forward product and again for the input gradient, never kept.
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
