"""Long sequences: step time, tokens/s and peak step memory at 2k-16k tokens, lora-llama vs transformers+peft.

Random weights with SmolLM2-135M shapes, batch 1, LoRA r=16 on q,k,v,o,gate,up,down, AdamW, loss on every
token. Four configurations, each in its own process: lora-llama as it trains by default, lora-llama with
activation checkpointing (`train.gradient_checkpointing`), transformers+peft, and transformers+peft with its
gradient checkpointing. Step memory is what the step adds to the loaded model: resident memory on the CPU
(`VmHWM` growth), torch's allocations on a GPU. A configuration that passes the budget (default 8 GB) is
stopped there and reported as over budget, not dropped. Then, doubling from 2048 up to --max-longest, the
longest length each side's leanest configuration (checkpointing) trains within the budget. The last line
printed is one JSON object with the ratios at each length and both longest lengths.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.common import ROOT, cpu_line, random_checkpoint, record, scratch_dir, status_mb
from bench.train_step import TARGETS, build, memory_mb, stepper

CONFIGS = {
    "lora-llama": ("lora-llama", False),
    "lora-llama checkpointing": ("lora-llama", True),
    "transformers+peft": ("transformers+peft", False),
    "transformers+peft checkpointing": ("transformers+peft", True),
}


def watch_budget(device: str, before: float, budget_mb: float) -> None:
    """Stop the process (exit code 3) once the step's memory passes the budget: on the CPU a thread polls the
    resident memory; on a GPU torch's allocator is capped, so the step fails with out-of-memory."""
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (before + budget_mb) * 2**20 / total))
        return

    def poll():
        while True:
            if status_mb("VmRSS") - before > budget_mb:
                print(json.dumps({"over_budget": True}), flush=True)
                os._exit(3)
            time.sleep(0.05)

    threading.Thread(target=poll, daemon=True).start()


def worker(config: str, ckpt: str, seq: int, steps: int, opts) -> dict:
    kind, checkpointing = CONFIGS[config]
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    settings = SimpleNamespace(
        checkpointing=checkpointing,
        compile=False,
        targets=",".join(TARGETS),
        precision=opts.precision,
        device=opts.device,
    )
    step = stepper(*build(kind, ckpt, settings))
    ids = torch.randint(3, 49152, (1, seq), generator=torch.Generator().manual_seed(1))
    before = memory_mb(opts.device, reset=True)
    watch_budget(opts.device, before, opts.budget_gb * 1024)
    times = []
    try:
        for _ in range(steps):
            times.append(step(ids, ids)[0])
    except torch.OutOfMemoryError:
        return {"over_budget": True}
    peak = memory_mb(opts.device, peak=True) - before
    timed = statistics.median(times[1:] or times)  # the first step warms up allocators and the optimizer state
    return {
        "step_s": timed,
        "first_step_s": times[0],
        "tokens_per_s": seq / timed,
        "step_memory_mb": peak,
        "over_budget": peak > opts.budget_gb * 1024,
    }


def run(config: str, ckpt: Path, seq: int, steps: int, a) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.long_context",
        "--worker",
        config,
        "--ckpt",
        str(ckpt),
        "--seq",
        str(seq),
        "--steps",
        str(steps),
        "--device",
        a.device,
        "--precision",
        a.precision,
        "--budget-gb",
        str(a.budget_gb),
        "--threads",
        str(a.threads),
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    )
    lines = r.stdout.strip().splitlines()
    if r.returncode == 3 or (lines and json.loads(lines[-1]).get("over_budget")):
        return {"over_budget": True}
    if r.returncode != 0:  # killed by the system for memory counts as over budget too; anything else is a failure
        if r.returncode in (-9, 137):
            return {"over_budget": True}
        sys.exit(f"{config} at {seq} failed:\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def longest(config: str, ckpt: Path, a) -> int:
    """The longest length, doubling from 2048 up to --max-longest, that trains within the budget (0: none)."""
    fits, seq = 0, 2048
    while seq <= a.max_longest:
        r = run(config, ckpt, seq, 1, a)
        print(
            f"  {config} at {seq}: " + ("over budget" if r["over_budget"] else f"{r['step_memory_mb']:.0f} MB"),
            flush=True,
        )
        if r["over_budget"]:
            break
        fits, seq = seq, seq * 2
    return fits


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument(
        "--steps", type=int, default=2, help="steps per configuration; the median of those after the first is timed"
    )
    ap.add_argument("--budget-gb", type=float, default=8.0)
    ap.add_argument("--max-longest", type=int, default=32768, help="the longest-length search stops here (0: skip it)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.ckpt, a.seq, a.steps, a)))
        return
    ckpt = random_checkpoint(scratch_dir("lora-llama-long-") / "model")
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"the CPU, {a.threads} threads"
    print(cpu_line())
    print(
        f"on {where}: batch 1, {a.precision}, LoRA r=16 on all seven linears, budget {a.budget_gb:g} GB of step memory"
    )
    print(f"{'length':>7} {'configuration':<33}{'step s':>9}{'tokens/s':>10}{'step MB':>10}")
    rows, summary = {}, {"ratios": {}}
    for seq in [int(x) for x in a.lengths.split(",") if x]:
        for config in CONFIGS:
            r = rows[seq, config] = run(config, ckpt, seq, a.steps, a)
            if r["over_budget"]:
                print(f"{seq:>7} {config:<33}{'over budget':>29}", flush=True)
            else:
                print(
                    f"{seq:>7} {config:<33}{r['step_s']:>9.2f}{r['tokens_per_s']:>10.0f}{r['step_memory_mb']:>10.0f}",
                    flush=True,
                )
        ours = [rows[seq, c] for c in CONFIGS if c.startswith("lora-llama") and not rows[seq, c]["over_budget"]]
        peer = [rows[seq, c] for c in CONFIGS if c.startswith("transformers") and not rows[seq, c]["over_budget"]]
        if ours and peer:  # each side's best: fastest configuration for speed, leanest for memory
            summary["ratios"][seq] = {
                "tokens_per_s": round(max(r["tokens_per_s"] for r in ours) / max(r["tokens_per_s"] for r in peer), 3),
                "step_memory": round(
                    min(r["step_memory_mb"] for r in ours) / min(r["step_memory_mb"] for r in peer), 3
                ),
                "default_vs_peer_default_tokens_per_s": None
                if rows[seq, "transformers+peft"]["over_budget"] or rows[seq, "lora-llama"]["over_budget"]
                else round(rows[seq, "lora-llama"]["tokens_per_s"] / rows[seq, "transformers+peft"]["tokens_per_s"], 3),
            }
    if a.max_longest:
        print(f"longest length within {a.budget_gb:g} GB (checkpointing on both sides):")
        summary["longest"] = {
            side: longest(f"{side} checkpointing", ckpt, a) for side in ("lora-llama", "transformers+peft")
        }
    summary["rows"] = {f"{seq} {config}": r for (seq, config), r in rows.items()}
    record("long_context", summary)


if __name__ == "__main__":
    main()
