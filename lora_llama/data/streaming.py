"""`data.streaming: true`: corpora read as they are trained on, never whole in memory.

Each source is a `datasets` IterableDataset (local files are read a block at a time), its records shuffled in a
buffer of data.buffer_size records (datasets' `shuffle`, seeded by train.seed and the pass), tokenized one at a
time and, with data.packing, packed into rows as they come. A source read to its end starts again in a new order
(datasets' `set_epoch`), so the stream never ends: train.max_steps says how long a run is. Several sources are
interleaved example by example in the proportions of their weights: each row comes from the source furthest behind
its share (data/sources.next_source), so every share is within one row of its weight at every point.

Everything is a function of the seed, so the stream read again from its start gives the same rows: a resumed
run reads past the micro-batches it has trained on (training/batches.StreamingBatches) and continues bit for bit.
Held-out examples come from data.val_source (read whole); a stream holds none out itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from lora_llama.data.loading import load_records
from lora_llama.data.records import ROW, Skipped
from lora_llama.data.sft import packed, record_examples, record_tokenizer, tokenize_records
from lora_llama.data.sources import next_source
from lora_llama.errors import UserError


class StreamedExamples:
    """The training rows of a recipe's sources, read as streams (see the module's docstring)."""

    def __init__(self, sections: list[tuple[str, float, object]], tokenizer, seed: int, log):
        self.sections, self.tokenizer, self.seed, self.log = sections, tokenizer, seed, log
        self.data = sections[0][2]  # the keys every source shares: max_seq_len, packing, buffer_size

    def rows(self) -> Iterator[dict]:
        """The rows, without end: examples drawn from the sources by weight, packed when data.packing asks."""
        streams = [self._examples(name, data) for name, _, data in self.sections]
        weights = [weight for _, weight, _ in self.sections]

        def drawn():
            given = [0] * len(streams)
            while True:
                source = next_source(weights, given)
                given[source] += 1
                yield next(streams[source])

        examples = drawn() if len(streams) > 1 else streams[0]
        return packed(examples, self.data.max_seq_len) if self.data.packing else examples

    def _examples(self, name: str, data) -> Iterator[dict]:
        """One source's examples, pass after pass; the rows its first pass skipped are said once, at its end."""
        for epoch in itertools.count():
            skipped, read, given, tokenize = Skipped(name, data.strict), 0, 0, None
            for record in self._records(data, epoch):
                if tokenize is None:  # format auto reads the first record's columns
                    columns = [c for c in record if c != ROW]
                    tokenize = record_tokenizer(columns, self.tokenizer, data)
                examples = record_examples(tokenize, record, read, data.fields, skipped)
                read, given = read + 1, given + len(examples)
                yield from examples
            if epoch == 0:
                skipped.report(read, self.log)
            if not given:
                raise UserError(f"data source {name!r} gives no training example with a target token")

    def _records(self, data, epoch: int):
        """One pass over a source's records (each with its row, counted from 1), in this pass's shuffled order."""
        records = load_records(data.source, data.config, data.split, data.data_files, streaming=True)
        if data.max_examples:
            records = records.take(data.max_examples)
        records = records.map(lambda _, i: {ROW: i + 1}, with_indices=True)
        if data.buffer_size > 1:
            records = records.shuffle(seed=self.seed, buffer_size=data.buffer_size)
            records.set_epoch(epoch)
        return records


def streamed_val(data, tokenizer, log) -> list[dict]:
    """A streamed run's held-out examples: data.val_source's, read whole (a stream holds none out itself)."""
    if not data.val_source:
        log("data.streaming: no held-out examples (set data.val_source for an eval loss)")
        return []
    records, skipped = load_records(data.val_source), Skipped(data.val_source, data.strict)
    val = tokenize_records(records, tokenizer, data, skipped)
    skipped.report(len(records), log)
    return val
