"""A shipped recipe trained as a user trains it (`lora-llama train RECIPE`), timed, with what its run reports: every
held-out evaluation (the objective's own measures: DPO's reward accuracy and margin, GRPO's held-out reward, the
eval loss), the training reward or loss of each step, and its mean (and GRPO's completion length) between evals.
The pages' accounts of a recipe's run quote this line.

    python -m bench.recipe_run recipes/smollm2-dpo-cpu.yaml
    python -m bench.recipe_run recipes/smollm2-grpo-cpu.yaml

Run it alone: it measures the machine."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

from bench.common import ROOT, cpu_line, record, scratch_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="a recipe of recipes/")
    args = parser.parse_args()
    out = scratch_dir("lora-llama-recipe-run-") / "run"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "lora_llama", "train", args.recipe, f"output.dir={out}", "--force"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    seconds = round(time.perf_counter() - start, 1)
    if done.returncode:
        sys.exit(f"the recipe failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [{k: v for k, v in r.items() if k == "step" or k.startswith("eval_")} for r in rows]
    headline = "reward" if "reward" in steps[-1] else "loss"
    marks = [e["step"] for e in evals if len(e) > 1]
    spans = {  # each measure's mean over the steps between two evals (steps a+1..b)
        key: [
            round(sum(r[key] for r in steps if a < r["step"] <= b) / max(1, sum(a < r["step"] <= b for r in steps)), 4)
            for a, b in zip(marks, marks[1:])
        ]
        for key in (headline, "completions/mean_length")
        if key in steps[-1]
    }
    print(cpu_line())
    print(f"{len(steps)} steps in {seconds} s")
    for e in (e for e in evals if len(e) > 1):
        print(e)
    record(
        "recipe_run",
        {
            "precision": re.search(r"precision (\S+)", done.stdout).group(1),
            "seconds": seconds,
            "steps": len(steps),
            "step_s": round(seconds / len(steps), 2),  # evals and loading included, as a user waits
            "evals": [e for e in evals if len(e) > 1],
            headline: [round(r[headline], 4) for r in steps],
            "span_means": spans,
        },
    )


if __name__ == "__main__":
    main()
