"""Reusable buffers for weights that live for one product: a quantized base's weight dequantized just in time on
the CPU, written a few rows at a time into one buffer per thread, dtype and device (other purposes, such as the
loss's logits, keep buffers of their own).

Dequantizing a whole weight at once allocates weight-sized temporaries (float32 first, then the compute dtype)
for every product and frees them right after. glibc then either keeps them, pieces of several sizes fragmenting
the heap a training step keeps (a 1.1B Llama on int8: 1.5 GB more resident after one step), or maps each afresh
and faults in every page of it each time. One buffer that grows to the largest weight and stays, filled in
chunks whose temporaries take a few megabytes (from pieces of the heap that every chunk reuses), does neither;
weights of up to about a million weights are dequantized whole.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch

# weights a chunk: its float32 temporaries take 2 MB each. Smaller chunks pay each kernel's fixed cost more often
# (5632 x 2048, 2-core AVX2 EPYC, float32, two runs: q4_K 45-46 ms in chunks of 2^18 weights, 36-37 of 2^19,
# 32-34 of 2^20; q6_K 30-41 / 27-37 / 23-26; int8 8.3-8.6 / 7.2-8.3 / 7.1); chunks of 2^20 sometimes left 4-12 MB
# more of the kept heap behind after a round of products
CHUNK_WEIGHTS = 1 << 19
# A weight of at most 2^20 weights is dequantized whole instead: its temporaries (4 MB in float32) come from the
# heap without fragmenting it (SmolLM2-135M's weights, 3.5 MB, kept its peak at 0.95 of an unquantized run's),
# and the fill's extra pass cost more than it saved (576 x 1536: int8 0.25 ms whole against 0.55 filled, nf4 1.6
# against 2.1).
WHOLE_WEIGHTS = 1 << 20
_local = threading.local()


def buffer(shape: tuple, dtype: torch.dtype, device: torch.device, purpose: str = "weight") -> torch.Tensor:
    """This thread's buffer for (purpose, dtype, device) as a `shape` view, grown first if smaller: valid until the
    next call with the same purpose, dtype and device on this thread."""
    buffers = _local.__dict__.setdefault("buffers", {})
    numel, key = math.prod(shape), (purpose, dtype, torch.device(device))
    if key not in buffers or buffers[key].numel() < numel:
        buffers.pop(key, None)  # the smaller one is freed before the bigger one is allocated
        buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffers[key][:numel].view(shape)


def fill_by_rows(out: torch.Tensor, rows: Callable[[int, int], torch.Tensor], transposed: bool = False) -> torch.Tensor:
    """out[r0:r1] = rows(r0, r1) over chunks of about CHUNK_WEIGHTS weights; with `transposed`, out is the
    transpose, (in, out), and gets out[:, r0:r1] = rows(r0, r1)ᵀ."""
    target = out.t() if transposed else out
    n, width = target.shape
    step = max(1, CHUNK_WEIGHTS // max(1, width))
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        target[r0:r1] = rows(r0, r1)
    return out
