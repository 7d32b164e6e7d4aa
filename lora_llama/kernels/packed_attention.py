"""Causal attention over packed rows of short examples on the CPU (bf16 or float32), as one C loop per example and
key/value head.

A packed chat row holds examples of tens of tokens: each is a small causal problem, and the blocked kernel
(blocked_attention.py) spends most of its time around its batched products, in passes over score tiles, not in them.
packed_attention.c computes an example's scores, softmax and sums in float32 registers over keys and values it holds as
float32, with the query heads that share a key/value head in one pass, and writes outputs in the inputs' dtype (forward:
out and the base-2 log-sum-exp; backward: dq, dk, dv from the recomputed probabilities), in the blocked kernel's
contract; given RoPE's cos and sin, it rotates q and k as it reads them (and dq, dk back as it writes them), where a
separate rotation takes three passes over each way (the default recipe's step: ~1.5% shorter). Per layer (SmolLM2
shapes, 9:3 heads of 64, a 4 x 256 packed batch of the default recipe, 2 threads, EPYC with AVX512_BF16): bf16 forward
1.3-1.4 ms against the blocked kernel's 4.3-6.3, backward 3.1-3.4 against 6.9-10.2, closer to float64 than the blocked
kernel's bf16 products; float32 forward 1.3-1.4 against 5.6-6.0, backward 3.5-3.6 against 9.3-9.9. Its examples are
dealt to torch's own OpenMP threads (the library is linked against the runtime torch loaded): threads of its own would
compete for the cores with torch's, which spin for a while after each product, and take twice these times inside a
training step.

The C file is built for this CPU on first use (kernels/cpu.py); where that fails, one warning names the cause and the
blocked kernel runs. Examples longer than LONGEST, head dimensions other than HEAD_DIMS and grouped heads beyond
MAX_REP keep the blocked kernel (whose batched products win on long examples).
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from lora_llama.kernels.blocked_attention import LOG2E, positions_major
from lora_llama.kernels.cpu import c_library_or_none, pointers
from lora_llama.kernels.packed_rows import example_starts

# positions of the longest example this kernel takes: its backward's work per example grows as the square, and past
# this the blocked kernel's batched products win (forward + backward per layer, rows of 512 all of one length, 9:3
# heads of 64, 2 threads, EPYC with AVX512_BF16; blocked / C: bf16 examples of 64 13.4 / 6.0 ms, 128 15.6 / 10.3,
# 256 20.4 / 18.5, 512 31.0 / 35.1; float32 256 25.0 / 18.2, 512 40.3 / 33.3). Batches of short examples beside
# one of 256 (the default recipe's) still gain most of the short ones' saving.
LONGEST = 256
HEAD_DIMS = (64, 128)
MAX_REP = 8  # query heads per key/value head
DTYPES = (torch.bfloat16, torch.float32)
ENABLED = True  # tests switch it off to compare with the blocked kernel
SOURCE = Path(__file__).with_name("packed_attention.c")

_libraries: dict[tuple[int, int, torch.dtype], ctypes.CDLL | None] = {}
_broken = False  # building failed once: the process keeps the blocked kernel
_plans: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}


def applies(q: torch.Tensor, k: torch.Tensor, segments: torch.Tensor | None, rope=None) -> bool:
    """bf16 or float32 q, k (B, H, T, d) and packed rows on the CPU whose examples this kernel takes, outside
    torch.compile, where its C loop builds (the first call for a shape builds it); rope: (cos, sin) that it takes
    too (in q's dtype, (B or 1, 1, T, d), each row's values contiguous)."""
    return (
        ENABLED
        and (rope is None or _takes_rope(q, *rope))
        and not _broken
        and segments is not None
        and q.device.type == "cpu"
        and q.dtype == k.dtype in DTYPES
        and q.shape[-1] in HEAD_DIMS
        and q.shape[1] % k.shape[1] == 0
        and q.shape[1] // k.shape[1] <= MAX_REP
        and not torch.compiler.is_compiling()
        and _plan(segments, k.shape[1])[2] <= LONGEST
        and _library(q.shape[-1], q.shape[1] // k.shape[1], q.dtype) is not None
    )


def _takes_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    B, _, T, d = q.shape
    return (
        all(
            t.dtype == q.dtype
            and t.dim() == 4
            and t.shape[0] in (1, B)
            and t.shape[1:] == (1, T, d)
            and t.stride(-1) == 1
            for t in (cos, sin)
        )
        and cos.stride() == sin.stride()
    )


def forward(q, k, v, segments, rope=None):
    """out (B, H, T, d) in q's dtype, positions-major, and the base-2 log-sum-exp (B, H, T) float32, as
    blocked_attention.forward (where `applies`). rope (cos, sin): attention of q and k rotated by them (HF's
    apply_rotary_pos_emb), in float32 on their way into registers."""
    lib = _library(q.shape[-1], q.shape[1] // k.shape[1], q.dtype)
    q, k, v = (_last_contiguous(t) for t in (q, k, v))
    out = positions_major(q.shape, q.dtype, q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32)
    c = LOG2E / math.sqrt(q.shape[-1])
    tensors = pointers(q, k, v, out, lse)
    strides = [_strides(t) for t in (q, k, v, out, lse.unsqueeze(-1))]
    _run(lib.packed_forward, segments, k.shape[1], lambda *plan: (*tensors, *plan, c, *strides, *_rope(q, rope)))
    return out, lse


def backward(q, k, v, out, lse, grad_out, segments, rope=None):
    """dq, dk, dv (in q's dtype, positions-major) as blocked_attention.backward (where `applies`); with rope, the
    gradients of q and k before their rotation (forward's)."""
    lib = _library(q.shape[-1], q.shape[1] // k.shape[1], q.dtype)
    q, k, v, out, grad_out = (_last_contiguous(t) for t in (q, k, v, out, grad_out))
    dq, dk, dv = (positions_major(t.shape, q.dtype, q) for t in (q, k, v))
    scale = 1 / math.sqrt(q.shape[-1])
    tensors = pointers(q, k, v, out, grad_out, lse, dq, dk, dv)
    strides = [_strides(t) for t in (q, k, v, out, grad_out, lse.unsqueeze(-1), dq, dk)]
    _run(
        lib.packed_backward,
        segments,
        k.shape[1],
        lambda *plan: (*tensors, *plan, scale * LOG2E, scale, *strides, *_rope(q, rope)),
    )
    return dq, dk, dv


def _run(function, segments, kv_heads: int, arguments) -> None:
    """function over the tasks of these packed rows, in one share of about equal work per thread of torch's."""
    tasks, bounds, _ = _plan(segments, kv_heads)
    if function(*arguments(*pointers(tasks, bounds), len(bounds) - 1)):
        raise MemoryError("packed attention: no memory for an example's keys and values")


def _plan(segments: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tasks, bounds, longest): (n, 4) int64 rows (batch row, key/value head, first position, length), longest first
    and dealt into one run of about equal work (length²) per thread, the runs' bounds, and the longest example; kept
    for the last two segment tensors (every layer of a step, forward and backward, has the same)."""
    shares = torch.get_num_threads()
    key = (tuple(segments.shape), kv_heads, shares, segments.contiguous().numpy().tobytes())
    if key not in _plans:
        examples = []
        positions = torch.arange(segments.shape[1])
        for b, first in enumerate(example_starts(segments) == positions):
            starts = positions[first].tolist()
            ends = starts[1:] + [segments.shape[1]]
            examples += [(b, g, s, e - s) for s, e in zip(starts, ends) for g in range(kv_heads)]
        examples.sort(key=lambda e: -e[3])
        runs: list[list] = [[] for _ in range(shares)]
        work = [0] * shares
        for e in examples:
            i = work.index(min(work))
            runs[i].append(e)
            work[i] += e[3] * e[3]
        bounds = [0]
        for run in runs:
            bounds.append(bounds[-1] + len(run))
        rows = torch.tensor([e for run in runs for e in run], dtype=torch.int64).view(-1, 4)
        _plans[key] = (rows, torch.tensor(bounds, dtype=torch.int64), examples[0][3] if examples else 0)
        while len(_plans) > 2:
            del _plans[next(iter(_plans))]
    return _plans[key]


def _rope(q: torch.Tensor, rope) -> tuple:
    """The C loop's cos, sin and their (batch row, position) strides; null pointers without RoPE."""
    if rope is None:
        return None, None, None
    cos, sin = (t.expand(q.shape[0], *t.shape[1:]) for t in rope)
    return *pointers(cos, sin), (ctypes.c_int64 * 2)(cos.stride(0), cos.stride(2))


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor):
    return (ctypes.c_int64 * 3)(*t.stride()[:3])


def _library(head_dim: int, rep: int, dtype: torch.dtype) -> ctypes.CDLL | None:
    """The kernel built for this head dimension, grouping and dtype, loaded; None (and one warning) where building
    fails."""
    global _broken
    if (head_dim, rep, dtype) not in _libraries:
        defines = (f"-DD={head_dim}", f"-DREP={rep}", *(("-DFLOAT_IN",) if dtype == torch.float32 else ()))
        pointer, count, number = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        signatures = {
            "packed_forward": [pointer] * 7 + [count, number] + [pointer] * 8,
            "packed_backward": [pointer] * 11 + [count, number, number] + [pointer] * 11,
        }  # each returns an int: nonzero where it found no memory
        lib = c_library_or_none(SOURCE, "packed attention runs the blocked kernel", signatures, defines)
        _broken = _broken or lib is None
        _libraries[head_dim, rep, dtype] = lib
    return _libraries[head_dim, rep, dtype]
