"""Frozen base linears held in 8 or 4 bits, weight-only: activations are never quantized.

    int8  one scale per output row: scale = absmax(row) / 127, q = round(w / scale) in [-127, 127]
    nf4   QLoRA's NormalFloat-4 codebook (bitsandbytes' 16 values), blocks of 64 consecutive weights in
          row-major order with one float32 absmax each; two codes a byte, the first in the high nibble.
          With double quantization the absmax values, less their mean, are stored in 8 bits (bitsandbytes'
          dynamic map) in blocks of 256 with one float32 absmax each, as QLoRA does
    source  a GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), kept byte for byte as
          the file has them, in rows of blocks (gguf_blocks.py)

A `QuantizedLinear` keeps its codes and scales as plain buffers, so they move between devices, save to
safetensors and shard on dim 0 like any tensor. Its weight is dequantized just in time, in the input's
dtype, for each product: in forward, and again in backward for the input gradient, so nothing but the input
is saved for backward. On the CPU a big weight is written into one reusable buffer (workspace.py), so no
product allocates weight-sized memory. The model is quantized while it loads, one shard at a time, so the
full-precision model never exists.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import fused, workspace
from .config import DECODER_TARGETS, HF_NAME, QUANTIZE_KINDS
from .errors import UserError
from .gemm import copies_transposed, linear
from .gguf_blocks import GGUF_FORMATS, dequantize_gguf

DECODER_LINEARS = tuple(HF_NAME[t] for t in DECODER_TARGETS)  # q_proj ... down_proj
INT8_MAX = 127
NF4_BLOCK = 64
# bitsandbytes' NF4 codebook (quantiles of N(0, 1), QLoRA), sorted
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)


REQUANTIZED = ("int8", "nf4")  # quantized from float weights while loading (source keeps a file's own blocks)
LAYER_KINDS = (*REQUANTIZED, *GGUF_FORMATS)


def check_kind(kind: str, kinds=QUANTIZE_KINDS) -> None:
    if kind not in kinds:
        raise UserError(f"unknown quantize {kind!r} (use {' or '.join(kinds)})")


# ---------------------------------------------------------------------------- the formats


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (out, in), scale float32 (out,)) with w ≈ q · scale per row."""
    w = w.float()
    scale = w.abs().amax(dim=1) / INT8_MAX
    q = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q · scale in float32, rounded once into dtype (a mixed int8·float32 multiply runs ~10x slower)."""
    return q.to(torch.float32).mul_(scale[:, None]).to(dtype)


def _blockwise_scaled(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values / their block's absmax clamped to [-1, 1], absmax per block) as bitsandbytes computes them: full
    blocks multiplied by 1 / absmax, a last partial block divided by its absmax."""
    full = flat.numel() // block * block
    blocks = flat[:full].view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp_(-1, 1).view(-1)
    if full < flat.numel():
        last = flat[full:].abs().max().clamp(min=1e-38)
        absmax, scaled = torch.cat([absmax, last[None]]), torch.cat([scaled, (flat[full:] / last).clamp_(-1, 1)])
    return scaled, absmax


def quantize_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, absmax float32) as bitsandbytes' quantize_4bit(blocksize=64, quant_type="nf4") makes them:
    rows of in/2 bytes and in/64 blocks when in is a multiple of 64 (so both shard on dim 0), else flat."""
    flat = w.reshape(-1).float()
    n = flat.numel()
    scaled, absmax = _blockwise_scaled(flat, NF4_BLOCK)
    scaled = torch.nn.functional.pad(scaled, (0, n % 2))  # two codes a byte
    code = torch.tensor(NF4_CODE, device=w.device)
    idx = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)
    packed = (idx[0::2] << 4) | idx[1::2]
    if w.dim() == 2 and w.shape[1] % NF4_BLOCK == 0:
        return packed.view(w.shape[0], -1), absmax.view(w.shape[0], -1)
    return packed, absmax


DOUBLE_QUANT_BLOCK = 256


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (`create_dynamic_map()`), computed as it computes it: 7 decades of
    exponent, each with its share of linear fractions, plus 0 and 1, sorted."""
    data = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
    return torch.tensor(sorted(data + [0, 1.0]), dtype=torch.float32)


@fused.made_once
def _dynamic_map_on(device: torch.device) -> torch.Tensor:
    return dynamic_map().to(device)


def quantize_absmax(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nf4's double quantization: (codes uint8, second-level absmax float32, offset) of absmax - mean(absmax)."""
    offset = absmax.mean()
    scaled, absmax2 = _blockwise_scaled(absmax.reshape(-1) - offset, DOUBLE_QUANT_BLOCK)
    code = dynamic_map().to(absmax.device)
    codes = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)
    return codes.view(absmax.shape), absmax2, offset


