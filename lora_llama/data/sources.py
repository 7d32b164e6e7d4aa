"""Several data sources in one recipe (`data.sources`): each read as its own `data` section would be, then their
training examples put together in the proportions of their weights.

The mixture has as many rows as the sources have training examples together (an epoch is as long as the data).
Each source is allotted its rows by weight with the largest remainder method, so that its share is its weight to
within one row (a random draw per row drifts by its sampling noise, most for small sources); it gives them from
its examples in a seeded shuffled order, starting a new order when it runs out (a small source with a large weight
repeats, a large one with a small weight is subsampled), and the rows of every source are shuffled together.
Everything is seeded by train.seed, so a resumed run sees the same rows. Each source holds out its own share of
records for validation (data.val_size), and the held-out examples are all kept. A stream, which cannot be counted,
takes at each row the source furthest behind its share (`next_source`), within one row of the weights at every
point.
"""

from __future__ import annotations

import math
import random

SOURCE_KEYS = ("source", "format", "fields", "config", "split", "data_files", "max_examples", "system_prompt")


def source_sections(data) -> list[tuple[str, float, object]]:
    """(name, weight, the `data` section as that source alone) for each source; data.source alone is one of
    weight 1."""
    if not data.sources:
        return [(data.source, 1.0, data)]
    sections = []
    for item in data.sources:
        update = {k: getattr(item, k) for k in SOURCE_KEYS if k in item.model_fields_set or k == "source"}
        sections.append((item.source, item.weight, data.model_copy(update={**update, "sources": None})))
    return sections


def allotment(weights: list[float], total: int) -> list[int]:
    """Each source's rows of `total`, by the largest remainder method: every share is its weight's to within one
    row (ties go to the earlier source)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def mix(parts: list[list[dict]], weights: list[float], seed: int) -> tuple[list[dict], list[int]]:
    """The mixture of the sources' examples (see the module's docstring), and how many rows each source gave."""
    rng = random.Random(seed)
    counts = allotment(weights, sum(len(p) for p in parts))
    rows = []
    for part, n in zip(parts, counts):
        order = []
        while len(order) < n:  # whole passes in new seeded orders, the last one cut short
            order += rng.sample(range(len(part)), len(part))
        rows += [part[i] for i in order[:n]]
    rng.shuffle(rows)
    return rows, counts


def next_source(weights: list[float], given: list[int]) -> int:
    """The source a stream's next row comes from: the one furthest behind its weight's share of the rows so far
    (with the row), so that every share stays within one row of its weight (ties to the earlier source)."""
    total = sum(given) + 1
    return max(range(len(weights)), key=lambda i: (total * weights[i] / sum(weights) - given[i], -i))


def mixture_line(names: list[str], weights: list[float], sizes: list[int], counts: list[int]) -> str:
    """One line: each source's rows in the mixture, their share against its weight, and its examples."""
    total, weight_sum = sum(counts), sum(weights)
    shown = [
        f"{name} {n} ({100 * n / total:.1f}%, weight {w / weight_sum:.2f}, {size} examples)"
        for name, w, size, n in zip(names, weights, sizes, counts)
    ]
    return f"data mixture of {len(names)} sources, {total} rows: " + "; ".join(shown)
