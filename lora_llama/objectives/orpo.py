"""Odds-ratio preference optimisation (trl's `ORPOTrainer`): no reference at all."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field

from lora_llama.objectives.pairs import PairObjective, pair_stats, valid_pairs
from lora_llama.objectives.token_losses import answer_logps, sequence_targets
from lora_llama.validation import Settings


class ORPOSettings(Settings):
    """Odds-ratio preference optimisation: the chosen answers' NLL plus beta times the odds-ratio term."""

    beta: float = Field(0.1, gt=0, description="weight of the odds-ratio term (the paper's lambda; trl's beta)")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -ln 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class ORPO(PairObjective):
    """The chosen answers' NLL per target token plus β·(-log σ(log odds(chosen) - log odds(rejected))) per pair,
    odds from per-token average log-probs."""

    name, about, settings, n_counts = "orpo", "ORPO on preference pairs", ORPOSettings, 2

    def __init__(self, settings: ORPOSettings = ORPOSettings()):
        self.beta = settings.beta

    def counts(self, batch: dict) -> list[int]:
        per_answer = sequence_targets(batch)
        valid = valid_pairs(per_answer)
        return [int(valid.sum()), int(per_answer.chunk(2)[0][valid].sum())]

    def terms(self, model, batch: dict) -> tuple[list[torch.Tensor], dict]:
        policy, n, every_target = answer_logps(model, batch)
        valid = valid_pairs(n)
        mean_c, mean_r = (policy / n.clamp(min=1)).chunk(2)
        log_odds = (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r))
        odds_ratio = torch.where(valid, -F.logsigmoid(log_odds), 0.0).sum() * self.beta
        nll = -torch.where(valid, every_target.chunk(2)[0], 0.0).sum()
        return [odds_ratio, nll], pair_stats(self.beta * mean_c, self.beta * mean_r, mean_c, mean_r, valid)
