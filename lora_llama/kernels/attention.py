"""Attention through SDPA, and for CPU training and packed rows the blocked kernel of blocked_attention.py: linear
memory, no mask tensor.

Packed rows (`segments`, one id per example, each example contiguous) are independent causal problems: the blocked
kernel starts each block of queries at its examples' first keys and hides the keys of earlier examples, so no dense
(B, 1, T, T) mask exists, little work is spent on keys of other examples, and short examples share the batched
products of whole rows. The kernel is wrapped as custom ops (opaque to torch.compile, one op that selective
checkpointing keeps) and an autograd Function; in bf16 on a CPU with AMX the forward of unpacked rows is aten's flash
kernel (`FLASH_FORWARD`), and packed rows of short examples run packed_attention.py's C loop. GPUs, float16,
sliding windows, the KV cache and inference of unpacked rows keep SDPA and its kernels (packed rows there with a
mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lora_llama.kernels import packed_attention
from lora_llama.kernels.blocked_attention import LOG2E, backward, forward, positions_major, work_dtype
from lora_llama.kernels.cpu import cpu_bf16_instructions
from lora_llama.kernels.elementwise import apply_rope, rotate_back

_FLOATS = (torch.float32, torch.float64, torch.bfloat16)
# enable_gqa lets SDPA read k/v with fewer heads without a repeated copy (torch >= 2.5)
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    causal: bool = False,
    segments: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ/√d + mask)·v for q (B, H, T, d) and k, v (B, H_kv, S, d), H a multiple of H_kv.

    causal: the plain causal mask (mask must be None). segments (B, T) with causal: packed rows, each
    position sees the earlier positions of its own segment. A float CPU training step, and packed rows
    on the CPU, run `_CausalAttention`; anything else SDPA (packed rows with a mask built here).
    rope (cos, sin): q and k are rotated by them first (apply_rope); packed rows' C loop rotates them on its way in.
    """
    ours = (
        causal
        and mask is None
        and q.device.type == "cpu"
        and q.dtype in _FLOATS
        and q.dtype == k.dtype == v.dtype
        and q.shape[2] == k.shape[2]
    )
    if rope is not None and not (ours and packed_attention.applies(q, k, segments, rope)):
        (q, k), rope = _rotated(q, k, rope), None
    if ours:
        training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if segments is not None or training:
            return _CausalAttention.apply(q, k, v, segments, *(rope or (None, None)))
    if segments is not None:
        mask, causal = causal_segment_mask(segments)[:, None], False
    if q.is_cuda and q.shape[2] == 1 and k.shape[1] != q.shape[1] and mask is not None:
        return one_query(q, k, v, mask)  # decoding: SDPA's CUDA kernels would need k and v repeated per head
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


