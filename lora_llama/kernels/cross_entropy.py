"""Cross-entropy on target positions only, chunked over the vocabulary projection.

Full (batch, seq, vocab) logits are never built: only positions whose label is
not -100 are projected, a chunk of rows at a time. For a plain (frozen or not)
lm_head the gradient of each chunk is computed right away in the forward pass,
so neither the logits nor their gradient are kept for backward (the idea of
Liger's fused linear cross-entropy).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lora_llama.kernels.blocked_attention import LOG2E
from lora_llama.kernels.gemm import linear

IGNORE_INDEX = -100
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
        # every pass: under glibc's 32 MB mmap threshold it stays on the heap, where a fresh or larger one is
        # page-faulted in again each step
        work = min(rows, max(1, CHUNK_ELEMENTS // weight.shape[0]), h.shape[0])
        logp_buf = h.new_empty((work, weight.shape[0]), dtype=torch.float32)
        # float32 chunks in one pass keep their gradient in the buffer; others write it over the logits' rows
        in_buffer = work >= rows and h.dtype == torch.float32
        for i in range(0, h.shape[0], rows):
            hc, tc = h[i : i + rows], targets[i : i + rows]
            logits = linear(hc, weight)  # (rows, V)
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


def _logits(lm_head, h):
    """An adapted lm_head's logits in float32, from bf16 activations too: bf16 products round their output to
    8 bits (at |logit| ~ 20, steps of 0.125), which an adapted lm_head's growing logits turn into a worse fit
    (the overfit test's eval loss: 0.45 vs 0.23 in float32). A frozen lm_head keeps the pretrained
    scale, and its bf16 product (float32 accumulation, as under autocast) costs half the float32 one."""
    if h.dtype != torch.bfloat16:
        return lm_head(h).float()
    node = getattr(lm_head, "low_rank_node", lambda _: None)(h)  # a LoRA layer's (W0, b, A, B, scale)
    if node is None and type(lm_head) is nn.Linear:
        node = (lm_head.weight, lm_head.bias, None, None, 0.0)
    if node is None:
        return lm_head(h).float()
    w0, b, lora_a, lora_b, scale = node
    h32 = h.float()
    y = F.linear(h32, w0.float(), None if b is None else b.float())
    return y if lora_a is None else y.addmm_(F.linear(h32, lora_a.float()), lora_b.float().t(), alpha=scale)


def _ce_chunk(lm_head, h, t, reduction="sum", temperature: float = 1.0):
    logits = _logits(lm_head, h)
    return F.cross_entropy(logits if temperature == 1.0 else logits / temperature, t, reduction=reduction)


def linear_cross_entropy(h: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of lm_head(h) (N, dim) against targets (N,)."""
    rows = max(1, (BF16_CHUNK_ELEMENTS if h.dtype == torch.bfloat16 else CHUNK_ELEMENTS) // lm_head.out_features)
    if isinstance(lm_head, nn.Linear) and lm_head.bias is None:  # an fsdp-sharded nn.Linear is a subclass
        return _LinearCrossEntropy.apply(h, lm_head.weight, targets, rows)
    # an adapted lm_head: recompute each chunk's logits in backward instead of storing them
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], rows):
        chunk = (lm_head, h[i : i + rows], targets[i : i + rows])
        total = total + (
            checkpoint(_ce_chunk, *chunk, use_reentrant=False) if torch.is_grad_enabled() else _ce_chunk(*chunk)
        )
    return total


@contextlib.contextmanager
def whole(module: nn.Module):
    """fsdp: a module sharded on its own (it has `unshard`) is gathered inside the block and freed after it, so
    lm_head's whole weight exists only while the loss reads it."""
    if not hasattr(module, "unshard"):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def target_mask(labels: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T-1) bool: which of labels[:, 1:] the loss takes (the one definition)."""
    keep = labels[:, 1:] != IGNORE_INDEX
    if segment_ids is not None:  # a packed row: the last token of one example does not predict the next
        keep &= segment_ids[:, 1:] == segment_ids[:, :-1]
    return keep


def where_targets(labels: torch.Tensor, segment_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """{"targets": the target ids (N,), "predicting": the flat positions of (B, T) whose outputs predict them (N,)}.
    Taken where a batch is built, on the host, they let a GPU step run without waiting to learn N."""
    keep = target_mask(labels, segment_ids)
    return {"targets": labels[:, 1:][keep], "predicting": F.pad(keep, (0, 1)).flatten().nonzero().squeeze(1)}


def target_loss(model, input_ids, labels, position_ids=None, segment_ids=None, targets=None, predicting=None):
    """(summed loss, number of targets): position t predicts labels[t + 1]; -100 is ignored. targets and
    predicting: `where_targets(labels, segment_ids)`, when the batch carries them.

    Returning the sum lets gradient accumulation divide by the target count of the
    whole accumulated batch instead of averaging per-micro-batch means.
    """
    if targets is None:
        targets, predicting = where_targets(labels, segment_ids).values()
    h = model(input_ids, position_ids, segment_ids, keep=predicting, hidden_only=True)  # (N, dim)
    n = targets.numel()
    with whole(model.lm_head):  # on every rank, targets or not: gathering is a collective
        return (linear_cross_entropy(h, model.lm_head, targets), n) if n else (h.sum() * 0.0, 0)


def token_logps(
    model, input_ids, labels, temperature: float = 1.0, position_ids=None, segment_ids=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of every target token (N,), the (B, T-1) mask of where they are): what preference
    objectives sum per row, and GRPO takes per token (from logits / temperature, the distribution sampled).
    The logits are built a chunk of targets at a time and recomputed in backward: B x T x V never exists."""
    keep = target_mask(labels, segment_ids)
    targets = labels[:, 1:][keep]
    h = model(input_ids, position_ids, segment_ids, keep=F.pad(keep, (0, 1)), hidden_only=True)  # (N, dim)
    lm_head, rows = model.lm_head, max(1, CHUNK_ELEMENTS // model.lm_head.out_features)
    chunks = [h.sum() * 0.0]  # keeps the graph (and fsdp's hooks) when there is no target
    with whole(lm_head):
        if isinstance(lm_head, nn.Linear) and lm_head.bias is None and not lm_head.weight.requires_grad:
            return _LinearLogProbs.apply(h, lm_head.weight, targets, rows, temperature) + chunks[0], keep
        for i in range(0, h.shape[0], rows):  # an adapted lm_head: each chunk's logits recomputed in backward
            chunk = (lm_head, h[i : i + rows], targets[i : i + rows], "none", temperature)
            chunks.append(
                -(checkpoint(_ce_chunk, *chunk, use_reentrant=False) if torch.is_grad_enabled() else _ce_chunk(*chunk))
            )
    return (torch.cat(chunks[1:]) if len(chunks) > 1 else h.new_zeros(0, dtype=torch.float32)) + chunks[0], keep
