"""Which examples make each global micro-batch: a fresh seeded shuffle each epoch, so a position is all a resume
needs, and the order is the one-process order whatever the number of ranks."""

from __future__ import annotations

import math

import torch

from lora_llama.runtime.distributed import Ranks


class MicroBatches:
    """The micro-batches of a run: batch_size examples on each rank make one global micro-batch."""

    def __init__(
        self,
        examples: list[dict],
        batch_size: int,
        seed: int,
        ranks: Ranks,
        objective,
        pad_id: int,
        every_rank_runs: bool = False,
    ):
        self.examples, self.batch_size, self.seed, self.ranks = examples, batch_size, seed, ranks
        self.objective, self.pad_id = objective, pad_id
        self.every_rank_runs = every_rank_runs  # fsdp's gathers are collectives: every rank runs every micro-batch
        self.per_epoch = math.ceil(len(examples) / (batch_size * ranks.world))

    def __getitem__(self, index: int) -> dict | None:
        """This rank's share of the index-th global micro-batch, collated on the host (counted there). None when
        the last micro-batch of an epoch leaves this rank nothing."""
        size = self.batch_size * self.ranks.world
        epoch, i = divmod(index, self.per_epoch)
        order = torch.randperm(len(self.examples), generator=torch.Generator().manual_seed(self.seed + epoch))
        chosen = [
            self.examples[j] for j in self.ranks.share(order[i * size : (i + 1) * size].tolist(), self.batch_size)
        ]
        if not chosen and self.every_rank_runs:
            chosen = [self.objective.empty]
        return self.objective.collate(chosen, self.pad_id) if chosen else None