def dequantize_absmax(codes: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    values = _dynamic_map_on(codes.device)[codes.reshape(-1).long()]
    values = torch.nn.functional.pad(values, (0, -values.numel() % DOUBLE_QUANT_BLOCK)).view(-1, DOUBLE_QUANT_BLOCK)
    return (values * absmax2[:, None]).view(-1)[:codes.numel()].add_(offset).view(codes.shape)


@fused.made_once
@torch.no_grad()
def _pair_table(device: torch.device) -> torch.Tensor:
    """(256, 2): the two code values of every byte, so one lookup decodes a byte; made once per device."""
    code = torch.tensor(NF4_CODE, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack([code[byte >> 4], code[byte & 15]], dim=1)


@fused.made_once
@torch.no_grad()
def _word_table(device: torch.device) -> torch.Tensor:
    """(65536, 4): the four code values of every two bytes, at the bytes read as an int16 word plus 32768."""
    word = torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16)
    return _pair_table(device)[word.view(torch.uint8).view(-1, 2).int()].reshape(-1, 4)  # its bytes in memory order


def _code_values(packed: torch.Tensor) -> torch.Tensor:
    """(bytes x 2,) float32: the code values of packed nf4 bytes, in order. A lookup copies a row of the table, and
    rows of four values a word cost the CPU 1.2-1.4x less than rows of two a byte; an odd count or start takes bytes."""
    flat = packed.reshape(-1)
    if flat.numel() % 2 or flat.storage_offset() % 2:
        return torch.nn.functional.embedding(flat.int(), _pair_table(flat.device)).view(-1)
    words = flat.view(torch.int16).int().add_(32768)
    return torch.nn.functional.embedding(words, _word_table(flat.device)).view(-1)


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape, dtype=torch.float32) -> torch.Tensor:
    values = _code_values(packed)
    n = torch.Size(shape).numel()
    if values.numel() % NF4_BLOCK == 0:
        values = values.view(-1, NF4_BLOCK).mul_(absmax.reshape(-1, 1)).view(-1)
    else:  # a last, partial block
        values = torch.nn.functional.pad(values, (0, -values.numel() % NF4_BLOCK)).view(-1, NF4_BLOCK)
        values = values.mul_(absmax.reshape(-1, 1)).view(-1)
    return values[:n].view(shape).to(dtype)


def dequantized(weight: torch.Tensor, kind: str, double_quant: bool = False) -> torch.Tensor:
    """dequant(quant(W)) in float32: the weight a `kind` base multiplies with (what `merge --onto dequantized` uses).
    For `source` the base's weights are the GGUF file's blocks already dequantized: W itself."""
    check_kind(kind)
    if kind == "source":
        return weight.float()
    if kind == "int8":
        return dequantize_int8(*quantize_int8(weight))
    codes, absmax = quantize_nf4(weight)
    if double_quant:
        absmax = dequantize_absmax(*quantize_absmax(absmax))
    return dequantize_nf4(codes, absmax, weight.shape)


def dequantize_codes(kind: str, codes: torch.Tensor, scales: torch.Tensor, shape: tuple, dtype: torch.dtype,
                     absmax2: torch.Tensor | None = None, offset: torch.Tensor | None = None) -> torch.Tensor:
    """The (out, in) = shape weight in `dtype` from a quantized layer's tensors (absmax2 and offset: nf4's double
    quantization)."""
    if kind == "int8":
        return dequantize_int8(codes, scales, dtype)
    if kind in GGUF_FORMATS:  # the scales live inside the blocks
        return dequantize_gguf(kind, codes, dtype)
    absmax = scales if absmax2 is None else dequantize_absmax(scales, absmax2, offset)
    return dequantize_nf4(codes, absmax, shape, dtype)


# On CUDA the eager dequantization is a chain of kernels, each a pass over weight-sized float32 memory; inductor
# fuses a format into one Triton kernel that reads the codes once and writes the weight in the product's dtype.
# That wins for these formats (H100, bf16, a 5632 x 2048 weight, `python -m bench.dequant --device cuda`): q4_K
# 0.19 against 0.71 ms eager, q5_K 0.15 / 0.51, q6_K 0.18 / 0.29, q5_0 0.24 / 0.30. The others were no faster
# compiled (nf4's table lookup three times slower), and the CPU keeps its eager kernels too: inductor's C++
# loops were faster for some formats and slower for others.
COMPILED_ON_CUDA = frozenset({"q4_k", "q5_k", "q6_k", "q5_0"})
_dequantize_compiled = fused.compiled(dequantize_codes, slower="quantized bases dequantize slower on the GPU",
                                      graphs=64, dynamic=True)


# ---------------------------------------------------------------------------- the layer


