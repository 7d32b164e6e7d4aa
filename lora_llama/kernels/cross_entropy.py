"""Cross-entropy and log-probabilities of target tokens from hidden states, chunked over the vocabulary projection.

Full (N, vocab) logits are never built: the caller passes only the hidden states of the positions that predict a
target, and they are projected a chunk of rows at a time. With a plain output weight the gradient of each chunk is
computed right away in the forward pass, so neither the logits nor their gradient are kept for backward (the idea
of Liger's fused linear cross-entropy); any other projection is given as a function of a chunk, whose logits are
recomputed in backward.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lora_llama.kernels import workspace
from lora_llama.kernels.blocked_attention import LOG2E
from lora_llama.kernels.gemm import linear

# logits per chunk, whatever the vocabulary size: 24 MB in float32, under glibc's 32 MB mmap limit, so a chunk's
# buffers are reused from the heap instead of being page-faulted in afresh (64 MB chunks: ~15% slower)
CHUNK_ELEMENTS = 6 << 20
# bf16 products: twice the rows (a 256-row vocabulary product ran at ~700 GFLOP/s here, a 128-row one at ~600; the
# bf16 step 2.4% faster, the float32 one no faster with them); their float32 work still goes CHUNK_ELEMENTS at a time
BF16_CHUNK_ELEMENTS = 12 << 20


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(h_i @ W.T, t_i), with the gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, h, weight, targets, rows):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.h_dtype, ctx.weight_dtype = h.dtype, weight.dtype
        device = h.device.type
        if torch.is_autocast_enabled(device):  # out= products are not autocast: pick its dtype by hand
            dtype = torch.get_autocast_dtype(device)
            h, weight = h.to(dtype), weight.to(dtype)
        grad_h = torch.empty_like(h) if need_h else None  # (N, dim)
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # (V, dim)
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        rows = -(-h.shape[0] // -(-h.shape[0] // rows))  # chunks of equal size, none of a few rows
        # the float32 softmax work, CHUNK_ELEMENTS at a time (a bf16 chunk in two passes), in one buffer reused by
        # every pass and kept across steps (workspace): a fresh one is page-faulted in again each step, even one
        # under glibc's 32 MB mmap threshold
        work = min(rows, max(1, CHUNK_ELEMENTS // weight.shape[0]), h.shape[0])
        logp_buf = workspace.buffer((work, weight.shape[0]), torch.float32, h.device, "loss")
        # float32 chunks in one pass keep their gradient in the buffer; others write it over the logits' rows
        in_buffer = work >= rows and h.dtype == torch.float32
        for i in range(0, h.shape[0], rows):
            hc, tc = h[i : i + rows], targets[i : i + rows]
            logits = _logits(hc, weight)  # (rows, V)
            for j in range(0, len(tc), work):
                part, tj = logits[j : j + work], tc[j : j + work]
                logp = logp_buf[: len(tj)].copy_(part)
                torch.log_softmax(logp, -1, out=logp)  # in place
                total -= logp.gather(1, tj[:, None]).sum()
                if need_h or need_w:
                    logp.mul_(LOG2E).exp2_()  # the softmax, in place (exp2 runs several times faster than exp)
                    logp[torch.arange(len(tj), device=tj.device), tj] -= 1  # minus the one-hot target
                    if not in_buffer:
                        part.copy_(logp)
            dlogits = logp if in_buffer else logits
            if need_h:
                grad_h[i : i + rows] = linear(dlogits, weight.T)
            if need_w:
                grad_w += (dlogits.T @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return (
            (grad_h * grad_out.to(grad_h.dtype)).to(ctx.h_dtype) if grad_h is not None else None,
            (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None,
            None,
            None,
        )


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h·Wᵀ of one chunk. bf16 on the CPU: into a buffer kept across chunks and steps (a fresh vocabulary-sized block
    is page-faulted in on every chunk: 30-37 ms against 12-13 for 157-180 rows of SmolLM2's head, AVX512_BF16
    EPYC); torch.mm's bf16 product (oneDNN's) runs as fast as gemm.linear, where its float32 one (MKL's) does not."""
    if h.device.type == "cpu" and h.dtype == weight.dtype == torch.bfloat16 and h.is_contiguous():
        out = workspace.buffer((h.shape[0], weight.shape[0]), torch.bfloat16, h.device, "logits")
        return torch.mm(h, weight.t(), out=out)
    return linear(h, weight)


