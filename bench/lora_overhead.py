"""Forward latency of the base model, LoRA unmerged and LoRA merged (r=8 on q,k,v,o), one run.

SmolLM2-135M shapes, random weights, float32, 2 threads. Ratios are to the base model.
Targets: merged / base = 1.00 ± 0.03, unmerged / base ≤ 1.10.
"""

import argparse
import statistics

import torch

from bench.common import cpu_line, median_time, random_checkpoint, record
from lora_llama import LoraSettings, apply_lora, load_model
from lora_llama.lora.adapted import lora_modules


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    folder = random_checkpoint()
    model = load_model(folder)
    x = torch.randint(3, 49152, (a.batch, a.seq))
    adapted = load_model(folder)
    apply_lora(adapted, LoraSettings(r=8, alpha=16, targets=["q", "k", "v", "o"]))
    for m in lora_modules(adapted).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.01)
    merged_model = load_model(folder)
    apply_lora(merged_model, LoraSettings(r=8, alpha=16, targets=["q", "k", "v", "o"]))
    for m in lora_modules(merged_model).values():
        m.merge()
    # rounds interleave the three variants, so drift of the machine hits all of them alike
    times = {"base": [], "unmerged": [], "merged": []}
    for _ in range(a.repeat):
        for name, m in (("base", model), ("unmerged", adapted), ("merged", merged_model)):
            times[name].append(median_time(lambda: m(x), 1, warmup=0 if times[name] else 1))
    base, unmerged, merged = (statistics.median(times[k]) for k in ("base", "unmerged", "merged"))
    print(cpu_line())
    print(f"{'variant':<12}{'ms':>10}{'ratio':>8}")
    for name, t in (("base", base), ("unmerged", unmerged), ("merged", merged)):
        print(f"{name:<12}{t * 1e3:>10.1f}{t / base:>8.3f}")
    record(
        "lora_overhead",
        {
            "forward_ms": {
                "base": round(base * 1e3, 1),
                "unmerged": round(unmerged * 1e3, 1),
                "merged": round(merged * 1e3, 1),
            },
            "unmerged_ratio": round(unmerged / base, 3),
            "merged_ratio": round(merged / base, 3),
        },
    )


if __name__ == "__main__":
    main()
