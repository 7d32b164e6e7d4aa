"""Mean loss per target token and perplexity, on examples (training's eval) or documents (`lora-llama eval`)."""
from __future__ import annotations

import math

import torch

from .data import EMPTY_EXAMPLE, collate
from .distributed import Ranks
from .loss import target_loss


@torch.no_grad()
def evaluate(model, examples: list[dict], batch_size: int, pad_id: int, ranks: Ranks = Ranks()) -> dict:
    """Mean loss per target token over `examples`, and its perplexity; with several ranks, each
    evaluates every world-th example and the sums are added up."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    # sorted by length so batches carry little padding
    ordered = sorted(examples, key=lambda e: len(e["input_ids"]))[ranks.rank::ranks.world]
    # every rank runs as many batches as the one with most (fsdp's gathers are collectives)
    per_rank = math.ceil(len(examples) / ranks.world) if ranks.world > 1 else len(ordered)
    ordered += [EMPTY_EXAMPLE] * (per_rank - len(ordered))
    for i in range(0, len(ordered), batch_size):
        batch = {k: v.to(device) for k, v in collate(ordered[i:i + batch_size], pad_id).items()}
        loss, n = target_loss(model, **batch)
        total, count = total + float(loss), count + n
    model.train(was_training)
    total, count = ranks.sum([total, count])
    count = int(count)
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
