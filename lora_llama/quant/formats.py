"""int8 and nf4 weights as bitsandbytes lays them out: quantized from float weights, and dequantized.

int8  one scale per output row: scale = absmax(row) / 127, q = round(w / scale) in [-127, 127]
nf4   QLoRA's NormalFloat-4 codebook (bitsandbytes' 16 values), blocks of 64 consecutive weights in
      row-major order with one float32 absmax each; two codes a byte, the first in the high nibble.
      With double quantization the absmax values, less their mean, are stored in 8 bits (bitsandbytes'
      dynamic map) in blocks of 256 with one float32 absmax each, as QLoRA does
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from lora_llama.kernels import fused
from lora_llama.kernels.cpu import c_library_or_none, pointers

INT8_MAX = 127
NF4_BLOCK = 64
# bitsandbytes' NF4 codebook (quantiles of N(0, 1), QLoRA), sorted
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (out, in), scale float32 (out,)) with w ≈ q · scale per row."""
    w = w.float()
    scale = w.abs().amax(dim=1) / INT8_MAX
    q = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


# On the CPU, one C loop (dequantize.c, on torch's threads) reads each code once and writes each weight once, where
# torch's kernels write a float32 weight, scale it and round it in three passes. SmolLM2's 1536 x 576, AVX512_BF16
# EPYC, 2 threads: int8 in bf16 56 µs against torch's kernels' 103 (inductor's one loop: 106, plus ~70 to call it), in
# float32 37 against 55; nf4 in bf16 64 against bitsandbytes' CPU kernel's 75, in float32 36 against the formulas'
# 429; the same values.
LOOPS = Path(__file__).with_name("dequantize.c")
_LOOP_DTYPES = {torch.bfloat16: "bf16", torch.float32: "float"}


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q · scale in float32, rounded once into dtype (a mixed int8·float32 multiply runs ~10x slower)."""
    loop = _loop("int8", dtype) if q.device.type == "cpu" and q.dim() == 2 else None
    if loop is None:
        return q.to(torch.float32).mul_(scale[:, None]).to(dtype)
    q, scale = q.contiguous(), scale.to(torch.float32).contiguous()
    out = torch.empty(q.shape, dtype=dtype)
    loop(*pointers(q, scale, out), *q.shape)
    return out


def _loop(kind: str, dtype: torch.dtype):
    """dequantize.c's loop writing `kind`'s weight in `dtype`, or None (no such loop, no build of the file, or a
    formula being compiled: a graph holds the formulas)."""
    lib = _library() if dtype in _LOOP_DTYPES and not torch.compiler.is_compiling() else None
    return None if lib is None else getattr(lib, f"{kind}_to_{_LOOP_DTYPES[dtype]}")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """dequantize.c built and loaded; None (and one warning) where building fails."""
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    signatures = {f"int8_to_{dtype}": [pointer] * 3 + [count] * 2 for dtype in _LOOP_DTYPES.values()}
    signatures.update({f"nf4_to_{dtype}": [pointer] * 4 + [count] for dtype in _LOOP_DTYPES.values()})
    return c_library_or_none(LOOPS, "quantized bases dequantize through torch's kernels", signatures)


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
        bounds = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
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
    return (values * absmax2[:, None]).view(-1)[: codes.numel()].add_(offset).view(codes.shape)


def nf4_absmax(scales: torch.Tensor, absmax2: torch.Tensor | None = None, offset: torch.Tensor | None = None):
    """nf4's float absmax per block of 64: the scales themselves, or with double quantization (absmax2 given)
    their 8-bit codes dequantized."""
    return scales if absmax2 is None else dequantize_absmax(scales, absmax2, offset)


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


@fused.made_once
def _code_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_CODE, device=device)


@functools.lru_cache(maxsize=None)
def bitsandbytes_dequantize_4bit():
    """bitsandbytes' dequantize_4bit op, or None where it is not installed or too old to register its ops with
    torch (< 0.46); imported once, on the first nf4 weight a GPU or a CPU product needs."""
    # its CPU backend logs a warning at import about an optional kernel hub it does not need for this op
    quiet = logging.getLogger("bitsandbytes")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)

        return torch.ops.bitsandbytes.dequantize_4bit.default
    except Exception:  # not installed, no library for this CUDA, or no such op: the formulas serve
        return None
    finally:
        quiet.setLevel(level)


def nf4_by_bitsandbytes(codes: torch.Tensor, absmax: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_nf4 by bitsandbytes' own kernel, which reads the same bytes and absmax values (QLoRA's format)
    and writes the weight in `dtype` in one pass, without float32 temporaries."""
    op = bitsandbytes_dequantize_4bit()
    return op(codes.reshape(-1, 1), absmax.reshape(-1).float(), NF4_BLOCK, "nf4", list(shape), dtype)


@functools.lru_cache(maxsize=None)
def _bitsandbytes_on_cpu() -> bool:
    """Whether bitsandbytes' CPU kernel serves nf4 in bf16: installed, and equal bit for bit to the formulas here on
    every byte value (checked once, as versions differ in what their CPU backend runs)."""
    if bitsandbytes_dequantize_4bit() is None:
        return False
    g = torch.Generator().manual_seed(0)
    packed = torch.arange(256, dtype=torch.uint8).repeat(2)[torch.randperm(512, generator=g)].view(8, 64)
    absmax = torch.rand(8, 2, generator=g) + 0.5
    try:
        theirs = nf4_by_bitsandbytes(packed, absmax, (8, 128), torch.bfloat16).view(-1)
        return torch.equal(theirs, _nf4_eager(packed, absmax, 1024, torch.bfloat16))
    except Exception:  # a build without its CPU library
        return False


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape, dtype=torch.float32) -> torch.Tensor:
    """The weight. On the CPU, whole blocks by dequantize.c's loop; bf16 where that is not built by bitsandbytes'
    kernel where it is installed (same values, ~1.2x slower than the loop; its import brings triton and what
    torch.compile imports: ~30 MB more at a bf16 step's peak, ~200 MB in a float32 process, which keeps the formulas
    here)."""
    n = torch.Size(shape).numel()
    whole_blocks = n == 2 * packed.numel() and n % NF4_BLOCK == 0
    cpu = packed.device.type == "cpu" and whole_blocks
    if cpu and (loop := _loop("nf4", dtype)) is not None:
        packed, absmax = packed.reshape(-1).contiguous(), absmax.reshape(-1).to(torch.float32).contiguous()
        out = torch.empty(shape, dtype=dtype)
        loop(*pointers(packed, absmax, _code_table(packed.device), out), n // NF4_BLOCK)
        return out
    if cpu and dtype == torch.bfloat16 and _bitsandbytes_on_cpu():
        return nf4_by_bitsandbytes(packed, absmax, shape, dtype)
    return _nf4_eager(packed, absmax, n, dtype).view(shape)


def _nf4_eager(packed: torch.Tensor, absmax: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first n weights, flat: code values times their block's absmax in float32, rounded once into dtype."""
    values = _code_values(packed)
    if values.numel() % NF4_BLOCK == 0:
        values = values.view(-1, NF4_BLOCK).mul_(absmax.reshape(-1, 1)).view(-1)
    else:  # a last, partial block
        values = torch.nn.functional.pad(values, (0, -values.numel() % NF4_BLOCK)).view(-1, NF4_BLOCK)
        values = values.mul_(absmax.reshape(-1, 1)).view(-1)
    return values[:n].to(dtype)
