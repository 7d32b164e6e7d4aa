"""One handler per quantized format: everything the rest of the package asks of a format, asked of its handler.

A handler knows the tensors a frozen (out, in) weight is held in (`layout`), how they are made from a float weight
(`quantize`, whole or a few rows of a checkpoint at a time: `quantize_rows`), the weight they give back
(`dequantize`), what training on it does to a weight (`roundtrip`, what `merge --onto dequantized` folds into) and
its bytes (`bytes`). Loaders, merge, export and the command line hold a handler and name no format.

    Int8(products)  one scale per output row (formats.py); products: int8 x int8 products (int8_products.py)
    NF4(double)     QLoRA's 4-bit codes in blocks of 64, their absmax optionally in 8 bits (formats.py)
    GGUFBlocks(k)   a GGUF file's own blocks of kind k, read from the file, never made here (gguf_blocks.py)
    FileBlocks()    the setting `source`: each linear keeps its GGUF file's blocks, as a GGUFBlocks of their kind

`quant_format` turns a recipe's settings (`model.quantize`, `model.nf4_double_quant`, `model.int8_products`) into
its handler.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from lora_llama.errors import UserError
from lora_llama.quant.formats import (
    DOUBLE_QUANT_BLOCK,
    NF4_BLOCK,
    dequantize_int8,
    dequantize_nf4,
    nf4_absmax,
    quantize_absmax,
    quantize_int8,
    quantize_nf4,
)
from lora_llama.quant.gguf_blocks import GGUF_FORMATS, dequantize_gguf, row_bytes
from lora_llama.quant.int8_products import PROJECTIONS
from lora_llama.quant.names import SETTINGS

Tensors = dict[str, torch.Tensor]  # a layer's quantized tensors by name: codes, scales and any others


class QuantFormat:
    """A quantized format. `name` is the layer's kind and the recipe's value."""

    name: str
    from_float = True  # made from float weights while the model loads (a GGUF's blocks are read from the file)
    keeps_file_blocks = False  # each linear takes its GGUF file's own blocks

    def layout(self, out: int, inp: int) -> dict[str, tuple[tuple, torch.dtype]]:
        """(shape, dtype) of each tensor an (out, in) weight is held in."""
        raise NotImplementedError

    def row_fault(self, inp: int) -> str | None:
        """Why a weight of `inp` columns is not held by output row (fsdp shards by row), or None."""
        return None

    def quantize(self, w: torch.Tensor) -> Tensors:
        raise UserError(f"{self.name} weights are read from a GGUF file, not made from float weights")

    def dequantize(self, t: Tensors, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def quantize_rows(self, read: Callable[[int, int], torch.Tensor], out: int, lo: int, hi: int) -> Tensors:
        """Rows lo..hi of an (out, in) weight quantized, read(lo, hi) giving its float rows: a row quantized alone
        is the row quantized with the whole weight."""
        return self.quantize(read(lo, hi))

    def by_rows(self, t: Tensors) -> Tensors:
        """The tensors with every one laid out by output row, so rows of the weight dequantize from rows of them."""
        return t

    def roundtrip(self, w: torch.Tensor) -> torch.Tensor:
        """dequant(quant(w)) in float32: the weight a model quantized so multiplies with."""
        return self.dequantize(self.quantize(w), tuple(w.shape), torch.float32)

    def bytes(self, out: int, inp: int) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.layout(out, inp).values())

    def settings(self) -> dict:
        """The recipe's model settings that choose this format."""
        return {"quantize": self.name}

    def integer_products(self, linear_name: str) -> bool:
        """Whether the decoder linear of this name multiplies its int8 codes by int8 activations (int8_products.py)."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class Int8(QuantFormat):
    name = "int8"

    def __init__(self, products: bool = False):
        self.products = products  # int8 x int8 products for the projections int8_products.py names

    def integer_products(self, linear_name: str) -> bool:
        return self.products and linear_name in PROJECTIONS

    def settings(self):
        return {"quantize": self.name, "int8_products": self.products}

    def __repr__(self) -> str:
        return f"Int8(products={self.products})"

    def layout(self, out, inp):
        return {"codes": ((out, inp), torch.int8), "scales": ((out,), torch.float32)}

    def quantize(self, w):
        return dict(zip(("codes", "scales"), quantize_int8(w)))

    def dequantize(self, t, shape, dtype):
        return dequantize_int8(t["codes"], t["scales"], dtype)


class NF4(QuantFormat):
    name = "nf4"

    def __init__(self, double_quant: bool = False):
        self.double_quant = double_quant

    def row_fault(self, inp):
        return f"in_features {inp} is not a multiple of {NF4_BLOCK}" if inp % NF4_BLOCK else None

    def layout(self, out, inp):
        n, blocks = out * inp, math.ceil(out * inp / NF4_BLOCK)
        by_row = not self.row_fault(inp)  # else flat, as quantize_nf4 lays it out
        codes, scales = ((out, inp // 2), (out, inp // NF4_BLOCK)) if by_row else (((n + 1) // 2,), (blocks,))
        if not self.double_quant:
            return {"codes": (codes, torch.uint8), "scales": (scales, torch.float32)}
        return {
            "codes": (codes, torch.uint8),
            "scales": (scales, torch.uint8),
            "absmax2": ((math.ceil(blocks / DOUBLE_QUANT_BLOCK),), torch.float32),
            "offset": ((), torch.float32),
        }

    def quantize(self, w):
        codes, absmax = quantize_nf4(w)
        if not self.double_quant:
            return {"codes": codes, "scales": absmax}
        scales, absmax2, offset = quantize_absmax(absmax)
        return {"codes": codes, "scales": scales, "absmax2": absmax2, "offset": offset}

    def quantize_rows(self, read, out, lo, hi):
        if not self.double_quant:
            return self.quantize(read(lo, hi))
        whole = self.quantize(read(0, out))  # the second-level blocks span rows
        return {**whole, "codes": whole["codes"][lo:hi].clone(), "scales": whole["scales"][lo:hi].clone()}

    def by_rows(self, t):
        return {"codes": t["codes"], "scales": nf4_absmax(t["scales"], t.get("absmax2"), t.get("offset"))}

    def dequantize(self, t, shape, dtype):
        return dequantize_nf4(t["codes"], self.by_rows(t)["scales"], shape, dtype)

    def settings(self):
        return {"quantize": self.name, "nf4_double_quant": self.double_quant}

    def __repr__(self) -> str:
        return f"NF4(double_quant={self.double_quant})"


class GGUFBlocks(QuantFormat):
    from_float = False

    def __init__(self, kind: str):
        self.name = kind

    def layout(self, out, inp):
        return {"codes": ((out, row_bytes(self.name, inp)), torch.uint8), "scales": ((0,), torch.float32)}

    def dequantize(self, t, shape, dtype):
        return dequantize_gguf(self.name, t["codes"], dtype)  # the scales live inside the blocks


class FileBlocks(QuantFormat):
    """`source`: each decoder linear keeps its GGUF file's blocks; the base's weights are those blocks
    dequantized, so a weight comes back as it is."""

    name = "source"
    from_float = False
    keeps_file_blocks = True

    def roundtrip(self, w):
        return w.float()


LAYER_FORMATS = {f.name: f for f in (Int8(), NF4(), *(GGUFBlocks(k) for k in GGUF_FORMATS))}  # by a layer's kind
BY_SETTING = {"int8": Int8, "nf4": NF4, "source": FileBlocks}


def layer_format(kind: str, tensor_names=()) -> QuantFormat:
    """The handler of a quantized layer's `kind`, given the names of the tensors the layer holds (nf4's double
    quantization shows in them)."""
    if kind not in LAYER_FORMATS:
        raise UserError(f"unknown quantized layer kind {kind!r} (one of {', '.join(LAYER_FORMATS)})")
    return NF4("absmax2" in tensor_names) if kind == NF4.name else LAYER_FORMATS[kind]


def quant_format(
    setting: str | QuantFormat | None, double_quant: bool = False, products: bool = False
) -> QuantFormat | None:
    """The handler a setting names (a handler stands for itself; None: no quantization)."""
    if setting is None or isinstance(setting, QuantFormat):
        return setting
    if setting not in SETTINGS:
        raise UserError(f"unknown quantize {setting!r} (use {' or '.join(SETTINGS)})")
    handler = BY_SETTING[setting]
    return NF4(double_quant) if handler is NF4 else Int8(products) if handler is Int8 else handler()


def chosen_format(settings) -> QuantFormat | None:
    """The handler a model section chooses: a recipe's `model`, the YAML mapping of a run's recipe, or the command
    line's --quantize and --nf4-double-quant."""
    read = settings.get if isinstance(settings, Mapping) else lambda key: getattr(settings, key, None)
    return quant_format(read("quantize"), bool(read("nf4_double_quant")), bool(read("int8_products")))


def dequantize_codes(
    kind: str,
    codes: torch.Tensor,
    scales: torch.Tensor,
    shape: tuple,
    dtype: torch.dtype,
    absmax2: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """The (out, in) = shape weight in `dtype` from a quantized layer's tensors, passed one by one as compiled code
    and custom ops take them (absmax2 and offset: nf4's double quantization)."""
    t = {"codes": codes, "scales": scales}
    if absmax2 is not None:
        t.update(absmax2=absmax2, offset=offset)
    return layer_format(kind).dequantize(t, shape, dtype)
