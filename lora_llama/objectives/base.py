"""The contract every objective meets, and the loss on held-out examples.

An objective declares in its own module everything the rest of the package asks of it: its name (the value of
`train.objective`), its settings section (`train.<name>`), the data formats it reads, how its examples and batches
are built, and its loss. The schema, the recipe entry and the trainer find it through objectives/catalog.py.

An objective splits its loss into terms, each a sum over a micro-batch divided by a count taken over the
whole global batch (every micro-batch on every rank) before any forward pass: accumulation and several
processes then train exactly what one big batch trains, as for the SFT loss.
"""

from __future__ import annotations

import math

import torch

from lora_llama.objectives.reporting import LOSS, Measure, Reporting
from lora_llama.runtime.distributed import Ranks

SHORTEST_BUCKET = 64  # tokens


def bucketed_length(n: int, limit: int) -> int:
    """The length rows of up to n tokens are padded to under a compiled model: the next power of two from
    SHORTEST_BUCKET, at most `limit` (data.max_seq_len), so that a run compiles a graph for a few lengths only,
    not one for every longest example; n itself past the limit."""
    bucket = max(SHORTEST_BUCKET, 1 << (n - 1).bit_length())
    return max(n, min(bucket, limit))


def bucket_lengths(limit: int) -> list[int]:
    """Every length `bucketed_length` pads to under `limit`."""
    return sorted({bucketed_length(n, limit) for n in range(1, limit + 1)})


class Objective:
    """What the schema, the recipe entry and the trainer ask of an objective.

    Declared by each objective: `name`, `about` (one line for the schema and the model card), `settings` (the
    pydantic class of its `train.<name>` section, or None), `data_formats` ({data.format value: the columns it
    holds}), `packs` (whether data.packing applies), `build` and `examples` (classmethods), and per batch
    `collate`, `length`, `counts`, `terms`, `empty` (a filler example for a rank with nothing to do),
    `stat_names` and `n_counts`. What follows has defaults that suit data that is ready to train on (GRPO
    overrides them: its batches are rollouts it generates, its eval a reward)."""

    name: str
    about: str
    settings: type | None = None
    data_formats: dict[str, str] = {}
    packs = False
    counted = "tokens"  # what the held-out loss is averaged over
    row_length = None  # the length rows of up to n tokens are padded to (None: n); see bucketed_length
    pack_to = None  # data.max_seq_len under data.packing: what a batch's sequences pack to where `collate` packs
    cached = True  # its examples are kept between runs (data/cache.py): rows of one layout, in Arrow's types
    repeats = 1  # optimiser steps per batch of data
    streams = False  # whether it reads data.streaming's sources (data/streaming.py gives its examples then)
    # what its runs report (objectives/reporting.py): by default the loss and its perplexity on held-out examples
    reporting = Reporting(
        (LOSS, Measure("eval_perplexity", "perplexity", higher_is_better=False, digits=2, charted=False)),
        "held-out examples",
    )

    @classmethod
    def build(cls, recipe, tokenizer, eos_ids: list[int]) -> Objective:
        """The objective for a recipe (its settings section is `recipe.train.<name>`)."""
        return cls() if cls.settings is None else cls(getattr(recipe.train, cls.name))

    @classmethod
    def examples(cls, recipe, tokenizer, log) -> tuple[list[dict], list[dict]]:
        """(train, val) examples from the recipe's `data` section, in the form `collate` takes."""
        raise NotImplementedError

    @classmethod
    def card_line(cls, settings: dict | None) -> str:
        """The objective's row in a model card's settings table."""
        shown = ", ".join(f"{k} {v}" for k, v in (settings or {}).items())
        return f"{cls.name.upper()} ({shown})" if shown else cls.about

    def evaluate(self, model, examples: list[dict], batch_size: int, pad_id: int, ranks: Ranks) -> dict:
        """The loss on held-out examples (see `held_out_loss`)."""
        return held_out_loss(self, model, examples, batch_size, pad_id, ranks)

    def prepare(self, model, batches: list[dict], step: int, ranks) -> list[dict]:
        return batches

    def summarize(self, stat_sums: dict, totals: list[int], ranks) -> dict:
        return {k: v / max(totals[0], 1) for k, v in stat_sums.items()}

    def state(self) -> dict | None:
        return None

    def load_state(self, state: dict | None, device) -> None:
        pass


@torch.no_grad()
def held_out_loss(objective, model, examples: list[dict], batch_size: int, pad_id: int, ranks: Ranks) -> dict:
    """The objective's loss over `examples` (SFT: mean per target token, with its perplexity; preference:
    mean per pair, with the rewards averaged over pairs); with several ranks, each evaluates every
    world-th example and the sums are added up."""
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
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), objective.counted: counts[0]}
    summed = dict(zip(stats, totals[2 * n :]))
    return {"loss": loss, **objective.summarize(summed, counts, ranks), objective.counted: counts[0]}