def one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√d + mask)·v for one query position (B, H, 1, d), keys shared by groups of heads, as two
    grouped products: no copy of the keys and values per head. mask (B or 1, 1, 1, S) bool; scores and softmax in
    float32."""
    B, H, _, d = q.shape
    kv_heads = k.shape[1]
    scores = torch.matmul(q.view(B, kv_heads, H // kv_heads, d), k.transpose(-1, -2)).float() * d**-0.5
    scores = scores.masked_fill(~mask.view(mask.shape[0], 1, 1, -1), float("-inf"))  # (B, H_kv, group, S)
    return torch.matmul(scores.softmax(-1).to(v.dtype), v).view(B, H, 1, d)


def _amx_flash_forward():
    """aten's CPU flash forward where it beats the blocked one: bf16 on a CPU with AMX-BF16, its tiles on AMX
    (per layer, 4x512, GQA 9:3, Xeon with AMX: 3.8 vs 7.8-16 ms; the bf16 step 7% faster, paired). Without AMX
    it is the slower one (AMD EPYC Zen 5, AVX512_BF16: 16-19 vs 12.5 ms). None elsewhere, or where this torch's
    kernel does not read k/v with fewer heads (GQA)."""
    if "AMX_BF16" not in cpu_bf16_instructions():
        return None
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    try:
        q = torch.ones(1, 2, 3, 8, dtype=torch.bfloat16)
        out, lse = op(q, q[:, :1], q[:, :1], 0.0, True)
        return op if out.shape == q.shape and lse.shape == q.shape[:3] else None
    except (TypeError, RuntimeError):  # no such op (None) or no GQA
        return None


FLASH_FORWARD = _amx_flash_forward()


def _causal_forward(q, k, v):
    """(out, base-2 log-sum-exp) of one causal problem; the backward (blocked) recomputes probabilities from it.
    aten's flash kernel keeps the same numerics: float32 scores and softmax, p rounded to bf16 for p·v."""
    if FLASH_FORWARD is not None and q.dtype == torch.bfloat16:
        out, lse = FLASH_FORWARD(q, k, v, 0.0, True)  # lse in base e, (B, T, H) in memory
        # the layouts register_fake says
        return positions_major(q.shape, q.dtype, q).copy_(out), lse.contiguous().mul_(LOG2E)
    return forward(q, k, v)


def takes_segments(device: torch.device) -> bool:
    """Whether attend runs packed rows on this device without a mask (else the caller builds one mask, once)."""
    return device.type == "cpu"


def causal_segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T, T) bool: key j visible to query i when j <= i and both lie in the same segment."""
    T = segments.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return causal & (segments[:, :, None] == segments[:, None, :])


# custom ops: opaque to torch.compile (no loop to unroll) and one op that selective checkpointing can keep
@torch.library.custom_op("lora_llama::causal_attention", mutates_args=())
def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: torch.Tensor | None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, base-2 log-sum-exp) of causal attention, each packed example (segments) on its own; with cos and sin,
    of q and k rotated by them (RoPE)."""
    rope = None if cos is None else (cos, sin)
    if packed_attention.applies(q, k, segments, rope):
        return packed_attention.forward(q, k, v, segments, rope)
    q, k = _rotated(q, k, rope)
    return forward(q, k, v, segments) if segments is not None else _causal_forward(q, k, v)


def _rotated(q, k, rope):
    """q and k rotated by rope (cos, sin) where it is given: what the blocked kernels and aten's take."""
    return (q, k) if rope is None else (apply_rope(q, *rope), apply_rope(k, *rope))


@causal_attention.register_fake
def _(q, k, v, segments, cos=None, sin=None):
    return positions_major(q.shape, q.dtype, q), q.new_empty(q.shape[:3], dtype=work_dtype(q))  # as the kernels


@torch.library.custom_op("lora_llama::causal_attention_backward", mutates_args=())
def causal_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    segments: torch.Tensor | None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of causal_attention (with cos and sin, the gradients of q and k before their rotation)."""
    rope = None if cos is None else (cos, sin)
    if packed_attention.applies(q, k, segments, rope):
        return packed_attention.backward(q, k, v, out, lse, grad_out, segments, rope)
    dq, dk, dv = backward(*_rotated(q, k, rope), v, out, lse, grad_out, segments)
    return (dq, dk, dv) if rope is None else (rotate_back(dq, *rope), rotate_back(dk, *rope), dv)


@causal_attention_backward.register_fake
def _(q, k, v, out, lse, grad_out, segments, cos=None, sin=None):
    return tuple(positions_major(t.shape, t.dtype, t) for t in (q, k, v))


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, cos=None, sin=None):
        out, lse = causal_attention(q, k, v, segments, cos, sin)
        ctx.save_for_backward(q, k, v, out, lse, segments, cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # read once: checkpointing unpacks each saved tensor once
        q, k, v, out, lse, segments, cos, sin = ctx.saved_tensors
        return (*causal_attention_backward(q, k, v, out, lse, grad_out, segments, cos, sin), None, None, None)
