"""glibc's malloc told to keep the memory a CPU training step frees, instead of handing it back to the OS each step.

A step frees hundreds of MB (activations, the loss's chunks, attention tiles) and allocates it again in the next.
glibc returns the freed top of its heap to the OS once over 128 KB-64 MB (its trim threshold) and gives large blocks
their own mappings; each page of that memory is then faulted in and zeroed afresh by the kernel when used again:
18,000-40,000 page faults per bf16 step of the 4x512 bench, 38,000-125,000 per float32 one (how much glibc hands
back varies from run to run with where its heap's top lands). Settings (mallopt): blocks up to 32 MB come from the
heap (glibc's own upper bound for its adaptive threshold; larger ones keep their mappings), up to 1 GB of free heap
top is kept, and the heap grows 256 MB at a time (address space; pages count once used).
On a bench-shaped step (AMD EPYC, 2 threads) the settings take the faults per step to 10-1,100 and the step time
down 3-6% (bf16 2.62 -> 2.47 s, float32 4.49 -> 4.35 s), peak resident memory unchanged. Between steps the process
stays at its peak (a training process reaches it again next step anyway).
Other allocators (jemalloc, tcmalloc through LD_PRELOAD) or the user's own MALLOC_* settings are left alone.

fsdp on the CPU wants the opposite: each decoder block's weights are gathered whole (tens to hundreds of MB in
pieces of a few MB to tens of MB) and freed after the block, and memory kept for the next step would hold a
block's worth of freed pieces, scattered through the heap, on top of the rank's shard: the very memory fsdp is
run to save. There every block over 1 MB gets its own mapping, returned when freed, and the heap's top is
returned past 32 MB (1.1B Llama, 2 ranks: per-rank peak 4.7 GB with glibc's defaults, 3.4 GB so).
Loading is the same case (a shard read whole, weights converted or quantized one at a time), so a process loads
its model with these settings and keeps freed memory only from its first step on. A quantized base's products
leave nothing weight-sized behind either: their weights are dequantized into one reusable buffer (kernels/workspace.py).
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 256 << 20
RETURN = ((M_MMAP_THRESHOLD, 1 << 20), (M_TRIM_THRESHOLD, 32 << 20), (M_TOP_PAD, 0))
_USER_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
    "GLIBC_TUNABLES",
)


def keep_freed_memory() -> str:
    """Apply the settings (process-wide; again is harmless) if glibc allocates and nobody chose otherwise; returns
    what happened."""
    return _apply(
        ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)),
        "glibc keeps freed memory for the next step (fewer page faults)",
    )


def return_freed_memory() -> str:
    """For loading and fsdp: freed memory goes back to the OS at once, so the weight-sized pieces a step frees
    (converted or quantized weights, gathered blocks) never stay resident."""
    return _apply(RETURN, "glibc returns freed memory at once (weight-sized pieces freed do not stay resident)")


def _apply(settings, done: str) -> str:
    if platform.libc_ver()[0] != "glibc":
        return "not glibc: unchanged"
    if any(os.environ.get(name) for name in _USER_SETTINGS) or os.environ.get("LD_PRELOAD"):
        return "left to the environment (MALLOC_* settings or LD_PRELOAD)"
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: setting either one switches off glibc's adaptive thresholds
    ok = all(mallopt(option, value) == 1 for option, value in settings)
    return done if ok else "mallopt refused a setting"


def release_freed_memory() -> None:
    """Hand memory freed by the last shard back to the OS (glibc keeps it otherwise, and the
    heap of a shard-by-shard job grows shard after shard). A no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
