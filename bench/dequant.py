"""What holding a frozen linear quantized costs each product: the time to dequantize its weight just in time,
per format, against the product it serves.

One 2048 -> 5632 weight (the 1.1B Llama's gate / up projection): int8 and nf4 (with and without double
quantization) quantized from it, and each GGUF block format `quantize: source` keeps, as random blocks (K
formats as random super-blocks of finite factors). For each, the median time of QuantizedLinear.dequantize
into the compute dtype, and its share of one product x·Wᵀ at 128 and 2048 rows of tokens, under the malloc
settings of a CPU training process (a float32 weight over 32 MB still gets its own mapping, faulted in afresh
each time). The last line is JSON, also appended to bench/results/dequant.jsonl.
"""
import argparse

import numpy as np
import torch

from bench.common import cpu_line, median_time, record
from lora_llama.allocator import keep_freed_memory
from lora_llama.gemm import linear
from lora_llama.gguf_blocks import GGUF_FORMATS
from lora_llama.quant import QuantizedLinear

IN, OUT = 2048, 5632
ROWS = (128, 2048)


def gguf_layer(kind: str) -> QuantizedLinear:
    from tests.helpers import random_blocks

    blocks = np.ascontiguousarray(random_blocks(kind.upper(), OUT, IN))
    return QuantizedLinear(IN, OUT, kind, torch.from_numpy(blocks), torch.empty(0))


def layers(w: torch.Tensor) -> dict:
    lin = torch.nn.Linear(IN, OUT, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    out = {"int8": QuantizedLinear.from_linear(lin, "int8"), "nf4": QuantizedLinear.from_linear(lin, "nf4"),
           "nf4 double quant": QuantizedLinear.from_linear(lin, "nf4", double_quant=True)}
    return out | {kind: gguf_layer(kind) for kind in GGUF_FORMATS}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the compute dtype")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(2)
    keep_freed_memory()  # as a CPU training process does
    dtype = getattr(torch, a.dtype)
    print(cpu_line())
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)) * 0.02
    product_ms = {}
    for n in ROWS:
        x, wd = torch.randn(n, IN, dtype=dtype), w.to(dtype)
        product_ms[n] = median_time(lambda: linear(x, wd), a.repeats) * 1e3
    print(f"product x·Wᵀ in {a.dtype}: " + ", ".join(f"{n} rows {ms:.1f} ms" for n, ms in product_ms.items()))
    print(f"{'format':<18}{'dequantize ms':>14}" + "".join(f"{f'/ {n}-row product':>18}" for n in ROWS))
    dequant_ms = {}
    for kind, layer in layers(w).items():
        dequant_ms[kind] = round(median_time(lambda: layer.dequantize(dtype), a.repeats) * 1e3, 2)
        print(f"{kind:<18}{dequant_ms[kind]:>14.2f}" + "".join(f"{dequant_ms[kind] / product_ms[n]:>18.2f}" for n in ROWS))
    record("dequant", {"dtype": a.dtype, "shape": [OUT, IN], "product_ms": {str(n): round(ms, 2) for n, ms in product_ms.items()},
                       "dequantize_ms": dequant_ms})


if __name__ == "__main__":
    main()
