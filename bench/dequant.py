"""What holding a frozen linear quantized costs each product: the time to dequantize its weight just in time,
per format, against the product it serves.

One 2048 -> 5632 weight (the 1.1B Llama's gate / up projection): int8 and nf4 (with and without double
quantization) quantized from a random one, and each GGUF block format `quantize: source` keeps, as random blocks
(K formats as random super-blocks of finite factors). For each, the median time of what a layer runs to get its
weight in the compute dtype for a product, and its share of one product x·Wᵀ at 128 and 2048 rows of tokens,
beside the eager kernels dequantizing the whole weight into fresh memory. On the CPU a layer writes the weight a
few rows at a time into its thread's reusable buffer (QuantizedLinear.transient_weight), under the malloc settings
of a CPU training process; with --device cuda bitsandbytes' kernel for nf4 and the compiled kernel for the formats
in quant.COMPILED_ON_CUDA, and the compiled kernel of every format is timed too. The last line is JSON, also appended
to bench/results/dequant.jsonl.
"""

import argparse

import torch

from bench.common import cpu_line, median_time, record
from lora_llama.kernels.gemm import linear
from lora_llama.quant import linear as quant
from lora_llama.runtime.allocator import keep_freed_memory
from tests.helpers import quantized_layers

IN, OUT = 2048, 5632
ROWS = (128, 2048)


def timed(fn, device: str, repeats: int) -> float:
    """Median milliseconds of fn(), the device's queue drained inside each timing."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return median_time(lambda: (fn(), sync()), repeats, warmup=2) * 1e3


def dequantize_ms(layers: dict, dtype, device: str, repeats: int, formula) -> dict:
    """Median milliseconds of formula(*layer.dequantize_args(dtype)) per layer."""
    return {
        name: round(timed(lambda: formula(*layer.dequantize_args(dtype)), device, repeats), 3)
        for name, layer in layers.items()
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the compute dtype")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(2)
    keep_freed_memory()  # as a CPU training process does
    dtype, dev = getattr(torch, a.dtype), a.device
    print(cpu_line())
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)).to(dev) * 0.02
    product_ms = {}
    for n in ROWS:
        x, wd = torch.randn(n, IN, dtype=dtype, device=dev), w.to(dtype)
        product_ms[n] = timed(lambda: linear(x, wd), dev, a.repeats)
    print(f"product x·Wᵀ in {a.dtype} on {dev}: " + ", ".join(f"{n} rows {ms:.2f} ms" for n, ms in product_ms.items()))
    layers = {name: layer.to(dev) for name, layer in quantized_layers(OUT, IN).items()}
    eager_ms = dequantize_ms(layers, dtype, dev, a.repeats, quant.dequantize_codes)
    # every format's compiled kernel, on a GPU
    compiled_ms = dequantize_ms(layers, dtype, dev, a.repeats, quant._dequantize_compiled) if dev == "cuda" else {}
    # what a layer runs: on the CPU the weight written a few rows at a time into the reusable buffer; on CUDA
    # bitsandbytes' kernel for nf4, the compiled one for the formats of quant.COMPILED_ON_CUDA, else the eager chain
    dequant_ms = {
        name: round(timed(lambda: layer.transient_weight(dtype), dev, a.repeats), 3) for name, layer in layers.items()
    }
    print(
        f"{'format':<10}{'a layer ms':>12}{'whole eager':>13}{'compiled':>10}"
        + "".join(f"{f'/ {n}-row product':>18}" for n in ROWS)
    )
    for kind, ms in dequant_ms.items():
        print(
            f"{kind:<10}{ms:>12.3f}{eager_ms[kind]:>13.3f}{compiled_ms.get(kind, 0):>10.3f}"
            + "".join(f"{ms / product_ms[n]:>18.3f}" for n in ROWS)
        )
    record(
        "dequant",
        {
            "dtype": a.dtype,
            "device": dev,
            "shape": [OUT, IN],
            "product_ms": {str(n): round(ms, 3) for n, ms in product_ms.items()},
            "dequantize_ms": dequant_ms,
            "eager_dequantize_ms": eager_ms,
            **({"compiled_dequantize_ms": compiled_ms} if compiled_ms else {}),
        },
    )


if __name__ == "__main__":
    main()