class _LinearLogProbs(torch.autograd.Function):
    """log_softmax(h @ W.T / temperature)[t] per row, for a frozen W, in float32: the input's gradient is computed in
    forward, chunk by chunk, so neither the logits nor W are needed in backward (fsdp frees lm_head right away)."""

    @staticmethod
    def forward(ctx, h, weight, targets, rows, temperature):
        w, n = weight.float(), h.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=h.device)
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[0] else None
        for i in range(0, n, rows):
            t = targets[i : i + rows]
            logp = torch.log_softmax(linear(h[i : i + rows].float(), w).div_(temperature), -1)
            out[i : i + rows] = logp.gather(1, t[:, None]).squeeze(1)
            if grad_h is not None:  # d logp[t] / d logits = (one-hot(t) - softmax) / temperature
                d = logp.exp_().neg_()
                d[torch.arange(len(t), device=t.device), t] += 1
                grad_h[i : i + rows] = linear(d, w.T).div_(temperature)
        ctx.save_for_backward(grad_h)
        ctx.h_dtype = h.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_out[:, None]).to(ctx.h_dtype) if grad_h is not None else None, None, None, None, None


def rows_per_chunk(vocab_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Rows of hidden states projected together: CHUNK_ELEMENTS logits (twice as many in bf16)."""
    return max(1, (BF16_CHUNK_ELEMENTS if dtype == torch.bfloat16 else CHUNK_ELEMENTS) // vocab_size)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of h @ weight.T (h: (N, dim), weight: (V, dim)) against targets (N,): on a GPU through
    liger-kernel's fused linear cross-entropy where it is installed (ours, with one warning, from a failure on),
    elsewhere through ours."""
    global _liger_failed
    if h.is_cuda and not _liger_failed and liger_function() is not None:
        try:
            return liger_cross_entropy(h, weight, targets)
        except Exception as e:  # Triton's compile errors have no common base; ours computes the same sum
            _liger_failed = True
            warnings.warn(f"liger-kernel's cross-entropy failed ({type(e).__name__}: {str(e)[:200]}); using ours")
    return _LinearCrossEntropy.apply(h, weight, targets, rows_per_chunk(weight.shape[0], h.dtype))


_liger_failed = False


@functools.cache
def liger_function():
    """liger-kernel's LigerFusedLinearCrossEntropyFunction, or None where liger-kernel (or Triton) is missing."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyFunction


def liger_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of h @ weight.T against targets by liger-kernel's Triton kernels (the gradients computed
    in the forward, chunk by chunk, as ours), in autocast's dtype under autocast; a trained weight's gradient
    accumulated in float32."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        h, weight = h.to(dtype), weight.to(dtype)
    accum = torch.float32 if weight.requires_grad else None
    with torch.autocast(device, enabled=False):
        return liger_function().apply(h, weight, targets, None, None, -100, 0.0, 0.0, "sum", None, False, accum)[0]


def _ce_chunk(logits_of, h, t, reduction="sum", temperature: float = 1.0):
    logits = logits_of(h)
    return F.cross_entropy(logits if temperature == 1.0 else logits / temperature, t, reduction=reduction)


def chunked_cross_entropy(
    h: torch.Tensor, targets: torch.Tensor, logits_of, vocab_size: int, reduction: str = "sum", temperature=1.0
) -> torch.Tensor:
    """Cross-entropy of logits_of(h) against targets, summed ("sum") or per row ("none"), a chunk of rows at a
    time, each chunk's logits recomputed in backward instead of stored; logits_of: (n, dim) -> (n, V) float32."""
    rows = rows_per_chunk(vocab_size) if reduction == "none" else rows_per_chunk(vocab_size, h.dtype)
    chunks = []
    for i in range(0, h.shape[0], rows):
        chunk = (logits_of, h[i : i + rows], targets[i : i + rows], reduction, temperature)
        chunks.append(
            checkpoint(_ce_chunk, *chunk, use_reentrant=False) if torch.is_grad_enabled() else _ce_chunk(*chunk)
        )
    if reduction == "none":
        return torch.cat(chunks) if chunks else h.new_zeros(0, dtype=torch.float32)
    return sum(chunks, h.new_zeros((), dtype=torch.float32))


def linear_log_probs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log_softmax(h @ weight.T / temperature)[targets] per row (N,) in float32, for a frozen weight."""
    return _LinearLogProbs.apply(h, weight, targets, rows_per_chunk(weight.shape[0]), temperature)