class QuantizedLinear(nn.Module):
    """A frozen linear y = x·dequant(W)ᵀ + b whose weight is held as int8 or nf4 codes and float32 scales."""

    def __init__(self, in_features: int, out_features: int, kind: str, codes: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__()
        check_kind(kind, LAYER_KINDS)
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, layer: nn.Linear, kind: str, double_quant: bool = False) -> "QuantizedLinear":
        w = layer.weight.detach()
        codes, scales = quantize_int8(w) if kind == "int8" else quantize_nf4(w)
        bias = layer.bias.detach() if layer.bias is not None else None
        if not (kind == "nf4" and double_quant):
            return cls(layer.in_features, layer.out_features, kind, codes, scales, bias)
        scale_codes, absmax2, offset = quantize_absmax(scales)
        q = cls(layer.in_features, layer.out_features, kind, codes, scale_codes, bias)
        q.register_buffer("absmax2", absmax2)  # the scales' own scales and offset (double quantization)
        q.register_buffer("offset", offset)
        return q

    @property
    def weight(self) -> torch.Tensor:
        """The codes: not a float tensor, so nothing mistakes them for a weight to merge into or train."""
        return self.codes

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The (out, in) weight in `dtype`, computed afresh."""
        compiled = self.kind in COMPILED_ON_CUDA and self.codes.is_cuda and fused.compiling()
        return (_dequantize_compiled if compiled else dequantize_codes)(*self.dequantize_args(dtype))

    def dequantize_args(self, dtype: torch.dtype) -> tuple:
        """The arguments of `dequantize_codes` for this layer's weight in `dtype`."""
        return (self.kind, self.codes, self.scales, (self.out_features, self.in_features), dtype,
                getattr(self, "absmax2", None), getattr(self, "offset", None))

    def transient_weight(self, dtype: torch.dtype, transposed: bool = False) -> torch.Tensor:
        """The weight in `dtype` (or, for gy·W, its transpose) for one product. On the CPU it is written a few rows
        at a time into this thread's reusable buffer (workspace.py), valid until the next transient weight, and a
        transpose is written row-major where `linear` would copy it so. Elsewhere (a GPU's caching allocator reuses
        memory itself), for small weights and for nf4 laid out flat, it is dequantize()'s fresh tensor."""
        kind, codes, scales, shape, dtype, absmax2, offset = self.dequantize_args(dtype)
        if codes.device.type != "cpu" or codes.dim() != 2 or torch.compiler.is_compiling() or \
                shape[0] * shape[1] <= workspace.WHOLE_WEIGHTS:
            w = self.dequantize(dtype)
            return w.t() if transposed else w
        if absmax2 is not None:  # one value a block of 64: small
            scales = dequantize_absmax(scales, absmax2, offset)
        rows = lambda r0, r1: dequantize_codes(kind, codes[r0:r1], scales[r0:r1], (r1 - r0, shape[1]), dtype)
        row_major_t = transposed and copies_transposed(dtype, codes.device)
        out = workspace.buffer(shape[::-1] if row_major_t else shape, dtype, codes.device)
        workspace.fill_by_rows(out, rows, row_major_t)
        return out.t() if transposed and not row_major_t else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
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


def shardable(layer: QuantizedLinear) -> None:
    """Hold the codes and scales laid out by output row as frozen parameters: FSDP2 shards parameters only."""
    for name in ("codes", "scales"):
        t = layer._buffers.get(name)
        if t is not None and t.dim() and t.shape[0] == layer.out_features:
            del layer._buffers[name]
            layer.register_parameter(name, nn.Parameter(t, requires_grad=False))


# ---------------------------------------------------------------------------- the model


def quantize_loaded_linears(model, kind: str, double_quant: bool = False) -> None:
    """Replace every decoder linear whose weight has been loaded (is no longer on `meta`) by its quantized copy;
    an adapted one keeps its adapter and gets its frozen base quantized."""
    check_kind(kind, REQUANTIZED)
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name in DECODER_LINEARS:
                holder, attr, lin = parent, name, getattr(parent, name, None)
                if hasattr(lin, "base_layer"):
                    holder, attr, lin = lin, "base_layer", lin.base_layer
                if type(lin) is nn.Linear and lin.weight.device.type != "meta" and \
                        (lin.bias is None or lin.bias.device.type != "meta"):
                    setattr(holder, attr, QuantizedLinear.from_linear(lin, kind, double_quant))


def tensor_bytes(module: nn.Module) -> int:
    """Bytes a module holds in its own parameters and buffers (codes and scales, for a quantized layer)."""
    own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in own)


def base_weight_bytes(model, decoder_linears_only: bool = False) -> int:
    """Bytes held by the frozen base weights (LoRA A/B excluded); a tied weight is counted once."""
    seen, total = set(), 0
    for name, module in model.named_modules():
        w = module._parameters.get("weight", module._buffers.get("codes"))
        if w is None or "lora_" in name or id(w) in seen:
            continue
        if decoder_linears_only and name.removesuffix(".base_layer").rsplit(".", 1)[-1] not in DECODER_LINEARS:
            continue
        seen.add(id(w))
        total += tensor_bytes(module)
    return total
