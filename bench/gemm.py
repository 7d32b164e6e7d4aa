"""Float32 products of a LoRA step on this CPU: F.linear (MKL's sgemm) vs lora_llama.kernels.gemm.linear (oneDNN).

Shapes of SmolLM2-135M at batch 4 x 512 (2048 rows): the base projections forward (x·Wᵀ) and
their input gradients (gy·W, W passed transposed as a view), and one chunk of the loss's
vocabulary projection. Prints GFLOP/s of each and their ratio; the last line is JSON.
"""

import argparse

import torch
import torch.nn.functional as F

from bench.common import cpu_line, median_time, record
from lora_llama.kernels import gemm

SHAPES = {  # name: (rows, in, out)
    "q/o 576->576": (2048, 576, 576),
    "k/v 576->192": (2048, 576, 192),
    "gate/up 576->1536": (2048, 576, 1536),
    "down 1536->576": (2048, 1536, 576),
    "loss chunk 576->49152": (341, 576, 49152),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(2)
    if gemm._ONEDNN is None:
        raise SystemExit("this torch build has no oneDNN linear: gemm.linear is F.linear here")
    print(cpu_line())
    print(f"{'':<24}{'F.linear':>10}{'oneDNN':>10}{'ratio':>7}   GFLOP/s, 2 threads, float32")
    ratios, gflops = {}, {}
    for name, (n, k, m) in SHAPES.items():
        x, w, gy = torch.randn(n, k), torch.randn(m, k), torch.randn(n, m)
        flops = 2 * n * k * m
        for label, args in ((f"{name} x·Wᵀ", (x, w)), (f"{name} gy·W", (gy, w.t()))):
            mkl = flops / median_time(lambda: F.linear(*args), a.repeats) / 1e9
            onednn = flops / median_time(lambda: gemm.linear(*args), a.repeats) / 1e9
            ratios[label] = round(onednn / mkl, 2)
            gflops[label] = {"F.linear": round(mkl), "onednn": round(onednn)}
            print(f"{label:<24}{mkl:>10.0f}{onednn:>10.0f}{onednn / mkl:>7.2f}")
    record("gemm", {"gflops": gflops, "min_ratio": min(ratios.values()), "max_ratio": max(ratios.values())})


if __name__ == "__main__":
    main()
