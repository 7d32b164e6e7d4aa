"""The CPU training step and decoding of two trees of the repository, timed alternately in one run: a change to
the package is checked for speed against the tree before it (`--before REV`, the working tree after it).

Each tree runs its own bench code on the same random model (SmolLM2-135M shapes, float32, LoRA r=16 on all seven
linears) in processes of its own, `--repeat` times, before and after alternating so that the machine's drift
falls on both: bench.train_step's lora-llama step (4 x 512 tokens, median of 10 steps), and decoding with the
growing cache (the CPU's path): `generate` on one prompt and `sample_completions` on 8 rows, 64 seeded tokens
each. The medians' ratios after / before go to bench/results/trees.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT, cpu_line, random_checkpoint, record, scratch_dir

DECODE = """
import json, sys, time, torch
from lora_llama import LoraSettings, apply_lora, load_model
try:
    from lora_llama.model.generate import sample_completions
except ImportError:
    from lora_llama.model.sampling import sample_completions
from lora_llama.model.generate import generate
torch.set_num_threads(2)
model = load_model(sys.argv[1])
apply_lora(model, LoraSettings(r=16, alpha=32, targets=["q", "k", "v", "o", "gate", "up", "down"]))
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 1000, (64,), generator=g).tolist() for _ in range(8)]
def best(work):
    work()
    times = []
    for _ in range(3):
        t = time.perf_counter(); work(); times.append(time.perf_counter() - t)
    return min(times)
one = best(lambda: generate(model, prompts[0], 64, temperature=1.0, seed=0, static=False))
rows = best(lambda: sample_completions(model, prompts, 64, [], 0, 1.0, seeds=list(range(8)), static=False))
print(json.dumps({"generate_tokens_per_s": 64 / one, "rows_tokens_per_s": 8 * 64 / rows}))
"""


def run(tree: Path, cmd: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, *cmd], cwd=tree, capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"{tree}: {' '.join(cmd[:3])} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(tree: Path, ckpt: Path, batches: Path) -> dict:
    step = run(
        tree,
        [
            "-m",
            "bench.train_step",
            "--worker",
            "lora-llama",
            "--ckpt",
            str(ckpt),
            "--batches",
            str(batches),
            "--targets",
            "q,k,v,o,gate,up,down",
            "--precision",
            "fp32",
            "--device",
            "cpu",
        ],
    )
    return {"step_s": step["median_step_s"], **run(tree, ["-c", DECODE, str(ckpt)])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the revision to compare the working tree with")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    tmp = scratch_dir("lora-llama-trees-")
    before = tmp / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(before), a.before], cwd=ROOT, check=True)
    try:
        from bench.train_step import make_batches

        ckpt = random_checkpoint(tmp / "model")
        make_batches(tmp / "batches.pt", 12, 4, 512)
        runs = {"before": [], "after": []}
        for _ in range(a.repeat):
            for name, tree in (("before", before), ("after", ROOT)):
                runs[name].append(measure(tree, ckpt, tmp / "batches.pt"))
                print(name, runs[name][-1], flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT)
    medians = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    ratios = {k: medians["after"][k] / medians["before"][k] for k in medians["after"]}
    print(cpu_line())
    for k, v in ratios.items():
        print(f"{k}: after / before {v:.3f}")
    record("trees", {"before": a.before, **medians, "after_over_before": ratios})


if __name__ == "__main__":
    main()
