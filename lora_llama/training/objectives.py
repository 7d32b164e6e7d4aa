"""What a training step minimises: `SFT` (next-token loss on the targets), `DPO` and `ORPO` (preference pairs),
and their loss on held-out examples.

An objective splits its loss into terms, each a sum over a micro-batch divided by a count taken over the
whole global batch (every micro-batch on every rank) before any forward pass: accumulation and several
processes then train exactly what one big batch trains, as for the SFT loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lora_llama.data.preference import EMPTY_PAIR, collate_pairs
from lora_llama.data.sft import EMPTY_EXAMPLE, collate
from lora_llama.kernels.cross_entropy import target_loss, target_mask, token_logps, where_targets
from lora_llama.lora.adapted import adapters_disabled
from lora_llama.runtime.distributed import Ranks

# what preference objectives log, summed over pairs then averaged (trl's names)
PAIR_STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class Objective:
    """What the trainer asks of an objective: `collate`, `length`, `counts` and `terms` (each objective's own),
    `empty` (a filler example for a rank with nothing to do), and what follows, whose defaults suit data that is
    ready to train on (GRPO overrides them: its batches are rollouts it generates, its eval a reward)."""

    repeats = 1  # optimiser steps per batch of data

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


class SFT(Objective):
    """Cross-entropy per target token."""

    name, empty, stat_names, n_counts = "sft", EMPTY_EXAMPLE, (), 1

    def collate(self, examples: list[dict], pad_id: int) -> dict:
        batch = collate(examples, pad_id)
        return {**batch, **where_targets(batch["labels"], batch.get("segment_ids"))}

    def length(self, example: dict) -> int:
        return len(example["input_ids"])

    def counts(self, batch: dict) -> list[int]:
        return [batch["targets"].numel()]

    def terms(self, model, batch: dict) -> tuple[list[torch.Tensor], dict]:
        return [target_loss(model, **batch)[0]], {}


class _Preference(Objective):
    """Pairs: a batch holds the B chosen rows, then the B rejected ones. A pair counts when both answers
    kept a target token (the filler pair of a rank with nothing to do does not)."""

    empty, stat_names, n_counts = EMPTY_PAIR, PAIR_STATS, 1

    def collate(self, pairs: list[dict], pad_id: int) -> dict:
        return collate_pairs(pairs, pad_id)

    def length(self, pair: dict) -> int:
        return max(len(pair["chosen"]["input_ids"]), len(pair["rejected"]["input_ids"]))

    def counts(self, batch: dict) -> list[int]:
        return [int(_valid(target_mask(batch["labels"]).sum(1)).sum())]


def _valid(per_row: torch.Tensor) -> torch.Tensor:
    chosen, rejected = per_row.chunk(2)
    return (chosen > 0) & (rejected > 0)


def answer_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of the answer's tokens, their number, and the summed
    log-probability of all targets (the prompt's too when it is a target)."""
    logps, keep = token_logps(model, batch["input_ids"], batch["labels"])
    rows, pos = keep.nonzero().unbind(1)
    answer = (pos + 1 >= batch["prompt_lens"][rows]).to(logps.dtype)  # label pos+1 lies past the prompt
    zeros = logps.new_zeros(keep.shape[0])
    return zeros.index_add(0, rows, logps * answer), zeros.index_add(0, rows, answer), zeros.index_add(0, rows, logps)


def _pair_stats(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, valid) -> dict:
    v = valid.to(chosen_rewards.dtype)
    values = (
        chosen_rewards,
        rejected_rewards,
        (chosen_rewards > rejected_rewards).to(v.dtype),
        chosen_rewards - rejected_rewards,
        chosen_logps,
        rejected_logps,
    )
    return {name: float((x.detach() * v).sum()) for name, x in zip(PAIR_STATS, values)}


class DPO(_Preference):
    """Direct preference optimisation against the base (the adapter switched off, no second model):
    sigmoid: -log σ(β·((π_c - ref_c) - (π_r - ref_r))) on summed log-probs (trl's `sigmoid`);
    ipo: ((π_c - ref_c)/n_c - (π_r - ref_r)/n_r - 1/(2β))² on per-token averages (trl's `ipo`)."""

    name = "dpo"

    def __init__(self, beta: float = 0.1, loss: str = "sigmoid"):
        self.beta, self.loss = beta, loss

    def terms(self, model, batch: dict) -> tuple[list[torch.Tensor], dict]:
        with torch.no_grad(), adapters_disabled(model):  # the reference: no graph, no gradient buffers
            reference = answer_logps(model, batch)[0]
        policy, n, _ = answer_logps(model, batch)
        valid = _valid(n)
        chosen, rejected = (policy - reference).chunk(2)
        if self.loss == "ipo":
            n_c, n_r = n.clamp(min=1).chunk(2)
            per_pair = (chosen / n_c - rejected / n_r - 1 / (2 * self.beta)) ** 2
        else:
            per_pair = -F.logsigmoid(self.beta * (chosen - rejected))
        stats = _pair_stats(self.beta * chosen, self.beta * rejected, *policy.chunk(2), valid)
        return [torch.where(valid, per_pair, 0.0).sum()], stats


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class ORPO(_Preference):
    """Odds-ratio preference optimisation, no reference at all: the chosen answers' NLL per target token
    plus β·(-log σ(log odds(chosen) - log odds(rejected))) per pair, odds from per-token average log-probs."""

    name, n_counts = "orpo", 2

    def __init__(self, beta: float = 0.1):
        self.beta = beta

    def counts(self, batch: dict) -> list[int]:
        per_row = target_mask(batch["labels"]).sum(1)
        valid = _valid(per_row)
        return [int(valid.sum()), int(per_row.chunk(2)[0][valid].sum())]

    def terms(self, model, batch: dict) -> tuple[list[torch.Tensor], dict]:
        policy, n, every_target = answer_logps(model, batch)
        valid = _valid(n)
        mean_c, mean_r = (policy / n.clamp(min=1)).chunk(2)
        log_odds = (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r))
        odds_ratio = torch.where(valid, -F.logsigmoid(log_odds), 0.0).sum() * self.beta
        nll = -torch.where(valid, every_target.chunk(2)[0], 0.0).sum()
        return [odds_ratio, nll], _pair_stats(self.beta * mean_c, self.beta * mean_r, mean_c, mean_r, valid)


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
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": counts[0]}
    return {"loss": loss, **{k: v / max(counts[0], 1) for k, v in zip(stats, totals[2 * n :])}, "pairs": counts[0]}
