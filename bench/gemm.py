"""Float32 products of a LoRA step on this CPU: F.linear (MKL's sgemm) vs lora_llama.kernels.gemm.linear (oneDNN).

Shapes of SmolLM2-135M at batch 4 x 512 (2048 rows): the base projections forward (x·Wᵀ) and
their input gradients (gy·W, W passed transposed as a view), and one chunk of the loss's
vocabulary projection. Prints GFLOP/s of each and their ratio; the last line is JSON.

--int8: what int8 x int8 products would give a frozen int8 base in a bf16 step, forward x·Wᵀ at the shapes of
SmolLM2-135M and Llama-3.2-1B (2048 rows): the bf16 product (oneDNN), torch._int_mm on int8 operands alone, and the
whole int8 product as a training step would run it: the activations quantized per row on the fly (absmax / 127),
the int8 product, the int32 sums scaled back to bf16 by both scales (lora_llama.quant.int8_products.product, the
quantization and the scaling each one compiled loop).
"""

import argparse

import torch
import torch.nn.functional as F

from bench.common import cpu_line, median_time, record
from lora_llama.kernels import gemm
from lora_llama.quant import int8_products
from lora_llama.quant.formats import quantize_int8

SHAPES = {  # name: (rows, in, out)
    "q/o 576->576": (2048, 576, 576),
    "k/v 576->192": (2048, 576, 192),
    "gate/up 576->1536": (2048, 576, 1536),
    "down 1536->576": (2048, 1536, 576),
    "loss chunk 576->49152": (341, 576, 49152),
}


INT8_SHAPES = {  # name: (rows, in, out)
    "135M gate/up 576->1536": (2048, 576, 1536),
    "135M down 1536->576": (2048, 1536, 576),
    "1B gate/up 2048->8192": (2048, 2048, 8192),
    "1B down 8192->2048": (2048, 8192, 2048),
}


def int8_rates(repeats: int) -> None:
    print(f"{'':<26}{'bf16':>8}{'int8 mm':>9}{'int8 step':>11}   GFLOP/s, 2 threads")
    rates = {}
    for name, (n, k, m) in INT8_SHAPES.items():
        x, w = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(m, k, dtype=torch.bfloat16)
        w_codes, w_scale = quantize_int8(w.float())  # the int8 base's codes and row scales
        x_codes, _ = quantize_int8(x.float())  # int8 operands alone: rows quantized the same way
        flops = 2 * n * k * m

        def whole():  # what a gate or up projection with model.int8_products runs
            return int8_products.product(x, w_codes, w_scale)

        rates[name] = {
            "bf16": round(flops / median_time(lambda: gemm.linear(x, w), repeats) / 1e9),
            "int8_mm": round(flops / median_time(lambda: torch._int_mm(x_codes, w_codes.t()), repeats) / 1e9),
            "int8_step": round(flops / median_time(whole, repeats) / 1e9),
        }
        print(f"{name:<26}" + "".join(f"{v:>9}" for v in rates[name].values()))
    ratios = [v["int8_step"] / v["bf16"] for v in rates.values()]
    record("gemm", {"int8": rates, "min_ratio": round(min(ratios), 2), "max_ratio": round(max(ratios), 2)})


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--int8", action="store_true", help="int8 x int8 products against bf16 ones")
    a = ap.parse_args()
    torch.set_num_threads(2)
    if a.int8:
        print(cpu_line())
        return int8_rates(a.repeats)
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
