"""Which examples make each global micro-batch: a fresh seeded shuffle each epoch, or a stream's next rows, so a
position is all a resume needs, and the order is the one-process order whatever the number of ranks."""

from __future__ import annotations

import itertools
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


class StreamingBatches:
    """The micro-batches of a streamed run (data/streaming.py): the index-th global micro-batch is the stream's
    index-th batch_size x world rows. Asked in order; a resumed run's first ask reads past the micro-batches
    trained before (the stream from its start gives the same rows)."""

    per_epoch = None  # a stream has no length: train.max_steps decides

    def __init__(self, stream, batch_size: int, ranks: Ranks, objective, pad_id: int):
        self.rows, self.batch_size, self.ranks = stream.rows(), batch_size, ranks
        self.objective, self.pad_id = objective, pad_id
        self.next = 0  # the index of the micro-batch the stream gives next

    def __getitem__(self, index: int) -> dict:
        if index < self.next:
            raise IndexError(f"micro-batch {index} of a stream was read already (the next is {self.next})")
        size = self.batch_size * self.ranks.world
        for _ in range(index - self.next):
            for _ in itertools.islice(self.rows, size):
                pass
        rows = list(itertools.islice(self.rows, size))
        self.next = index + 1
        return self.objective.collate(self.ranks.share(rows, self.batch_size), self.pad_id)


def micro_batches(train, batch_size: int, seed: int, ranks: Ranks, objective, pad_id: int, every_rank_runs: bool):
    """The run's micro-batches: of a list of examples, or of a stream (data/streaming.StreamedExamples)."""
    if isinstance(train, list):
        return MicroBatches(train, batch_size, seed, ranks, objective, pad_id, every_rank_runs)
    return StreamingBatches(train, batch_size, ranks, objective, pad_id)
