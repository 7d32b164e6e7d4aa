"""bench.cpu's count of a step's useful work, by hand; a peer that does not finish."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import bench.cpu as bench_cpu
from bench.cpu_rate import useful_flops
from bench.part_rows import cpu_rows

# hidden 4, intermediate 8, 2 heads of 2 (q: 4 wide), 1 key/value head (k, v: 2 wide), vocabulary 10
CFG = dict(
    hidden_size=4, intermediate_size=8, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, vocab_size=10
)


def test_useful_flops_of_a_packed_token_by_hand():
    # frozen weights a block: q 16, k 8, v 8, o 16, gate 32, up 32, down 32 = 144; head 40
    # adapters r=2 on q and v: 6·2·(4+4) + 6·2·(4+2) = 96 + 72 = 168 a block
    assert useful_flops(CFG, 16, 2, ("q", "v"), packed=True) == 3 * (4 * 144 + 168) + 4 * 40


@pytest.mark.parametrize("share", [0.25, 1.0])
def test_the_head_and_the_last_blocks_output_side_count_at_the_target_share(share):
    # adapters r=2 on q and o: 6·2·(4+4) each, 192 a block; at target positions only: the head (40) and the last
    # block's o, gate, up, down (16 + 32 + 32 + 32 = 112) with o's adapter (96)
    by_hand = 3 * (4 * 144 + 192) - (1 - share) * (4 * 112 + 96) + 4 * 40 * share
    assert useful_flops(CFG, 16, 2, ("q", "o"), packed=True, target_share=share) == pytest.approx(by_hand, rel=1e-12)


def test_full_rows_add_causal_attention():
    # 3 x 4·d FLOPs per key seen, 4 query columns, (seq + 1) / 2 keys on average, 3 layers
    assert useful_flops(CFG, 15, 2, ()) - useful_flops(CFG, 15, 2, (), packed=True) == 3 * 3 * 4 * 4 * 8


_run = bench_cpu.run


def _kill_self(cmd, must=True):  # the peer's process, killed as the out-of-memory killer kills it
    return _run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], must)


def test_a_peer_killed_for_memory_leaves_the_row_with_ours(monkeypatch):
    monkeypatch.setattr(bench_cpu, "run", _kill_self)
    theirs = bench_cpu.peer(Path("unused"), "fp32", 2)
    assert theirs["failed"].startswith("killed (SIGKILL: out of memory")
    mine = {"tokens_per_s": 20.0, "peak_mb": 8000, "precision": "fp32"}
    row = bench_cpu.figures("1b", mine, theirs, {"layers": 1, "head": 1, "model": 100}, 1.0, 1e9)
    assert row["gemm_ratio"] == 0.2 and "tokens_per_s_ratio" not in row  # 20 tok/s · 1 GFLOP over 100 GFLOP/s
    ((what, ours, peer, ratio),) = cpu_rows({"rows": [{**row, "target_share": 0.998}]})
    assert "Llama-3.2-1B" in what and ours.startswith("20 tok/s, 8000 MB")
    assert peer.startswith("did not finish: killed (SIGKILL") and ratio == ""


def test_a_peer_that_fails_otherwise_says_its_last_line(monkeypatch):
    fail = [sys.executable, "-c", "import sys; sys.exit('ValueError: no such checkpoint')"]
    monkeypatch.setattr(bench_cpu, "run", lambda cmd, must=True: subprocess.run(fail, capture_output=True, text=True))
    assert bench_cpu.peer(Path("unused"), "fp32", 2) == {"failed": "ValueError: no such checkpoint"}
