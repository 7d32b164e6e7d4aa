"""A training objective's loss on held-out examples (training's eval; SFT: per target token, with perplexity)
or on documents (`lora-llama eval`)."""

from __future__ import annotations

import math

import torch

from lora_llama.runtime.distributed import Ranks
from lora_llama.training.objectives import SFT


@torch.no_grad()
def evaluate(model, examples: list[dict], batch_size: int, pad_id: int, ranks: Ranks = Ranks(), objective=None) -> dict:
    """The objective's loss over `examples` (SFT: mean per target token, with its perplexity; preference:
    mean per pair, with the rewards averaged over pairs); with several ranks, each evaluates every
    world-th example and the sums are added up."""
    objective = objective or SFT()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    # sorted by length so batches carry little padding
    ordered = sorted(examples, key=objective.length)[ranks.rank :: ranks.world]
    # every rank runs as many batches as the one with most (fsdp's gathers are collectives)
    per_rank = math.ceil(len(examples) / ranks.world) if ranks.world > 1 else len(ordered)
    ordered += [objective.empty] * (per_rank - len(ordered))
    counts, terms, stats = None, None, dict.fromkeys(objective.stat_names, 0.0)
    for i in range(0, len(ordered), batch_size):
        batch = {k: v.to(device) for k, v in objective.collate(ordered[i : i + batch_size], pad_id).items()}
        batch_counts = objective.counts(batch)
        batch_terms, batch_stats = objective.terms(model, batch)
        counts = [a + b for a, b in zip(counts or [0] * len(batch_counts), batch_counts)]
        terms = [a + float(b) for a, b in zip(terms or [0.0] * len(batch_terms), batch_terms)]
        stats = {k: stats[k] + batch_stats[k] for k in stats}
    model.train(was_training)
    n = len(counts or [0])
    totals = ranks.sum([*(counts or [0] * n), *(terms or [0.0] * n), *stats.values()])
    counts, terms = [int(c) for c in totals[:n]], totals[n : 2 * n]
    loss = sum(t / max(c, 1) for t, c in zip(terms, counts))
    if not objective.stat_names:
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": counts[0]}
    return {"loss": loss, **{k: v / max(counts[0], 1) for k, v in zip(stats, totals[2 * n :])}, "pairs": counts[0]}


def evaluate_documents(model, tokenizer, docs: list[str], batch_size: int = 8) -> dict:
    """`lora-llama eval`: each document tokenised with the tokenizer's defaults, no EOS added.

    Documents longer than the model's context are cut into independent windows.
    """
    window = model.args.max_seq_len
    examples = []
    for doc in docs:
        ids = tokenizer(doc)["input_ids"]
        examples += [
            {"input_ids": ids[i : i + window], "labels": ids[i : i + window]} for i in range(0, len(ids), window)
        ]
    return evaluate(model, examples, batch_size, tokenizer.pad_token_id)
