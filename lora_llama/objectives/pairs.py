"""What the objectives on preference pairs share: their data (`data.format: preference`), batches of B chosen
rows then B rejected ones, which pairs count, and trl's pair statistics."""

from __future__ import annotations

import torch

from lora_llama.data.preference import EMPTY_PAIR, build_pairs, collate_pairs
from lora_llama.objectives.base import Objective
from lora_llama.objectives.reporting import LOSS, Measure, Reporting
from lora_llama.objectives.token_losses import sequence_targets

# what preference objectives log, summed over pairs then averaged (trl's names)
PAIR_STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class PairObjective(Objective):
    """Pairs: a batch holds the B chosen answers, then the B rejected ones, a row each, or with data.packing the 2B
    answers packed into rows of data.max_seq_len (each attending to itself), summed per answer alike. A pair counts
    when both answers kept a target token (the filler pair of a rank with nothing to do does not)."""

    data_formats = {"preference": "prompt/chosen/rejected"}
    empty, stat_names, n_counts, counted, packs = EMPTY_PAIR, PAIR_STATS, 1, "pairs", True
    reporting = Reporting(
        (
            LOSS,
            Measure("eval_rewards/accuracies", "reward accuracy", higher_is_better=True, digits=3),
            Measure("eval_rewards/margins", "reward margin", higher_is_better=True),
        ),
        "held-out pairs",
        curves=("rewards/accuracies", "rewards/margins"),
        loss_unit="per pair",
    )

    @classmethod
    def examples(cls, recipe, tokenizer, log) -> tuple[list[dict], list[dict]]:
        return build_pairs(recipe.data, tokenizer, recipe.train.seed, log)

    def collate(self, pairs: list[dict], pad_id: int) -> dict:
        return collate_pairs(pairs, pad_id, self.row_length, self.pack_to)

    def length(self, pair: dict) -> int:
        return max(len(pair["chosen"]["input_ids"]), len(pair["rejected"]["input_ids"]))

    def counts(self, batch: dict) -> list[int]:
        return [int(valid_pairs(sequence_targets(batch)).sum())]


def valid_pairs(per_row: torch.Tensor) -> torch.Tensor:
    """(B,) whether both rows of each pair have something: per_row holds the B chosen values then the B rejected."""
    chosen, rejected = per_row.chunk(2)
    return (chosen > 0) & (rejected > 0)


def pair_stats(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, valid) -> dict:
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
