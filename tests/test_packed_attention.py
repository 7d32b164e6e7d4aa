"""The C loop for packed rows of short examples (kernels/packed_attention.py) against float64 attention.

Inputs are bf16 values, held exactly in float32; scores, softmax and sums are float32 and each output is rounded once
to bf16, so an output lies within half a bf16 unit (2^-9 relative) of the float64 result plus float32 sums' error:
the bound below is 2^-8 of the largest reference value."""

import pytest
import torch

from lora_llama.kernels import attention, blocked_attention, cpu, packed_attention
from lora_llama.kernels.attention import causal_segment_mask

needs_kernel = pytest.mark.skipif(
    packed_attention._library(64, 3, torch.bfloat16) is None,
    reason="no C compiler: the blocked kernel serves (tested below)",
)


def packed_rows(lengths_per_row, heads, kv_heads, d, seed=0):
    """q, k, v (B, H, T, d) bf16 as the model lays them out (transposed views of (B, T, H, d)) and segments."""
    g = torch.Generator().manual_seed(seed)
    T = max(sum(r) for r in lengths_per_row)
    segments = torch.full((len(lengths_per_row), T), -1)
    for b, lengths in enumerate(lengths_per_row):
        start = 0
        for i, n in enumerate(lengths):
            segments[b, start : start + n] = i
            start += n

    def make(h):
        return torch.randn(len(lengths_per_row), T, h, d, generator=g).bfloat16().transpose(1, 2)

    return make(heads), make(kv_heads), make(kv_heads), segments


def rope_tables(B, T, d, dtype, seed=2):
    """cos, sin (B, 1, T, d) as the model makes them: angles position·θ_i (positions up to 255), equal in both
    halves."""
    positions = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed)).double()
    angles = positions[..., None] * 10000.0 ** (-torch.arange(0, d, 2).double() / d)
    angles = torch.cat([angles, angles], -1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x, cos, sin, sign=1):
    """HF's apply_rotary_pos_emb in float64; sign -1: the inverse rotation (a gradient)."""
    x1, x2 = x.double().chunk(2, -1)
    return x.double() * cos.double() + torch.cat((-x2, x1), -1) * sin.double() * sign


def reference(q, k, v, segments, grad_out, out):
    """out and dq, dk, dv in float64. The backward takes delta = rowsum(dO·out) from the kernel's own bf16 `out`,
    as flash attention's backward does (and the blocked kernel): the rounding of out is part of the contract, so
    what is left to compare is float32 arithmetic and the final rounding."""
    q, k, v, grad_out = (t.double() for t in (q, k, v, grad_out))
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    visible = causal_segment_mask(segments)[:, None]
    scale = q.shape[-1] ** -0.5
    p = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf")).softmax(-1)
    delta = (grad_out * out.double()).sum(-1, keepdim=True)
    ds = p * (grad_out @ v.transpose(-1, -2) - delta)
    dq, dk, dv = ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ grad_out

    def per_kv_head(t):
        return t.unflatten(1, (-1, rep)).sum(2)

    return p @ v, dq, per_kv_head(dk), per_kv_head(dv)


def close(got, want, kernel_output=True):
    """bf16: one rounding (2^-9 relative) and float32 sums; float32: the sums' rounding over up to LONGEST = 2^8
    terms, n·u = 2^8 · 2^-24 (exp2's polynomial, ~2^-22, is well inside it)."""
    assert got.transpose(1, 2).is_contiguous() or not kernel_output  # positions-major, as the ops' fakes say
    bound = (2.0**-8 if got.dtype == torch.bfloat16 else 2.0**-16) * want.abs().max().item() + 1e-6
    assert (got.double() - want).abs().max().item() <= bound


