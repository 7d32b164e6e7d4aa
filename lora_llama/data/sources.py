"""Several data sources in one recipe (`data.sources`): each read as its own `data` section would be, then their
training examples drawn together in the proportions of their weights.

The mixture has as many rows as the sources have training examples together (an epoch is as long as the data).
Each row is drawn from a source picked by weight, and takes that source's next example in a seeded shuffled
order, starting the order again when it runs out: a small source with a large weight repeats, a large one with a
small weight is subsampled. Everything is seeded by train.seed, so a resumed run sees the same rows. Each source
holds out its own share of records for validation (data.val_size), and the held-out examples are all kept.
"""

from __future__ import annotations

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


def mix(parts: list[list[dict]], weights: list[float], seed: int) -> tuple[list[dict], list[int]]:
    """The mixture of the sources' examples (see the module's docstring), and how many rows each source gave."""
    rng = random.Random(seed)
    orders = [rng.sample(range(len(p)), len(p)) for p in parts]
    taken, counts, rows = [0] * len(parts), [0] * len(parts), []
    for source in rng.choices(range(len(parts)), weights=weights, k=sum(len(p) for p in parts)):
        part, order = parts[source], orders[source]
        if taken[source] == len(order):  # a new pass over the source, in a new order
            orders[source], taken[source] = rng.sample(range(len(part)), len(part)), 0
            order = orders[source]
        rows.append(part[order[taken[source]]])
        taken[source] += 1
        counts[source] += 1
    return rows, counts


def mixture_line(names: list[str], weights: list[float], sizes: list[int], counts: list[int]) -> str:
    """One line: each source's rows in the mixture, their share against its weight, and its examples."""
    total, weight_sum = sum(counts), sum(weights)
    shown = [
        f"{name} {n} ({100 * n / total:.1f}%, weight {w / weight_sum:.2f}, {size} examples)"
        for name, w, size, n in zip(names, weights, sizes, counts)
    ]
    return f"data mixture of {len(names)} sources, {total} rows: " + "; ".join(shown)
