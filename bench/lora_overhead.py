"""Forward latency of the base model, LoRA unmerged and LoRA merged (r=8 on q,k,v,o), one run.

SmolLM2-135M shapes, random weights, float32, 2 threads. Ratios are to the base model.
Targets: merged / base = 1.00 ± 0.03, unmerged / base ≤ 1.10.
"""
import argparse
import json

import torch

from common import median_time, random_checkpoint

from lora_llama import LoraSettings, apply_lora, load_model
from lora_llama.lora import lora_modules


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
    base = median_time(lambda: model(x), a.repeat)
    apply_lora(model, LoraSettings(r=8, alpha=16, targets=["q", "k", "v", "o"]))
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.01)
    unmerged = median_time(lambda: model(x), a.repeat)
    for m in lora_modules(model).values():
        m.merge()
    merged = median_time(lambda: model(x), a.repeat)
    print(f"{'variant':<12}{'ms':>10}{'ratio':>8}")
    for name, t in (("base", base), ("unmerged", unmerged), ("merged", merged)):
        print(f"{name:<12}{t * 1e3:>10.1f}{t / base:>8.3f}")
    print(json.dumps({"unmerged_ratio": round(unmerged / base, 3), "merged_ratio": round(merged / base, 3)}))


if __name__ == "__main__":
    main()
