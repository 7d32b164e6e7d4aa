"""Attention through SDPA, and a kernel for CPU training and packed rows: linear memory, no mask tensor.

`_CausalAttention` runs PyTorch's CPU flash kernel forward (it also returns the log-sum-exp) and
computes the backward a block of BLOCK query positions at a time, over tiles of at most KEYS keys,
one (key/value head, batch row) group at a time with all the query heads that share it as the rows
of one product, through oneDNN (gemm.linear: 2-3x MKL's batched GEMM on these shapes here); keys a
block cannot see are skipped and probabilities are recomputed as exp(q·kᵀ·scale - lse), so nothing
of size T x T is ever built. Packed rows (`segments`, one id per example, each example contiguous)
are independent causal problems: each example of each row runs forward and backward on its own
slice, so no dense (B, 1, T, T) mask exists and no work is spent on keys of other examples.
Measured here (fwd+bwd per layer, SmolLM2 shapes, float32, 2 threads; SDPA's / ours): 4x512
51 / 48 ms, 1x2048 154 / 133 ms, 1x8192 2077 / 1366 ms. In bfloat16 the backward runs in float32
(bf16 products would round q·kᵀ before the exponential). GPUs, float16, sliding windows, the KV
cache and inference of unpacked rows keep SDPA and its kernels (packed rows there with a mask).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .gemm import linear

BLOCK = 128  # query positions per block, KEYS keys per tile: the fastest here at 4x512 and 1x4096 (of 64-256 x 512-2048)
KEYS = 2048
_FLOATS = (torch.float32, torch.float64, torch.bfloat16)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# enable_gqa lets SDPA read k/v with fewer heads without a repeated copy (torch >= 2.5)
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal: bool = False,
           segments: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/√d + mask)·v for q (B, H, T, d) and k, v (B, H_kv, S, d), H a multiple of H_kv.

    causal: the plain causal mask (mask must be None). segments (B, T) with causal: packed rows, each
    position sees the earlier positions of its own segment. A float CPU training step, and packed rows
    on the CPU, run `_CausalAttention`; anything else SDPA (packed rows with a mask built here).
    """
    if (causal and mask is None and q.device.type == "cpu" and q.dtype in _FLOATS and q.dtype == k.dtype == v.dtype
            and q.shape[2] == k.shape[2] and _FLASH_CPU_GQA):
        training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if segments is not None or training:
            return _CausalAttention.apply(q, k, v, segments)
    if segments is not None:
        mask, causal = causal_segment_mask(segments)[:, None], False
    gqa = {}
    if k.shape[1] != q.shape[1]:
        # SDPA's CUDA kernels other than flash (float32, masks) take no enable_gqa and would fall back to
        # the O(T²)-memory math path: they get repeated keys and values
        if _SDPA_GQA and not (q.is_cuda and (q.dtype == torch.float32 or mask is not None)):
            gqa = {"enable_gqa": True}
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, **gqa)


def takes_segments(device: torch.device) -> bool:
    """Whether attend runs packed rows on this device without a mask (else the caller builds one mask, once)."""
    return device.type == "cpu" and _FLASH_CPU_GQA


def causal_segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T, T) bool: key j visible to query i when j <= i and both lie in the same segment."""
    T = segments.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return causal & (segments[:, :, None] == segments[:, None, :])


def _flash_cpu_takes_gqa() -> bool:
    """Whether this torch's CPU flash kernel exists and reads k/v with fewer heads than q."""
    if _FLASH_CPU is None:
        return False
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 3, 4, generator=g) for h in (2, 1, 1))
    try:
        out = _FLASH_CPU(q, k, v, is_causal=True)[0]
    except RuntimeError:
        return False
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    probs = (q @ k.transpose(-1, -2) / 2).masked_fill(~causal, float("-inf")).softmax(-1)
    return bool(torch.allclose(out, probs @ v, atol=1e-5))


_FLASH_CPU_GQA = _flash_cpu_takes_gqa()  # checked once at import (a few ms), not inside compiled code


class _Layout:
    """The rows of every query head sharing a key/value head, position-major: (B·H_kv, T·rep, ...), so that a
    block of positions s..e is rows s·rep..e·rep, one matrix per (batch row, key/value head) group."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor):
        self.B, self.H, self.T, self.d = q.shape
        self.Hkv = k.shape[1]
        self.rep, self.n = self.H // self.Hkv, self.B * self.Hkv

    def rows(self, t: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """(B, H, T, ...) -> (B·H_kv, T·rep, ...), copied unless already laid out so; with scale, always a new tensor."""
        g = t.unflatten(1, (self.Hkv, self.rep)).transpose(2, 3)  # (B, H_kv, T, rep, ...)
        # an explicit copy to the target layout rather than reshape: a compiled backward may see other strides
        # than it traced, and out= buffers confuse its functionalisation
        g = g.clone(memory_format=torch.contiguous_format).mul_(scale) if scale is not None else g.contiguous()
        return g.view(self.n, self.T * self.rep, *t.shape[3:])

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of rows: (B·H_kv, T·rep, d) -> (B, H, T, d)."""
        g = t.view(self.B, self.Hkv, self.T, self.rep, self.d).transpose(2, 3)
        return g.reshape(self.B, self.H, self.T, self.d)

    def tiles(self):
        """(rows, s, e, k0, k1) per block of queries s..e-1 and tile of keys k0..k1-1 it can see."""
        for s in range(0, self.T, BLOCK):
            e = min(s + BLOCK, self.T)
            for k0 in range(0, e, KEYS):
                yield slice(s * self.rep, e * self.rep), s, e, k0, min(k0 + KEYS, e)

    def hide(self, scores: torch.Tensor, s: int, e: int, k0: int, k1: int) -> torch.Tensor:
        """scores (b·rep, K) of queries s..e and keys k0..k1, with -inf where a key lies after the query."""
        if k1 > s:  # the tile reaches the diagonal
            later = torch.arange(k0, k1, device=scores.device)[None] > torch.arange(s, e, device=scores.device)[:, None]
            scores.view(e - s, self.rep, k1 - k0).masked_fill_(later[:, None], float("-inf"))
        return scores


