"""The adapter variants on the embedded data: `lora-llama train` on the default recipe for --steps steps each, plain
LoRA, DoRA, PiSSA (pissa_niter_4) and LoRA+ (ratio 4): the held-out eval loss at the start and at the end,
and the peak memory; each in its own process, one run (speed: bench/dora.py). The figures go to
bench/results/variants.jsonl.
"""

import argparse

from bench.common import cpu_line, record, scratch_dir

VARIANTS = {
    "lora": [],
    "dora": ["lora.use_dora=true"],
    "pissa": ["lora.init_lora_weights=pissa_niter_4"],
    "loraplus": ["train.loraplus_lr_ratio=4"],
}


def main():
    from bench.quant import train

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--precision", default="fp32", choices=["auto", "fp32", "bf16-mixed"])
    a = ap.parse_args()
    a.device = "cpu"
    tmp = scratch_dir("lora-llama-variants-")
    runs = {}
    for name, overrides in VARIANTS.items():
        run = train("none", tmp / name, a, [*overrides, f"train.eval_every={a.steps}"])
        runs[name] = {
            "eval_loss_start": run["eval_loss_step_0"],
            "eval_loss": run["eval_loss_end"],
            "peak_mb": round(run["peak_mb"]),
        }
    print(cpu_line())
    print(f"default recipe, {a.steps} steps, {a.precision}")
    print(f"{'':<10}{'eval loss start':>16}{'end':>8}{'peak MB':>9}")
    for name, r in runs.items():
        print(f"{name:<10}{r['eval_loss_start']:>16.4f}{r['eval_loss']:>8.4f}{r['peak_mb']:>9}")
    record("variants", {"runs": runs})


if __name__ == "__main__":
    main()
