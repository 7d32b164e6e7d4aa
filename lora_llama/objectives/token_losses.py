"""The per-token losses every objective is made of, from the model's hidden states at the positions that predict a
target: the summed cross-entropy (`target_loss`), each target's log-probability (`token_logps`) and their sums
per answer (`answer_logps`). The logits are built by kernels/cross_entropy.py a chunk at a time: B x T x V never
exists."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from lora_llama.kernels.cross_entropy import chunked_cross_entropy, linear_cross_entropy, linear_log_probs
from lora_llama.labels import target_mask, where_targets
from lora_llama.runtime.distributed import gathered


def plain_weight(lm_head: nn.Module) -> torch.Tensor | None:
    """lm_head's weight when lm_head is a bias-free linear layer (an fsdp-sharded nn.Linear is a subclass), else
    None: an adapted lm_head's logits come from the layer itself."""
    return lm_head.weight if isinstance(lm_head, nn.Linear) and lm_head.bias is None else None


def head_logits(lm_head: nn.Module, h: torch.Tensor) -> torch.Tensor:
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


def output_loss(h: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of lm_head(h) (N, dim) against targets (N,)."""
    weight = plain_weight(lm_head)
    if weight is not None:
        return linear_cross_entropy(h, weight, targets)
    return chunked_cross_entropy(h, targets, partial(head_logits, lm_head), lm_head.out_features)


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
    with gathered(model.lm_head):  # on every rank, targets or not: gathering is a collective
        return (output_loss(h, model.lm_head, targets), n) if n else (h.sum() * 0.0, 0)


ENTROPY_CHUNK = 1 << 22  # logits a chunk of rows holds while entropies are taken (16 MB in float32)


@torch.no_grad()
def entropies(h: torch.Tensor, lm_head: nn.Module, temperature: float) -> torch.Tensor:
    """The entropy (nats) of softmax(lm_head(h) / temperature) at each row of h (N, dim), a chunk of rows at a time;
    without gradient (it selects tokens, it is not trained on)."""
    rows = max(1, ENTROPY_CHUNK // lm_head.out_features)
    out = []
    for chunk in h.detach().split(rows):
        logits = head_logits(lm_head, chunk) / temperature
        logp = torch.log_softmax(logits, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out) if out else h.new_zeros(0, dtype=torch.float32)


def token_logps(
    model, input_ids, labels, temperature: float = 1.0, position_ids=None, segment_ids=None, with_entropy=False
):
    """(log-probability of every target token (N,), the (B, T-1) mask of where they are): what preference
    objectives sum per row, and GRPO takes per token (from logits / temperature, the distribution sampled); with
    with_entropy, the entropy of each of those distributions third (N,), without gradient."""
    keep = target_mask(labels, segment_ids)
    targets = labels[:, 1:][keep]
    h = model(input_ids, position_ids, segment_ids, keep=F.pad(keep, (0, 1)), hidden_only=True)  # (N, dim)
    lm_head = model.lm_head
    no_target = h.sum() * 0.0  # keeps the graph (and fsdp's hooks) when there is no target
    with gathered(lm_head):
        logps = head_log_probs(h, lm_head, targets, temperature) + no_target
        return (logps, keep, entropies(h, lm_head, temperature)) if with_entropy else (logps, keep)


def head_log_probs(h: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """The targets' log-probabilities under lm_head(h) / temperature (lm_head gathered by the caller)."""
    weight = plain_weight(lm_head)
    if weight is not None and not weight.requires_grad:
        return linear_log_probs(h, weight, targets, temperature)
    nll = chunked_cross_entropy(h, targets, partial(head_logits, lm_head), lm_head.out_features, "none", temperature)
    return -nll


def sequence_owner(batch: dict, keep: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each target token's sequence (its row; in a packed batch, the `sequence` of `packed_sequences`) and the
    number of sequences: what per-answer and per-completion sums add up by."""
    if "sequence" in batch:
        return batch["sequence"][:, 1:][keep], int(batch["sequences"])
    return keep.nonzero()[:, 0], keep.shape[0]


def sequence_targets(batch: dict) -> torch.Tensor:
    """Each sequence's number of target tokens (a row's, or a packed sequence's)."""
    owner, n = sequence_owner(batch, target_mask(batch["labels"], batch.get("segment_ids")))
    return torch.zeros(n, dtype=torch.long, device=owner.device).index_add(0, owner, torch.ones_like(owner))


def answer_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per answer (a row, or a packed row's sequence): the summed log-probability of the answer's tokens, their
    number, and the summed log-probability of all targets (the prompt's too when it is a target)."""
    places = (batch.get("position_ids"), batch.get("segment_ids"))
    logps, keep = token_logps(model, batch["input_ids"], batch["labels"], 1.0, *places)
    owner, n = sequence_owner(batch, keep)
    if "answer" in batch:  # packed: whether each label lies past its sequence's prompt
        answer = batch["answer"][:, 1:][keep].to(logps.dtype)
    else:  # label pos+1 lies past the prompt
        answer = (keep.nonzero()[:, 1] + 1 >= batch["prompt_lens"][owner]).to(logps.dtype)

    def summed(values):
        return logps.new_zeros(n).index_add(0, owner, values)

    return summed(logps * answer), summed(answer), summed(logps)
