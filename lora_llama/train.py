"""The training loop: optimiser, schedule, accumulation, eval, checkpoint / resume, logging."""
from __future__ import annotations

import math

import torch

from .data import collate
from .loss import target_loss


def _to(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def evaluate(model, examples: list[dict], batch_size: int, pad_id: int) -> dict:
    """Mean loss per target token over `examples`, and its perplexity."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    # sorted by length so batches carry little padding
    ordered = sorted(examples, key=lambda e: len(e["input_ids"]))
    for i in range(0, len(ordered), batch_size):
        loss, n = target_loss(model, **_to(collate(ordered[i:i + batch_size], pad_id), device))
        total, count = total + float(loss), count + n
    model.train(was_training)
    mean = total / max(count, 1)
    return {"loss": mean, "perplexity": math.exp(min(mean, 50.0)), "tokens": count}


def evaluate_documents(model, tokenizer, docs: list[str], batch_size: int = 8) -> dict:
    """`lora-llama eval`: each document tokenised with the tokenizer's defaults, no EOS added.

    Documents longer than the model's context are cut into independent windows.
    """
    window = model.args.max_seq_len
    examples = []
    for doc in docs:
        ids = tokenizer(doc)["input_ids"]
        examples += [{"input_ids": ids[i:i + window], "labels": ids[i:i + window]} for i in range(0, len(ids), window)]
    return evaluate(model, examples, batch_size, tokenizer.pad_token_id)
