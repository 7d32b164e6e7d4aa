"""Attention through SDPA, and a blocked kernel for CPU training and packed rows: linear memory, no mask tensor.

`_BlockedAttention` computes causal attention a block of BLOCK query positions at a time, over
tiles of at most KEYS keys, with batched GEMMs over all the query heads that share a key/value
head; keys a block cannot see are skipped, so nothing of size T x T is ever built. Packed rows
(`segments`, one id per example) attend causally inside their own example: each block starts at
the first key its earliest query's example holds, and a (B, block, tile) visibility test from the
segment ids replaces the dense (B, 1, T, T) mask. The forward of plain causal rows is PyTorch's
CPU flash kernel (it also returns the log-sum-exp); packed rows take a blocked forward with an
online softmax over the key tiles. The backward recomputes probabilities as exp(q·kᵀ·scale - lse).
At SmolLM2 shapes (batch 4 x 512) the backward takes ~35 ms per layer where SDPA's takes ~45 ms.
In bfloat16 the blocks run in float32 (bf16 products would round q·kᵀ before the exponential).
GPUs, float16, sliding windows, the KV cache and inference of unpacked rows keep SDPA and its kernels.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BLOCK = 64  # query positions per block: 32-64 were fastest here at T=512 and 4096 (fwd+bwd within 5%)
KEYS = 512  # keys per tile: a tile's probabilities (B·H_kv, BLOCK·rep, KEYS) stay in the L2 cache
_FLOATS = (torch.float32, torch.float64, torch.bfloat16)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# enable_gqa lets SDPA read k/v with fewer heads without a repeated copy (torch >= 2.5)
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal: bool = False,
           segments: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/√d + mask)·v for q (B, H, T, d) and k, v (B, H_kv, S, d), H a multiple of H_kv.

    causal: the plain causal mask (mask must be None). segments (B, T) with causal: packed rows, each
    position sees the earlier positions of its own segment. A float CPU training step, and packed rows
    on the CPU, run `_BlockedAttention`; anything else SDPA (packed rows with a mask built here).
    """
    if (causal and mask is None and q.device.type == "cpu" and q.dtype in _FLOATS and q.dtype == k.dtype == v.dtype
            and q.shape[2] == k.shape[2]):
        training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if segments is not None or (training and _FLASH_CPU_GQA):
            return _BlockedAttention.apply(q, k, v, segments)
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
    block of positions s..e is rows s·rep..e·rep, one matrix per (batch row, key/value head)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, segments: torch.Tensor | None):
        self.B, self.H, self.T, self.d = q.shape
        self.Hkv = k.shape[1]
        self.rep, self.n = self.H // self.Hkv, self.B * self.Hkv
        self.segments = segments
        # the first key each block can see: the start of its first query's segment (the earliest over the batch)
        self.starts = [0] * len(range(0, self.T, BLOCK))
        if segments is not None:
            pos = torch.arange(self.T, device=segments.device)
            new = torch.ones_like(segments, dtype=torch.bool)
            new[:, 1:] = segments[:, 1:] != segments[:, :-1]
            first = torch.where(new, pos, 0).cummax(1).values  # (B, T): where each position's segment begins
            self.starts = first[:, ::BLOCK].amin(0).tolist()

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
        for i, s in enumerate(range(0, self.T, BLOCK)):
            e = min(s + BLOCK, self.T)
            for k0 in range(self.starts[i], e, KEYS):
                yield slice(s * self.rep, e * self.rep), s, e, k0, min(k0 + KEYS, e)

    def hide(self, scores: torch.Tensor, s: int, e: int, k0: int, k1: int) -> torch.Tensor:
        """scores (n, b·rep, K) of queries s..e and keys k0..k1, with -inf where a key is not visible."""
        if self.segments is None and k1 <= s:  # wholly below the diagonal: every key visible
            return scores
        q_pos = torch.arange(s, e, device=scores.device)[:, None]
        visible = torch.arange(k0, k1, device=scores.device)[None] <= q_pos  # (b, K)
        if self.segments is None:
            scores.view(self.n, e - s, self.rep, k1 - k0).masked_fill_(~visible[:, None], float("-inf"))
            return scores
        seg = self.segments
        visible = visible & (seg[:, s:e, None] == seg[:, None, k0:k1])  # (B, b, K)
        scores.view(self.B, self.Hkv, e - s, self.rep, k1 - k0).masked_fill_(~visible[:, None, :, None], float("-inf"))
        return scores


