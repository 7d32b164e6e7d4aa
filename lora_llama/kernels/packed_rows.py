"""What causal attention over packed rows hides from each query, made once per batch.

Every layer of a step, forward and backward, attends over the same packed rows (equal segment ids),
so the example starts, each block's first and last example start and each key tile's additive mask are kept for
those segment ids (`packed_rows`), not made again by each layer's every call (made by every call, per layer, 4x256
packed bf16 rows, 2 threads, AMD EPYC, the backward's masks take 0.49 of its 3.46 ms).
"""

from __future__ import annotations

import torch


class PackedRows:
    """The packed rows of one segments tensor (B, T) for blocks of `block` queries: `starts` (B, T), the position
    where each position's example begins; per batch row and block, `first_key` (the earliest example start among
    its queries: its key tiles begin there) and `last_start` (the latest); the `runs` of batch rows whose blocks
    share one product, and each tile's `additive_mask`, made once."""

    def __init__(self, segments: torch.Tensor, block: int):
        self.starts = example_starts(segments)
        T = segments.shape[1]
        self.first_key = self.starts[:, ::block].tolist()
        self.last_start = self.starts[:, [min(s + block, T) - 1 for s in range(0, T, block)]].tolist()
        self._biases: dict[tuple, torch.Tensor] = {}
        self._runs: dict[tuple, list] = {}

    def runs(self, b: int, end: int, g0: int, g1: int, heads: int) -> list[tuple[int, int, int, int]]:
        """(r0, r1, first key, latest start) of the groups g0..g1-1 (batch row r's are r·heads..(r+1)·heads-1) for
        block b, whose queries end at `end`: consecutive batch rows share a run, its keys from the earliest of their
        first keys, while that costs fewer keys than one more tile's fixed cost (TILE_COST)."""
        key = (b, g0, g1, heads)
        if key not in self._runs:
            runs: list[tuple[int, int, int, int]] = []
            for r in range(g0 // heads, (g1 - 1) // heads + 1):
                piece = (max(g0, r * heads), min(g1, (r + 1) * heads), self.first_key[r][b], self.last_start[r][b])
                if runs:
                    r0, r1, k0, last = runs[-1]
                    merged = (piece[1] - r0) * (end - min(k0, piece[2]))
                    apart = (r1 - r0) * (end - k0) + (piece[1] - piece[0]) * (end - piece[2]) + TILE_COST
                    if merged <= apart:
                        runs[-1] = (r0, piece[1], min(k0, piece[2]), max(last, piece[3]))
                        continue
                runs.append(piece)
            self._runs[key] = runs
        return self._runs[key]

    def additive_mask(self, s: int, e: int, k0: int, k1: int, rep: int, keys_first: bool, dtype) -> torch.Tensor:
        """(B, (e-s)·rep, k1-k0), or (B, k1-k0, (e-s)·rep) keys_first: -inf where key k0 + j lies after query s + i
        or before its example, else 0; each query's row repeated for its rep heads, contiguous as the scores."""
        key = (s, k0, k1, rep, keys_first, dtype)
        if key not in self._biases:
            starts = self.starts[:, s:e].repeat_interleave(rep, dim=1)  # (B, queries·rep)
            queries = torch.arange(s, e, device=starts.device).repeat_interleave(rep)
            keys = torch.arange(k0, k1, device=starts.device)
            if keys_first:
                hidden = (starts[:, None, :] > keys[:, None]) | (keys[:, None] > queries)  # (B, keys, queries·rep)
            else:
                hidden = (starts[:, :, None] > keys) | (keys > queries[:, None])  # (B, queries·rep, keys)
            bias = torch.zeros(hidden.shape, dtype=dtype, device=starts.device)
            self._biases[key] = bias.masked_fill_(hidden, -torch.inf)
        return self._biases[key]


# a tile's fixed cost (its products' calls, the softmax's passes) in keys times groups: one product's more keys cost
# ~0.6 µs a group-key (float32 forward, 9:3 heads of 64, blocks of 32 queries, 2 AVX2 cores), its calls ~0.1 ms
TILE_COST = 160
KEPT = 2  # batches whose rows are kept: the step's (a step's layers, forward and backward, share one), the last one's
_kept: dict[tuple, PackedRows] = {}


def packed_rows(segments: torch.Tensor, block: int) -> PackedRows:
    """The PackedRows of `segments` (on the CPU) for blocks of `block` queries, found by the segment ids themselves
    (each layer gets its own tensor of the same ids), made by the first call for them; the last KEPT kept."""
    key = (tuple(segments.shape), str(segments.dtype), block, segments.contiguous().numpy().tobytes())
    rows = _kept.pop(key, None) or PackedRows(segments, block)
    _kept[key] = rows  # the most recent last
    while len(_kept) > KEPT:
        del _kept[next(iter(_kept))]
    return rows


def example_starts(segments: torch.Tensor) -> torch.Tensor:
    """(B, T): the position where each position's example (a run of equal segment ids) begins."""
    pos = torch.arange(segments.shape[1], device=segments.device).expand(segments.shape)
    new = torch.ones_like(segments, dtype=torch.bool)
    new[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return torch.where(new, pos, 0).cummax(1).values