# a tile's products, per group (2-D), through oneDNN where gemm.linear covers the dtype, F.linear elsewhere
def _nt(a, b):  # a·bᵀ
    return linear(a, b)


def _nn(a, b):  # a·b
    return linear(a, b.t())


def _tn(a, b):  # aᵀ·b, as (bᵀ·a)ᵀ: oneDNN reads the small bᵀ contiguous and a as a transposed weight
    return linear(b.t().contiguous(), a.t()).t()


def _in_float32(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 products would round q·kᵀ before the exponential: bf16 blocks run in float32 (float64 stays)."""
    return t.float() if t.dtype == torch.bfloat16 else t


def _causal_backward(q, k, v, out, lse, grad_out):
    """dq, dk, dv of plain causal attention (q (B, H, T, d), k/v (B, H_kv, T, d), lse (B, H, T)), in q's dtype."""
    dtype = q.dtype
    q, k, v, out, grad_out = (_in_float32(t) for t in (q, k, v, out, grad_out))
    L = _Layout(q, k)
    scale = 1 / math.sqrt(L.d)
    qs = L.rows(q, scale)  # the scale folded into q
    g = L.rows(grad_out)
    kk, vv = (t.contiguous().view(L.n, L.T, L.d) for t in (k, v))  # the model's k/v are strided views
    neg_lse = L.rows(torch.neg(lse).to(q.dtype)).unsqueeze(-1)  # (n, T·rep, 1)
    neg_delta = L.rows(torch.linalg.vecdot(grad_out, out).neg_()).unsqueeze(-1)  # -rowsum(dO ∘ O)
    dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(kk), torch.zeros_like(vv)
    for i in range(L.n):
        for rows, s, e, k0, k1 in L.tiles():
            q_blk, g_blk, k_t, v_t = qs[i, rows], g[i, rows], kk[i, k0:k1], vv[i, k0:k1]  # (b·rep, d), (K, d)
            p = L.hide(_nt(q_blk, k_t).add_(neg_lse[i, rows]), s, e, k0, k1).exp_()  # exp(q·kᵀ - lse)
            dv[i, k0:k1] += _tn(p, g_blk)
            ds = _nt(g_blk, v_t).add_(neg_delta[i, rows]).mul_(p)  # dS = P ∘ (dP - delta) with dP = dO·vᵀ
            dq[i, rows] += _nn(ds, k_t)
            dk[i, k0:k1] += _tn(ds, q_blk)
    return L.heads(dq.mul_(scale)).to(dtype), dk.view_as(k).to(dtype), dv.view_as(v).to(dtype)


def _pieces(segments: torch.Tensor | None, B: int, T: int) -> list[tuple[slice, slice]]:
    """(batch rows, positions) of each independent causal problem: the whole batch, or each example of each
    packed row (a run of equal segment ids)."""
    if segments is None:
        return [(slice(0, B), slice(0, T))]
    new = torch.ones_like(segments, dtype=torch.bool)
    new[:, 1:] = segments[:, 1:] != segments[:, :-1]
    pieces = []
    for r, starts in enumerate(torch.nonzero(new)[:, 1].split(new.sum(1).tolist())):
        bounds = starts.tolist() + [T]
        pieces += [(slice(r, r + 1), slice(a, b)) for a, b in zip(bounds, bounds[1:])]
    return pieces


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments):
        B, H, T, d = q.shape
        ctx.pieces = _pieces(segments, B, T)
        if segments is None:
            out, lse = _FLASH_CPU(q, k, v, is_causal=True)  # out (B, H, T, d), lse (B, H, T) in float32
        else:
            out, lse = q.new_empty(B, H, T, d), q.new_empty(B, H, T, dtype=torch.promote_types(q.dtype, torch.float32))
            for r, t in ctx.pieces:
                out[r, :, t], lse[r, :, t] = _FLASH_CPU(q[r, :, t], k[r, :, t], v[r, :, t], is_causal=True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        if len(ctx.pieces) == 1:
            return (*_causal_backward(q, k, v, out, lse, grad_out), None)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for r, t in ctx.pieces:
            dq[r, :, t], dk[r, :, t], dv[r, :, t] = _causal_backward(*(x[r, :, t] for x in (q, k, v, out, lse, grad_out)))
        return dq, dk, dv, None
