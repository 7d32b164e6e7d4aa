"""GGUF's quantized block formats, dequantized as ggml dequantizes them (`quantize: source` keeps them).

Each weight row is a run of blocks; a block holds `weights` weights in `bytes` bytes:

    q8_0   32 weights  f16 d, 32 int8 q                          d·q
    q4_0   32          f16 d, 16 bytes of nibbles                 d·(q - 8)
    q4_1   32          f16 d, f16 m, 16 bytes of nibbles          d·q + m
    q5_0   32          f16 d, 32 high bits, 16 bytes of nibbles   d·(q - 16)
    q5_1   32          f16 d, f16 m, 32 high bits, nibbles        d·q + m
    q4_K   256         f16 d, f16 dmin, 8 six-bit (scale, min) pairs, nibbles: sub-blocks of 32, d·sc·q - dmin·m
    q5_K   256         as q4_K with a fifth bit per weight
    q6_K   256         low nibbles, 2 high bits, 16 int8 scales, f16 d: sub-blocks of 16, d·sc·(q - 32)

In the 32-weight formats weight j sits in the low nibble of byte j and weight j + 16 in its high nibble; in the
K formats each 32 bytes of nibbles hold two sub-blocks, the low nibbles first.
"""

from __future__ import annotations

import torch

# kind: (weights per block, bytes per block)
GGUF_FORMATS = {
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}
EIGHT = tuple(range(8))  # the shifts that take each bit of a byte


def row_bytes(kind: str, in_features: int) -> int:
    """Bytes of one weight row of `in_features` weights in `kind`'s blocks."""
    weights, size = GGUF_FORMATS[kind]
    return in_features // weights * size


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) little-endian bytes -> (..., 1) float32."""
    return b.view(torch.float16).float()


def _bits(b: torch.Tensor, width: int, shifts: tuple, part=None) -> torch.Tensor:
    """(..., n) bytes -> (..., len(shifts), n): each byte shifted right by each shift, `width` bits kept; with `part`,
    the shifts and masks run over all of b and `part` takes the bytes wanted from each result (stacked the same way).
    One shift by a number at a time: a uint8 shift by a broadcast tensor of shifts runs ~5x slower on the CPU."""
    mask = (1 << width) - 1
    part = part or (lambda x: x)
    return torch.stack([part((b >> s).bitwise_and_(mask) if s else b & mask) for s in shifts], dim=-2)


def _nibbles(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """(..., bytes) 32-weight blocks whose 16 bytes of nibbles begin at `start` -> (..., 32): the low nibbles, then
    the high ones. The shifts and masks run over the whole blocks, contiguous, where over the 16 nibble bytes of
    each (a strided slice) they ran ~1.6x slower (a 1536 x 576 q4_1 weight, AVX2 EPYC: 0.7 ms against 1.15); the K
    formats' nibbles, 128 bytes of a block in one run, are as fast sliced first."""
    return _bits(blocks, 4, (0, 4), lambda b: b[..., start : start + 16]).flatten(-2)


def _fifth_bit(qh: torch.Tensor) -> torch.Tensor:
    """(..., 4) bytes -> (..., 32) 16s: bit j of the little-endian 32-bit word is weight j's fifth bit."""
    return (_bits(qh, 1, EIGHT).transpose(-1, -2).flatten(-2)) << 4


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_K / q5_K: 12 bytes -> (8 scales, 8 mins), 6 bits each; the last 4 sub-blocks' top 2 bits come from the
    first 8 bytes' top bits."""
    d, m, low = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 63, (low & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (low >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


def _q32(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """(…, 32) weights of the 32-weight formats."""
    d = _f16(blocks[..., 0:2])
    if kind == "q8_0":
        return blocks[..., 2:].view(torch.int8).float().mul_(d)
    offset = 4 if kind in ("q4_1", "q5_1") else 2  # after d (and m)
    if kind in ("q5_0", "q5_1"):
        q = (_nibbles(blocks, offset + 4) | _fifth_bit(blocks[..., offset : offset + 4])).float()
    else:
        q = _nibbles(blocks, offset).float()
    if kind in ("q4_0", "q5_0"):
        return q.sub_(8 if kind == "q4_0" else 16).mul_(d)
    return q.mul_(d).add_(_f16(blocks[..., 2:4]))


def _q256(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """(…, 256) weights of the K formats."""
    if kind == "q6_k":
        low = _bits(blocks[..., 0:128].unflatten(-1, (2, 64)), 4, (0, 4)).flatten(-2).unflatten(-1, (4, 32))
        high = _bits(blocks[..., 128:192].unflatten(-1, (2, 32)), 2, (0, 2, 4, 6))
        q = (low | (high << 4)).view(torch.int8).float().sub_(32).flatten(-3).unflatten(-1, (16, 16))
        sc = blocks[..., 192:208].view(torch.int8).float().unsqueeze(-1)
        return q.mul_(_f16(blocks[..., 208:210]).unsqueeze(-1) * sc).flatten(-2)
    sc, mn = _k_scales(blocks[..., 4:16])
    d, dmin = _f16(blocks[..., 0:2]).unsqueeze(-1), _f16(blocks[..., 2:4]).unsqueeze(-1)
    qs = blocks[..., -128:].unflatten(-1, (4, 32))
    q = _bits(qs, 4, (0, 4)).flatten(-3, -2)  # (…, 8, 32)
    if kind == "q5_k":
        q = q | (_bits(blocks[..., 16:48], 1, EIGHT) << 4)
    return q.float().mul_(d * sc).sub_(dmin * mn).flatten(-2)  # in place: one weight-sized float buffer


def dequantize_gguf(kind: str, rows: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(out, in) weights from a GGUF tensor's rows of blocks (out, blocks x bytes), as ggml dequantizes them."""
    weights, size = GGUF_FORMATS[kind]
    blocks = rows.view(rows.shape[0], -1, size)  # (out, nb, bytes)
    w = _q32(kind, blocks) if weights == 32 else _q256(kind, blocks)
    return w.reshape(rows.shape[0], -1).to(dtype)
