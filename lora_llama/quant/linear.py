"""Frozen base linears held in 8 or 4 bits, weight-only: activations are never quantized.

    int8, nf4  as bitsandbytes lays them out (formats.py)
    source  a GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), kept byte for byte as
          the file has them, in rows of blocks (gguf_blocks.py)

A `QuantizedLinear` keeps its codes and scales as plain buffers, so they move between devices, save to
safetensors and shard on dim 0 like any tensor. Its weight is dequantized just in time, in the input's
dtype, for each product: in forward, and again in backward for the input gradient, so nothing but the input
is saved for backward. On the CPU a big weight is written into one reusable buffer (kernels/workspace.py), so no
product allocates weight-sized memory; on CUDA each weight is one kernel where one exists (bitsandbytes' own for
nf4, compiled formulas for the K formats). Inside a torch.compile'd block the product is one opaque op. The
model is quantized while it loads, one shard at a time, so the full-precision model never exists.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lora_llama.kernels import fused, workspace
from lora_llama.kernels.gemm import copies_transposed, linear
from lora_llama.model.config import BLOCK_LINEARS, LINEAR_NAMES
from lora_llama.quant import int8_products
from lora_llama.quant.formats import bitsandbytes_dequantize_4bit, nf4_absmax, nf4_by_bitsandbytes
from lora_llama.quant.handlers import QuantFormat, dequantize_codes, layer_format, quant_format

DECODER_LINEARS = tuple(LINEAR_NAMES[t] for t in BLOCK_LINEARS)  # q_proj ... down_proj


# On CUDA the eager dequantization is a chain of kernels, each a pass over weight-sized float32 memory; inductor
# fuses a format into one Triton kernel that reads the codes once and writes the weight in the product's dtype.
# That wins for these formats (H100, bf16, a 5632 x 2048 weight, `python -m bench.dequant --device cuda`): q4_K
# 0.19 against 0.71 ms eager, q5_K 0.15 / 0.51, q6_K 0.18 / 0.29, q5_0 0.24 / 0.30, and int8 0.11 / 0.12 without
# its float32 temporary. The others were no faster compiled (nf4's table lookup three times slower; bitsandbytes'
# kernel serves nf4), and the CPU keeps its eager kernels: inductor's C++ loops were faster for some formats and
# slower for others.
COMPILED_ON_CUDA = frozenset({"int8", "q4_k", "q5_k", "q6_k", "q5_0"})
_dequantize_compiled = fused.compiled(
    dequantize_codes, slower="quantized bases dequantize slower on the GPU", graphs=64, dynamic=True
)


# ---------------------------------------------------------------------------- the layer


class QuantizedLinear(nn.Module):
    """A frozen linear y = x·dequant(W)ᵀ + b whose weight is held as int8 or nf4 codes and float32 scales."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kind: str,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        layer_format(kind)
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.integer_products = False  # int8 x int8 products (int8_products.py), set for the projections that take them

    @classmethod
    def from_tensors(cls, in_features: int, out_features: int, kind: str, tensors: dict, bias=None):
        """A layer over a format's tensors: codes and scales, and any others (nf4's second level) as buffers."""
        q = cls(in_features, out_features, kind, tensors["codes"], tensors["scales"], bias)
        for name, t in tensors.items():
            if name not in ("codes", "scales"):
                q.register_buffer(name, t)
        return q

    @classmethod
    def from_linear(cls, layer: nn.Linear, fmt: QuantFormat | str) -> "QuantizedLinear":
        fmt = quant_format(fmt)
        bias = layer.bias.detach() if layer.bias is not None else None
        tensors = fmt.quantize(layer.weight.detach())
        return cls.from_tensors(layer.in_features, layer.out_features, fmt.name, tensors, bias)

    def quant_format(self) -> QuantFormat:
        return layer_format(self.kind, self._buffers.keys() | self._parameters.keys())

    @property
    def weight(self) -> torch.Tensor:
        """The codes: not a float tensor, so nothing mistakes them for a weight to merge into or train."""
        return self.codes

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The (out, in) weight in `dtype`, computed afresh."""
        return dequantize_weight(self.dequantize_args(dtype))

    def dequantize_args(self, dtype: torch.dtype) -> tuple:
        """The arguments of `dequantize_codes` for this layer's weight in `dtype`."""
        return (
            self.kind,
            self.codes,
            self.scales,
            (self.out_features, self.in_features),
            dtype,
            getattr(self, "absmax2", None),
            getattr(self, "offset", None),
        )

    def transient_weight(self, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
        return transient_weight(self.dequantize_args(dtype), transposed)

    def runs_integer_products(self, x: torch.Tensor) -> bool:
        """Whether x meets this layer's int8 codes in int8 products (set for it, bf16 on the CPU)."""
        return self.integer_products and int8_products.applies(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if self.runs_integer_products(x):
            return int8_products.int8_linear(x, self.codes, self.scales, bias)
        if torch.compiler.is_compiling():  # one opaque op in the graph: nothing weight-sized saved for backward
            kind, codes, scales, _, _, absmax2, offset = self.dequantize_args(x.dtype)
            return dequantized_linear(
                x, codes, scales, absmax2, offset, bias, kind, self.out_features, self.in_features
            )
        return _QuantizedProduct.apply(x, self, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


class _QuantizedProduct(torch.autograd.Function):
    """x·dequant(W)ᵀ + b: the weight dequantized for the forward product and again for the input gradient."""

    @staticmethod
    def forward(ctx, x, layer, bias):
        ctx.layer = layer
        return linear(x, layer.transient_weight(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return linear(grad, ctx.layer.transient_weight(grad.dtype, transposed=True)), None, None


def dequantize_weight(args: tuple) -> torch.Tensor:
    """The weight `dequantize_args` describes, computed afresh: on CUDA nf4 in bitsandbytes' one kernel (its own
    format) where it is installed, the formats of COMPILED_ON_CUDA in one compiled kernel, the rest eager."""
    kind, codes, scales, shape, dtype, absmax2, offset = args
    if codes.is_cuda and kind == "nf4" and bitsandbytes_dequantize_4bit() is not None:
        return nf4_by_bitsandbytes(codes, nf4_absmax(scales, absmax2, offset), shape, dtype)
    compiled = kind in COMPILED_ON_CUDA and codes.is_cuda and fused.compiling()
    return (_dequantize_compiled if compiled else dequantize_codes)(*args)


def transient_weight(args: tuple, transposed: bool = False) -> torch.Tensor:
    """The weight `dequantize_args` describes (or, for gy·W, its transpose) for one product. On the CPU it is written
    a few rows at a time into this thread's reusable buffer (kernels/workspace.py), valid until the next transient
    weight, and a transpose is written row-major where `linear` would copy it so. Elsewhere (a GPU's caching allocator
    reuses memory itself), for small weights and for nf4 laid out flat, it is a fresh tensor."""
    kind, codes, scales, shape, dtype, absmax2, offset = args
    if (
        codes.device.type != "cpu"
        or codes.dim() != 2
        or torch.compiler.is_compiling()
        or shape[0] * shape[1] <= workspace.WHOLE_WEIGHTS
    ):
        w = dequantize_weight(args)
        return w.t() if transposed else w
    scales = nf4_absmax(scales, absmax2, offset)  # one value a block of 64: small; other formats' scales as they are

    def rows(r0, r1):
        return dequantize_codes(kind, codes[r0:r1], scales[r0:r1], (r1 - r0, shape[1]), dtype)

    row_major_t = transposed and copies_transposed(dtype, codes.device)
    out = workspace.buffer(shape[::-1] if row_major_t else shape, dtype, codes.device)
    workspace.fill_by_rows(out, rows, row_major_t)
    return out.t() if transposed and not row_major_t else out


# _QuantizedProduct as an op that torch.compile keeps whole (an autograd Function holding a module would break the
# graph; traced, the dequantized weight would be saved for backward, a weight-sized tensor per layer)
@torch.library.custom_op("lora_llama::dequantized_linear", mutates_args=())
def dequantized_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    absmax2: torch.Tensor | None,
    offset: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    out_features: int,
    in_features: int,
    transposed: bool = False,
) -> torch.Tensor:
    """x·Wᵀ + b, or with `transposed` x·W (the input gradient), W dequantized for this product only."""
    args = (kind, codes, scales, (out_features, in_features), x.dtype, absmax2, offset)
    return linear(x, transient_weight(args, transposed), bias)


@dequantized_linear.register_fake
def _(x, codes, scales, absmax2, offset, bias, kind, out_features, in_features, transposed=False):
    return x.new_empty((*x.shape[:-1], in_features if transposed else out_features))


def _save_codes(ctx, inputs, output):
    x, codes, scales, absmax2, offset, bias, kind, out_features, in_features, _ = inputs
    ctx.save_for_backward(codes, scales, absmax2, offset)
    ctx.layout = (kind, out_features, in_features)


def _input_gradient(ctx, grad):
    gx = dequantized_linear(grad, *ctx.saved_tensors, None, *ctx.layout, True) if ctx.needs_input_grad[0] else None
    return gx, None, None, None, None, None, None, None, None, None


dequantized_linear.register_autograd(_input_gradient, setup_context=_save_codes)


def shardable(layer: QuantizedLinear) -> None:
    """Hold the codes and scales laid out by output row as frozen parameters: FSDP2 shards parameters only."""
    for name in ("codes", "scales"):
        t = layer._buffers.get(name)
        if t is not None and t.dim() and t.shape[0] == layer.out_features:
            del layer._buffers[name]
            layer.register_parameter(name, nn.Parameter(t, requires_grad=False))


# ---------------------------------------------------------------------------- the model


def quantize_loaded_linears(model, fmt: QuantFormat) -> None:
    """Replace every decoder linear whose weight has been loaded (is no longer on `meta`) by its quantized copy in
    `fmt`; an adapted one keeps its adapter and gets its frozen base quantized."""
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp, getattr(block.mlp, "shared_expert", block.mlp)):
            for name in DECODER_LINEARS:
                holder, attr, lin = parent, name, getattr(parent, name, None)
                if hasattr(lin, "base_layer"):
                    holder, attr, lin = lin, "base_layer", lin.base_layer
                if (
                    type(lin) is nn.Linear
                    and lin.weight.device.type != "meta"
                    and (lin.bias is None or lin.bias.device.type != "meta")
                ):
                    quantized = QuantizedLinear.from_linear(lin, fmt)
                    quantized.integer_products = fmt.integer_products(name)
                    setattr(holder, attr, quantized)


def tensor_bytes(module: nn.Module) -> int:
    """Bytes a module holds in its own parameters and buffers (codes and scales, for a quantized layer)."""
    own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in own)


def base_weight_bytes(model, decoder_linears_only: bool = False) -> int:
    """Bytes held by the frozen base weights (LoRA A/B excluded); a tied weight is counted once."""
    seen, total = set(), 0
    for name, module in model.named_modules():
        w = module._parameters.get("weight", module._buffers.get("codes", module._parameters.get("down_proj")))
        if w is None or "lora_" in name or id(w) in seen:
            continue
        last = name.removesuffix(".base_layer").rsplit(".", 1)[-1]
        if decoder_linears_only and last not in DECODER_LINEARS and last != "experts" and not last.isdigit():
            continue
        seen.add(id(w))
        total += tensor_bytes(module)
    return total
