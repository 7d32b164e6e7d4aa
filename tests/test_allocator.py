"""allocator: a step's freed memory is reused without page faults (keep_freed_memory), or handed back at once
under fsdp (return_freed_memory); the user's settings win.
Each case runs in a fresh Python: the settings are process-wide."""

import platform

import pytest

from helpers import fresh_python

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")

# what a step does to the heap: 40 blocks of 8 MB (activations) allocated, then all freed, four times; the page
# faults of the last two rounds are counted (the first rounds map the memory in, with or without the settings).
# glibc's adaptive default hands the freed memory back in some runs and not in others (it depends on where the
# heap's top lands), so each run starts from it set to hand memory back at once, as it does in the bad case
STEPS = r"""
import ctypes, json, resource, sys, torch
from lora_llama.runtime.allocator import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, keep_freed_memory
ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 1 << 20)
ctypes.CDLL(None).mallopt(M_TRIM_THRESHOLD, 128 << 10)
said = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(4):
    if step == 2:
        start = faults()
    blocks = [torch.ones(2 << 20) for _ in range(40)]
    del blocks
print(json.dumps({"said": said, "faults": faults() - start}))
"""
PAGES = 2 * 40 * (8 << 20) // 4096  # pages the two counted rounds touch


def run_steps(mode: str, **env) -> dict:
    return fresh_python(STEPS, mode, env=env)


def test_freed_memory_is_reused_without_page_faults():
    handed_back, kept = run_steps("without"), run_steps("keep")
    assert handed_back["faults"] > PAGES // 2  # memory handed back: each step faults it in again
    assert kept["said"].startswith("glibc keeps freed memory")
    assert kept["faults"] < PAGES // 50


def test_the_users_malloc_settings_are_left_alone():
    kept = run_steps("keep", MALLOC_TRIM_THRESHOLD_="131072")
    assert kept["said"] == "left to the environment (MALLOC_* settings or LD_PRELOAD)"
    assert kept["faults"] > PAGES // 2  # nothing was changed


# a block's gathered weights under fsdp: 40 pieces of 12 MB, all freed after the block
GATHER = r"""
import json, sys, torch
from lora_llama.runtime.allocator import keep_freed_memory, return_freed_memory
said = (return_freed_memory if sys.argv[1] == "return" else keep_freed_memory)()
rss = lambda: int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) // 1024
before = rss()
blocks = [torch.ones(3 << 20) for _ in range(40)]
del blocks
print(json.dumps({"said": said, "kept_mb": rss() - before}))
"""


def test_fsdp_settings_hand_freed_memory_back_at_once():
    returned, kept = fresh_python(GATHER, "return"), fresh_python(GATHER, "keep")
    assert returned["said"].startswith("glibc returns freed memory") and returned["kept_mb"] < 40
    assert kept["kept_mb"] > 300  # what the one-process settings would hold on to under fsdp
