"""Causal attention for CPU training: blocked forward and backward in linear memory (attention.py dispatches here).

Forward and backward go a block of BLOCK query positions at a time, over tiles of at most KEYS keys, one (key/value
head, batch row) group at a time with all the query heads that share it as the rows of one product, through oneDNN
(gemm.linear: 2-3x MKL's batched GEMM on these shapes here); short rows in smaller blocks (FLOAT_BLOCK, BF16_BLOCK),
float ones several groups in one batched product. Keys a block cannot see are skipped; forward keeps a running max and
sum per row (the online softmax) and returns the log-sum-exp, from which backward recomputes the probabilities, so
nothing of size T x T is ever built. Scores are in base 2 (exp2 runs ~4x faster than exp on the CPU), and backward works
on keys-first tiles so that the subtractions of lse and delta ride on the products as their bias (in bf16 as two extra
operand columns). Forward+backward per layer (SmolLM2 shapes, float32, 2 threads, AMD EPYC; SDPA's / ours): 4x512 53 /
34 ms, 1x2048 151 / 69 ms, 1x4096 563 / 267 ms, 1x8192 2102 / 915 ms. In bfloat16 the scores and softmax are float32
(forward's q·kᵀ is never rounded before the exponential; from torch 2.9 on it runs as oneDNN bf16 products with float32
output, exact for bf16 values) and the other products take bf16 with float32 sums (backward's with lse and delta
subtracted before their output is rounded); bf16 forward and backward batch their products over groups (backward 4x512
15.5 vs 22.2 ms per group; forward 6.0 vs 9.5 ms, with the additive masks).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import torch

from lora_llama.kernels.gemm import linear
from lora_llama.kernels.packed_rows import packed_rows

BLOCK = (
    128  # query positions per block, KEYS keys per tile: the fastest here at 4x512 and 1x4096 (of 64-256 x 512-2048)
)
KEYS = 2048
# rows of at most SHORT positions (packed: twice as many) go in smaller blocks. Float: FLOAT_BLOCK queries, a tile's
# products batched over groups (per layer, 9:3 heads of 64, 2 threads, float32: 4x256 packed chat rows 7.8 vs 12.8-13.7
# ms, 4x512 32.6 vs 38.1 ms (AVX2) and 33.2 vs 32.1 (AVX-512)); longer rows keep BLOCK, one group at a time (1x1024:
# 23-30 vs 34-36 ms). bf16: BF16_BLOCK (AVX512_BF16, forward+backward: 4x256 packed 6.4-6.6 vs 7.1-7.7 ms, 4x512
# 16.1-16.4 vs 23.5-23.9; 2x1024 and 1x2048 no faster)
FLOAT_BLOCK, BF16_BLOCK, SHORT = 32, 64, 512
GROUP_TILE = 4 << 20  # bf16: elements of one tile's scores over the groups it batches (8 MB in bf16, 16 in float32)
_FINITE = 1e30  # the floor of a running max: exp2(-inf - m) stays 0 where a tile hides a whole row
LOG2E = 1.4426950408889634  # scores in base 2: exp2(x·log2(e)) = exp(x)


class _Layout:
    """The rows of every query head sharing a key/value head, position-major: (B·H_kv, T·rep, ...), so that a
    block of positions s..e is rows s·rep..e·rep, one matrix per (batch row, key/value head) group.

    segments (B, T), packed rows: a query sees the keys from its example's first position (packed_rows.py) to its own;
    a block's key tiles begin at the earliest example start among its queries, per run of batch rows (a batch row
    of short examples beside one of a long one gets products of its own), so packed rows cost about their examples'
    own causal work, in batched products as unpacked ones."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, segments: torch.Tensor | None = None):
        self.B, self.H, self.T, self.d = q.shape
        self.Hkv = k.shape[1]
        self.rep, self.n = self.H // self.Hkv, self.B * self.Hkv
        short, bf16 = self.T <= SHORT * (1 if segments is None else 2), q.dtype == torch.bfloat16
        self.short_float = short and not bf16
        self.block = block = min(BLOCK, BF16_BLOCK if bf16 else FLOAT_BLOCK) if short else BLOCK
        # packed rows: their starts, per batch row and block its first key and latest example start, the runs of
        # batch rows sharing products, tile biases (packed_rows.py)
        self.packed = None if segments is None else packed_rows(segments, block)

    def rows(self, t: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """(B, H, T, ...) -> (B·H_kv, T·rep, ...), a new tensor in the work dtype (callers may change it in place);
        with scale, multiplied by it."""
        g = t.unflatten(1, (self.Hkv, self.rep)).transpose(2, 3)  # (B, H_kv, T, rep, ...)
        g = g.to(work_dtype(t), memory_format=torch.contiguous_format, copy=True)
        if scale is not None:
            g.mul_(scale)
        return g.view(self.n, self.T * self.rep, *t.shape[3:])

    def keys(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """k or v (B, H_kv, T, d) -> (B·H_kv, T, d), contiguous (the model's k/v are strided views, on which
        oneDNN is ~100x slower), in dtype (default: the work dtype)."""
        return t.to(dtype or work_dtype(t)).contiguous().view(self.n, self.T, self.d)

    def heads(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The inverse of rows: (B·H_kv, T·rep, ...) -> (B, H, T, ...) in dtype, out and dq positions-major (a copy)."""
        shape = (self.B, self.H, self.T, *t.shape[2:])
        out = positions_major(shape, dtype, t) if t.dim() == 3 else t.new_empty(shape, dtype=dtype)
        out.unflatten(1, (self.Hkv, self.rep)).copy_(
            t.view(self.B, self.Hkv, self.T, self.rep, *t.shape[2:]).transpose(2, 3)
        )
        return out

    def augmented(self, t: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 rows (q, dO: (B, H, T, d) -> (B·H_kv, T·rep, d + 2)) followed by extra (B·H_kv, T·rep) float32 split
        into two bf16 parts (hi + lo, ~16 bits); or, extra None, keys (k, v: (B, H_kv, T, d) -> (B·H_kv, T, d + 2))
        followed by two ones. A product of the two then subtracts extra in its float32 sums."""
        if extra is None:
            out = t.new_ones((self.n, self.T, self.d + 2), dtype=torch.bfloat16)
            out[..., : self.d] = t.reshape(self.n, self.T, self.d)
            return out
        out = t.new_empty((self.n, self.T * self.rep, self.d + 2), dtype=torch.bfloat16)
        out[..., : self.d].view(self.B, self.Hkv, self.T, self.rep, self.d).copy_(
            t.unflatten(1, (self.Hkv, self.rep)).transpose(2, 3)
        )
        hi = out[..., self.d].copy_(extra)
        out[..., self.d + 1] = extra - hi.float()
        return out

    def groups(self) -> int:
        """How many groups a batched tile takes: its scores stay ~GROUP_TILE elements, whatever the batch size."""
        return max(1, GROUP_TILE // (min(KEYS, self.T) * self.block * self.rep))

    def tiles(self, g0: int, g1: int):
        """The tiles of groups g0..g1-1: per block of queries s..e-1 and run of groups (packed rows: runs of batch
        rows, `PackedRows.runs`), the tiles of keys k0..k1-1 they can see, in order."""
        for b, s in enumerate(range(0, self.T, self.block)):
            e = min(s + self.block, self.T)
            rows = slice(s * self.rep, e * self.rep)
            runs = [(g0, g1, 0, 0)] if self.packed is None else self.packed.runs(b, e, g0, g1, self.Hkv)
            for r0, r1, first_key, last_start in runs:
                for k0 in range(first_key, e, KEYS):
                    k1 = min(k0 + KEYS, e)
                    # whether every query of the run sees every key of the tile (none after a query, none before
                    # its example)
                    whole = k1 <= max(s, k0) and (self.packed is None or last_start <= k0)
                    yield _Tile(slice(r0, r1), rows, s, e, k0, k1, k0 == first_key, whole)

    def hide(self, scores: torch.Tensor, tile: "_Tile", keys_first=False) -> torch.Tensor:
        """-inf where a key lies after its query or (packed rows) before its example, in a tile's scores:
        (G, (e-s)·rep, k1-k0), or keys by rows (keys_first). Only keys s..k1 (the diagonal's) can lie after a
        query. Packed rows: one add of the tile's mask (packed_rows.py), per batch row."""
        s, e, k0, k1 = tile.s, tile.e, tile.k0, tile.k1
        if tile.whole:
            return scores
        if self.packed is None:
            c0 = max(s, k0)
            part = scores[..., c0 - k0 :, :] if keys_first else scores[..., c0 - k0 :]
            part.add_(_hidden(s - c0, e - s, k1 - c0, self.rep, keys_first, scores.dtype))
            return scores
        bias = self.packed.additive_mask(s, e, k0, k1, self.rep, keys_first, scores.dtype)  # (B, rows or keys, ...)
        (g0, g1), H = (tile.grp.start, tile.grp.stop), self.Hkv
        if g0 % H == 0 and g1 % H == 0:  # whole batch rows: one add, broadcast over each row's groups
            scores.view(g1 // H - g0 // H, H, *bias.shape[1:]).add_(bias[g0 // H : g1 // H, None])
        else:
            for b in range(g0 // H, (g1 - 1) // H + 1):  # the groups of batch row b share its bias
                scores[max(g0, b * H) - g0 : min(g1, (b + 1) * H) - g0].add_(bias[b])
        return scores


class _Tile(NamedTuple):
    """Queries s..e-1 (`rows` of the layout) of groups `grp` against keys k0..k1-1: `first`, the first tile of
    their block and run; `whole`, every query sees every key (nothing to hide)."""

    grp: slice
    rows: slice
    s: int
    e: int
    k0: int
    k1: int
    first: bool
    whole: bool


@functools.lru_cache(maxsize=64)
def _hidden(offset: int, queries: int, keys: int, rep: int, keys_first: bool, dtype: torch.dtype) -> torch.Tensor:
    """(queries·rep, keys), or its transpose (keys_first): -inf where key j lies after query i (the queries
    starting `offset` positions after the keys, each row repeated for the rep heads), else 0. Added to the
    scores, contiguous: a broadcast masked_fill over the heads runs ~13x slower."""
    later = torch.arange(keys)[None] > torch.arange(offset, offset + queries)[:, None]  # (queries, keys)
    bias = torch.zeros(later.shape, dtype=dtype).masked_fill_(later, float("-inf"))
    bias = bias[:, None].expand(queries, rep, keys).reshape(queries * rep, keys)
    return bias.t().contiguous() if keys_first else bias


def positions_major(shape, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, T, d) tensor laid out as (B, T, H, d), as the attention ops' outputs and gradients are: the
    model's (B, T, H·d) view of the output, and autograd's of the gradients, read it without a copy."""
    return like.new_empty((shape[0], shape[2], shape[1], shape[3]), dtype=dtype).transpose(1, 2)


def _as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A key gradient (B·H_kv, T, d) in like's shape and dtype, positions-major (one copy, the cast included)."""
    return positions_major(like.shape, like.dtype, like).copy_(t.view(like.shape))


def work_dtype(t: torch.Tensor) -> torch.dtype:
    """Scores, softmax and sums of bf16 attention are float32 (float64 stays)."""
    return torch.float32 if t.dtype == torch.bfloat16 else t.dtype


def _low(t: torch.Tensor) -> torch.dtype | None:
    """The dtype of the products that may round their output: bfloat16 for bf16 attention, else None (the work
    dtype's products, which round nothing that matters)."""
    return torch.bfloat16 if t.dtype == torch.bfloat16 else None


# a tile's products over G groups (G, m, k): one group through oneDNN's 2-D products (gemm.linear, F.linear where it
# does not cover the dtype), several as one batched product
def _bnt(a, b, bias=None):  # a·bᵀ (+ bias (G, n) per column, fused into the product)
    if a.shape[0] == 1:
        return linear(a[0], b[0], None if bias is None else bias[0])[None]
    bt = b.transpose(1, 2)
    return torch.bmm(a, bt) if bias is None else torch.baddbmm(bias[:, None], a, bt)


def _bnn(a, b):  # a·b
    return linear(a[0], b[0].t())[None] if a.shape[0] == 1 else torch.bmm(a, b)


def _btn(a, b):  # aᵀ·b; one group as (bᵀ·a)ᵀ: oneDNN reads the small bᵀ contiguous and a as a transposed weight
    if a.shape[0] == 1:
        return linear(b[0].t().contiguous(), a[0].t()).t()[None]
    return torch.bmm(a.transpose(1, 2), b)


def _groups(L: _Layout, bf16: bool) -> int:
    """Groups a tile's products take at once: bf16's batched products (oneDNN's bf16 bmm) always; float's for short
    rows (`_Layout.short_float`), whose products are too short to outweigh the calls around them (float32's bmm is
    MKL's, slower than oneDNN's 2-D products on long tiles)."""
    return L.groups() if bf16 or L.short_float else 1


def forward(q, k, v, segments=None):
    """out (B, H, T, d) in q's dtype, positions-major, and the base-2 log-sum-exp (B, H, T) of causal attention.

    Per block of queries, over tiles of keys: scores in base 2 (exp2 runs ~4x faster than exp on the CPU), the online
    softmax rescaling the running sum and output when a row spans tiles, over `_groups` groups at a time. Float: the
    scale·log2(e) folded into q. bf16: q·kᵀ in float32 from bf16 values, so it runs exactly as a bf16 product
    with float32 sums and output (`_bf16_sums`); the scale is applied in the exponent, q staying a bf16 value."""
    L = _Layout(q, k, segments)
    c = LOG2E / math.sqrt(L.d)
    bf16 = q.dtype == torch.bfloat16 and _BF16_SUMS
    qs = L.rows(q, None if bf16 else c)
    kk, vv = L.keys(k), L.keys(v, _low(v))  # q·kᵀ in float32 (not rounded before the exponential); p·v in bf16 for bf16
    # per row, kept in place: the running output (out), its sum of exponentials (sums) and the running max (lse,
    # until the end); the division and the log-sum-exp are then one operation each over all rows
    out, lse, sums = torch.empty_like(qs), qs.new_empty(qs.shape[:2]), qs.new_empty(qs.shape[:2])
    groups, scale = _groups(L, bf16), c if bf16 else 1.0
    with _bf16_sums(bf16):
        for g0 in range(0, L.n, groups):
            for t in L.tiles(g0, min(g0 + groups, L.n)):
                grp, rows = t.grp, t.rows
                qg, kg, vg = qs[grp, rows], kk[grp, t.k0 : t.k1], vv[grp, t.k0 : t.k1]
                p = L.hide(_bnt(qg, kg), t)  # (G, b·rep, K)
                acc, total, m = out[grp, rows], sums[grp, rows], lse[grp, rows]
                if t.first:  # every query sees its block's first key unless packed rows hide it (see below)
                    torch.amax(p, -1, out=m)
                    if L.packed is not None:  # a row that sees no key of this tile: a finite max, its exp2 is 0
                        m.clamp_(min=-_FINITE)
                else:  # a row that sees no key of this tile has -inf here
                    m_new = torch.maximum(m, p.amax(-1))
                    r = (m - m_new).mul_(scale).exp2_()
                    m.copy_(m_new)
                # (p - m)·scale in one pass: p·scale + (-m·scale)
                p = (
                    torch.add(m.mul(-scale)[..., None], p, alpha=scale, out=p).exp2_()
                    if bf16
                    else p.sub_(m[..., None]).exp2_()
                )
                pv = _bnn(p.to(vv.dtype), vg)
                if t.first:
                    acc.copy_(pv)
                    torch.sum(p, -1, out=total)
                else:
                    acc.mul_(r[..., None]).add_(pv.to(acc.dtype))
                    total.mul_(r).add_(p.sum(-1))
    out.div_(sums[..., None])
    lse.mul_(scale).add_(sums.log2_())
    return L.heads(out, q.dtype), L.heads(lse, lse.dtype)


# torch >= 2.9: oneDNN may run float32 products as bf16 products (float32 sums and output), exact when the
# inputs hold bf16 values; a process-wide setting, so `_bf16_sums` sets it only around such products
_BF16_SUMS = hasattr(getattr(torch.backends, "mkldnn", None), "matmul") and hasattr(
    torch.backends.mkldnn.matmul, "fp32_precision"
)


@contextlib.contextmanager
def _bf16_sums(active: bool):
    if not active:
        yield
        return
    setting = torch.backends.mkldnn.matmul
    before, setting.fp32_precision = setting.fp32_precision, "bf16"
    try:
        yield
    finally:
        setting.fp32_precision = before


def backward(q, k, v, out, lse, grad_out, segments=None):
    """dq, dk, dv (positions-major) of causal attention (q (B, H, T, d), k/v (B, H_kv, T, d), lse from forward).

    Keys-first tiles: Pᵀ = exp2(k·qᵀ - lse) and dPᵀ - delta = v·dOᵀ - delta come out of one product each, the
    subtraction fused into it as the product's bias (one per query row)."""
    if q.dtype == torch.bfloat16:
        return _backward_bf16(q, k, v, out, lse, grad_out, segments)
    L = _Layout(q, k, segments)
    scale = 1 / math.sqrt(L.d)
    c = scale * LOG2E  # the base-2 scale, folded into q
    qs, g, kk, vv = L.rows(q, c), L.rows(grad_out), L.keys(k), L.keys(v)
    neg_lse = L.rows(lse).neg_()  # (n, T·rep)
    neg_delta = L.rows(torch.linalg.vecdot(grad_out, out)).neg_()  # -rowsum(dO ∘ O)
    dq, dk, dv = (torch.zeros_like(t) for t in (qs, kk, vv))
    groups = _groups(L, False)
    for g0 in range(0, L.n, groups):
        for t in L.tiles(g0, min(g0 + groups, L.n)):
            grp, rows, keys = t.grp, t.rows, slice(t.k0, t.k1)
            q_blk, g_blk, k_t, v_t = qs[grp, rows], g[grp, rows], kk[grp, keys], vv[grp, keys]  # (G, b·rep | K, d)
            pt = L.hide(_bnt(k_t, q_blk, neg_lse[grp, rows]), t, True).exp2_()  # Pᵀ (G, K, b·rep)
            dv[grp, keys] += _bnn(pt, g_blk)
            dst = _bnt(v_t, g_blk, neg_delta[grp, rows]).mul_(pt)  # dSᵀ = Pᵀ ∘ (dPᵀ - delta)
            dk[grp, keys] += _bnn(dst, q_blk)
            dq[grp, rows] += _btn(dst, k_t)
    # dS is the gradient of the natural-log scores: dq = scale·dS·k, dk = scale·dSᵀ·q = dSᵀ·qs/log2(e)
    return L.heads(dq.mul_(scale), q.dtype), _as(dk.mul_(1 / LOG2E), k), _as(dv, v)


def _backward_bf16(q, k, v, out, lse, grad_out, segments):
    """backward for bfloat16: the same keys-first tiles, each product one bf16 batched product over several
    (batch row, key/value head) groups (torch.bmm, which PyTorch sends to oneDNN for bf16: ~750 GFLOP/s here,
    where float32's bmm goes to MKL at ~180 and the per-group products stay faster), sums in float32.

    The subtractions of lse and delta happen in the float32 sums before the output is rounded: q and dO carry
    -lse/c and -delta as two more columns (each split into two bf16 parts, ~16 bits) and k and v two columns of
    ones (`_Layout.augmented`), so what is rounded to bf16 is the small difference. q is not scaled (c·q would
    round it again): the rounded difference is scaled by c. Each tile's share is rounded once to bf16 before the
    float32 accumulators take it."""
    L = _Layout(q, k, segments)
    d, scale = L.d, 1 / math.sqrt(L.d)
    c = scale * LOG2E
    qa = L.augmented(q, L.rows(lse).mul_(-1 / c))  # (n, T·rep, d + 2): q, -lse/c
    ga = L.augmented(grad_out, L.rows(torch.linalg.vecdot(grad_out.float(), out.float())).neg_())  # dO, -delta
    ka, va = L.augmented(k), L.augmented(v)  # (n, T, d + 2): k, 1, 1
    dq = q.new_empty((L.n, L.T * L.rep, d), dtype=torch.float32)  # every row is written by its block's first tile
    dk, dv = (q.new_zeros((L.n, L.T, d), dtype=torch.float32) for _ in range(2))
    groups = L.groups()
    for g0 in range(0, L.n, groups):
        for t in L.tiles(g0, min(g0 + groups, L.n)):
            grp, rows, keys = t.grp, t.rows, slice(t.k0, t.k1)
            q_blk, g_blk = qa[grp, rows].contiguous(), ga[grp, rows].contiguous()  # (G, b·rep, d + 2)
            pt = L.hide(torch.bmm(ka[grp, keys], q_blk.transpose(1, 2)), t, keys_first=True)
            pt = pt.mul_(c).exp2_()  # Pᵀ (G, K, b·rep)
            # dO and q without their two extra columns (views): a product 66 columns wide runs ~25% slower than 64
            dv[grp, keys] += torch.bmm(pt, g_blk[..., :d])
            dst = torch.bmm(va[grp, keys], g_blk.transpose(1, 2)).mul_(pt)  # dSᵀ = Pᵀ ∘ (dPᵀ - delta)
            dk[grp, keys] += torch.bmm(dst, q_blk[..., :d])
            part = torch.bmm(dst.transpose(1, 2), ka[grp, keys, :d])  # dS·k (G, b·rep, d), read through views
            if t.first:
                dq[grp, rows] = part
            else:
                dq[grp, rows] += part
    # dS is the gradient of the natural-log scores: dq = scale·dS·k, dk = scale·dSᵀ·q
    return L.heads(dq.mul_(scale), q.dtype), _as(dk.mul_(scale), k), _as(dv, v)