def _blocked_forward(L: _Layout, qs, kk, vv):
    """out (n, T·rep, d) and lse (n, T·rep) of scaled queries qs: an online softmax over each block's key tiles."""
    out, lse = torch.empty_like(qs), qs.new_empty(qs.shape[:2])
    block = None
    for rows, s, e, k0, k1 in L.tiles():
        scores = L.hide(torch.bmm(qs[:, rows], kk[:, k0:k1].transpose(1, 2)), s, e, k0, k1)
        # floor for a row that sees no key in this tile yet (a later segment): exp(-inf - floor) = 0, no NaN
        top = scores.amax(-1, keepdim=True).clamp_(min=-1e30)
        if block != rows:  # the block's first tile
            block, m = rows, top
            p = scores.sub_(m).exp_()
            total, acc = p.sum(-1, keepdim=True), torch.bmm(p, vv[:, k0:k1])
        else:  # rescale what the earlier tiles summed to the new maximum
            new_m = torch.maximum(m, top)
            shrink = (m - new_m).exp_()
            p = scores.sub_(new_m).exp_()
            total = total.mul_(shrink).add_(p.sum(-1, keepdim=True))
            acc = acc.mul_(shrink).baddbmm_(p, vv[:, k0:k1])
            m = new_m
        if k1 == e:  # the block's last tile
            torch.div(acc, total, out=out[:, rows])
            lse[:, rows] = (m + total.log()).squeeze(-1)
    return out, lse


def _in_float32(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 products would round q·kᵀ before the exponential: bf16 blocks run in float32 (float64 stays)."""
    return t.float() if t.dtype == torch.bfloat16 else t


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments):
        dtype = q.dtype
        if segments is None:
            out, lse = _FLASH_CPU(q, k, v, is_causal=True)  # out (B, H, T, d), lse (B, H, T) in float32
        else:
            L = _Layout(q, k, segments)
            qs = L.rows(_in_float32(q), 1 / math.sqrt(L.d))
            kk, vv = (_in_float32(t).reshape(L.n, L.T, L.d) for t in (k, v))
            out_rows, lse_rows = _blocked_forward(L, qs, kk, vv)
            out, lse = L.heads(out_rows).to(dtype), lse_rows.view(L.B, L.Hkv, L.T, L.rep).transpose(2, 3).reshape(L.B, L.H, L.T)
        ctx.save_for_backward(q, k, v, out, lse, segments)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, segments = ctx.saved_tensors
        dtype = q.dtype
        q, k, v, out, grad_out = (_in_float32(t) for t in (q, k, v, out, grad_out))
        L = _Layout(q, k, segments)
        scale = 1 / math.sqrt(L.d)
        qs = L.rows(q, scale)  # the scale folded into q
        g = L.rows(grad_out)
        kk, vv = k.reshape(L.n, L.T, L.d), v.reshape(L.n, L.T, L.d)
        neg_lse = L.rows(torch.neg(lse).to(q.dtype)).unsqueeze(-1)  # (n, T·rep, 1)
        neg_delta = L.rows(torch.linalg.vecdot(grad_out, out).neg_()).unsqueeze(-1)  # -rowsum(dO ∘ O)
        dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(kk), torch.zeros_like(vv)
        for rows, s, e, k0, k1 in L.tiles():
            q_blk, g_blk = qs[:, rows], g[:, rows]  # (n, b·rep, d)
            # probabilities exp(q·kᵀ - lse), the subtraction done by the GEMM
            p = L.hide(torch.baddbmm(neg_lse[:, rows], q_blk, kk[:, k0:k1].transpose(1, 2)), s, e, k0, k1).exp_()
            dv[:, k0:k1] += torch.bmm(p.transpose(1, 2), g_blk)  # (bmm into a slice would run matrix by matrix)
            # dS = P ∘ (dP - delta) with dP = dO·vᵀ
            ds = torch.baddbmm(neg_delta[:, rows], g_blk, vv[:, k0:k1].transpose(1, 2)).mul_(p)
            dq[:, rows] += torch.bmm(ds, kk[:, k0:k1])
            dk[:, k0:k1] += torch.bmm(ds.transpose(1, 2), q_blk)
        grad_q = L.heads(dq.mul_(scale))
        return grad_q.to(dtype), dk.view_as(k).to(dtype), dv.view_as(v).to(dtype), None