@needs_kernel
@pytest.mark.parametrize(
    "rows, heads, kv_heads, d",
    [
        ([[53, 53, 44], [41, 41, 40, 11, 3], [150]], 9, 3, 64),  # SmolLM2's 9:3 heads, a row of one example
        ([[1, 17, 30, 16], [64]], 4, 4, 128),  # no grouping, head dim 128, an example of one token
        ([[33, 31], [20, 44]], 8, 1, 64),  # all eight query heads on one key/value head
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_and_backward_equal_float64_attention(rows, heads, kv_heads, d, dtype):
    q, k, v, segments = (t.to(dtype) if t.is_floating_point() else t for t in packed_rows(rows, heads, kv_heads, d))
    assert packed_attention.applies(q, k, segments)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, lse = packed_attention.forward(q, k, v, segments)
    grads = packed_attention.backward(q, k, v, out, lse, grad_out, segments)
    want = reference(q, k, v, segments, grad_out, out)
    for got, expected in zip((out, *grads), want):
        close(got, expected)
    _, blocked_lse = blocked_attention.forward(q, k, v, segments)
    torch.testing.assert_close(lse, blocked_lse, rtol=0, atol=1e-4)  # the blocked kernel's log-sum-exp, base 2


@needs_kernel
@pytest.mark.parametrize("tables_per_row", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_on_the_way_in_equals_attention_of_rotated_q_and_k(dtype, tables_per_row):
    """Given cos and sin, the kernel attends with q and k rotated, and its dq, dk are the gradients of q and k before
    the rotation (float64 reference: rotate, attend, rotate the gradients back)."""
    rows = [[53, 53, 44], [41, 41, 40, 11, 3], [150]]
    q, k, v, segments = (t.to(dtype) if t.is_floating_point() else t for t in packed_rows(rows, 9, 3, 64))
    cos, sin = rope_tables(3 if tables_per_row else 1, q.shape[2], 64, dtype)
    assert packed_attention.applies(q, k, segments, (cos, sin))
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, lse = packed_attention.forward(q, k, v, segments, (cos, sin))
    dq, dk, dv = packed_attention.backward(q, k, v, out, lse, grad_out, segments, (cos, sin))
    want = reference(rotate(q, cos, sin), rotate(k, cos, sin), v, segments, grad_out, out)
    close(out, want[0])
    close(dq, rotate(want[1], cos, sin, -1))
    close(dk, rotate(want[2], cos, sin, -1))
    close(dv, want[3])


@needs_kernel
def test_attend_hands_rope_to_it(monkeypatch):
    q, k, v, segments = packed_rows([[20, 30, 14], [64]], 9, 3, 64)
    cos, sin = rope_tables(2, 64, 64, torch.bfloat16)
    calls = []
    real = packed_attention.forward
    monkeypatch.setattr(packed_attention, "forward", lambda *a: calls.append(a[-1] is not None) or real(*a))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = attention.attend(q, k, v, causal=True, segments=segments, rope=(cos, sin))
    out.backward(grad_out)
    assert calls == [True]
    rotated = rotate(q.detach(), cos, sin), rotate(k.detach(), cos, sin)
    want = reference(*rotated, v.detach(), segments, grad_out, out.detach())
    for got, expected in zip((out, q.grad, k.grad, v.grad), (want[0], *(rotate(g, cos, sin, -1) for g in want[1:3]))):
        close(got, expected, kernel_output=False)
    close(v.grad, want[3], kernel_output=False)


@needs_kernel
def test_attend_runs_it_for_bf16_packed_rows_in_training(monkeypatch):
    q, k, v, segments = packed_rows([[20, 30, 14], [64]], 9, 3, 64)
    calls = []
    for name in ("forward", "backward"):
        real = getattr(packed_attention, name)
        monkeypatch.setattr(packed_attention, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = attention.attend(q, k, v, causal=True, segments=segments)
    out.backward(grad_out)
    assert calls == ["forward", "backward"]
    want = reference(q.detach(), k.detach(), v.detach(), segments, grad_out, out.detach())
    for got, expected in zip((q.grad, k.grad, v.grad), want[1:]):
        close(got, expected, kernel_output=False)  # autograd lays a leaf's gradient out as the leaf


@needs_kernel
def test_loading_the_kernel_leaves_subnormal_numbers_alone():
    """A library linked with -ffast-math would turn on flush-to-zero for the whole process when loaded."""
    packed_attention._library(64, 3, torch.bfloat16)
    packed_attention._library(64, 3, torch.float32)
    tiny = 1e-310
    assert tiny * 1.0 != 0.0
    assert torch.tensor(1e-40, dtype=torch.float32).mul(1.0).item() != 0.0


@needs_kernel
def test_long_examples_and_float16_keep_the_blocked_kernel():
    q, k, _, segments = packed_rows([[packed_attention.LONGEST + 1]], 9, 3, 64)
    assert not packed_attention.applies(q, k, segments)
    q, k, _, segments = packed_rows([[30, 30]], 9, 3, 64)
    assert packed_attention.applies(q, k, segments) and packed_attention.applies(q.float(), k.float(), segments)
    assert not packed_attention.applies(q.half(), k.half(), segments)
    assert not packed_attention.applies(q, k, None)


def test_without_a_compiler_one_warning_and_the_blocked_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(packed_attention, "_libraries", {})
    monkeypatch.setattr(packed_attention, "_broken", False)
    q, k, v, segments = packed_rows([[25, 39]], 9, 3, 64)
    with pytest.warns(UserWarning, match="packed attention runs the blocked kernel"):
        out = attention.causal_attention(q, k, v, segments)[0]
    assert torch.equal(out, blocked_attention.forward(q, k, v, segments)[0])
    assert not packed_attention.applies(q, k, segments)  # said once: the process keeps the blocked kernel


@needs_kernel
@pytest.mark.skipif(cpu.openmp_runtime() is None, reason="torch loaded no GNU OpenMP runtime here")
def test_it_runs_on_the_openmp_runtime_torch_loaded(monkeypatch, tmp_path):
    """A second runtime would bring a second set of threads, competing with torch's for the cores."""

    def runtimes():
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f if "omp" in line.split()[-1].rsplit("/", 1)[-1]}

    before = runtimes()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # built and loaded afresh
    monkeypatch.setattr(packed_attention, "_libraries", {})
    assert packed_attention._library(64, 3, torch.bfloat16) is not None
    assert runtimes() == before


@needs_kernel
def test_each_thread_count_gives_the_same_bytes():
    """Work is split into one share per thread of torch's; each task (an example and a key/value head) is computed
    whole by one thread, so the split changes no output."""
    q, k, v, segments = packed_rows([[53, 53, 44], [41, 41, 40, 11, 3], [150]], 9, 3, 64)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out, lse = packed_attention.forward(q, k, v, segments)
            results.append((out, lse, *packed_attention.backward(q, k, v, out, lse, grad_out, segments)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
