"""What bf16-mixed gives on this CPU: the default recipe (`recipes/smollm2-chat-cpu.yaml`) trained through `lora-llama
train` in fp32 and in bf16-mixed, one after the other in one run, with each one's time, tokens/s and held-out loss
before and after; the ratios of bf16-mixed to fp32. On a CPU without native bf16 the bf16 run is emulated (slow).

    python -m bench.precision [--steps 40]

Run it alone: it measures the machine."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from bench.common import ROOT, cpu_line, record, scratch_dir

RECIPE = "recipes/smollm2-chat-cpu.yaml"


def trained(precision: str, steps: int) -> dict:
    out = scratch_dir("lora-llama-precision-") / precision
    args = ["train", RECIPE, f"train.precision={precision}", f"train.max_steps={steps}", f"output.dir={out}"]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lora_llama", *args], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{precision} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 2]  # past the first steps
    return {
        "seconds": round(seconds, 1),
        "tokens_per_s": round(statistics.median(speeds), 1),
        "first_loss": round(next(r["loss"] for r in rows if "loss" in r), 4),
        "eval_loss": {"base": round(result["eval_loss_start"], 4), "adapter": round(result["eval_loss"], 4)},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="the recipe's own 40 by default")
    args = parser.parse_args()
    runs = {precision: trained(precision, args.steps) for precision in ("fp32", "bf16-mixed")}
    fp32, bf16 = runs["fp32"], runs["bf16-mixed"]
    print(cpu_line())
    record(
        "precision",
        {
            "runs": runs,
            "tokens_per_s_ratio": round(bf16["tokens_per_s"] / fp32["tokens_per_s"], 3),
            "eval_loss_rel_diff": round(abs(bf16["eval_loss"]["adapter"] / fp32["eval_loss"]["adapter"] - 1), 4),
            "first_loss_diff": round(abs(bf16["first_loss"] - fp32["first_loss"]), 4),
        },
    )


if __name__ == "__main__":
    main()
