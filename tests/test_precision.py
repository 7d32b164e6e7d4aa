"""bf16-mixed: every hand-written piece in bfloat16 against a float64 reference within bf16 tolerance, the fused and
plain LoRA paths alike, training to the float32 run's loss, int8 bases, generate / eval, and what `auto` picks."""

import functools
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import helpers
from helpers import rel
from lora_llama import load_model
from lora_llama.kernels import attention, blocked_attention, fused
from lora_llama.kernels import cross_entropy as loss_module
from lora_llama.kernels.attention import attend
from lora_llama.kernels.cross_entropy import linear_cross_entropy
from lora_llama.kernels.elementwise import apply_rope, rms_norm, swiglu
from lora_llama.kernels.gemm import linear
from lora_llama.lora.adapted import apply_lora, lora_modules
from lora_llama.lora.layer import LoRALinear
from lora_llama.lora.layer import shared_input_projection as project
from lora_llama.lora.settings import lora_settings
from lora_llama.model.config import BLOCK_LINEARS

BF16 = 2e-2  # relative error allowed: bfloat16 keeps 8 bits (eps 7.8e-3); products accumulate in float32


def pair(*shape, seed=0, scale=1.0):
    """The same values as a bf16 tensor and as a float64 one (the bf16 rounding is not the error measured)."""
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()
    return x.requires_grad_(), x.double().requires_grad_()


def check(fn, inputs_bf16, inputs_64, seed=9):
    """fn's output and input gradients in bf16 against float64 on the same values."""
    out, ref = fn(*inputs_bf16), fn(*inputs_64)
    assert out.dtype == torch.bfloat16 or out.dtype == torch.float32
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    grads = torch.autograd.grad(out, inputs_bf16, g.to(out.dtype))
    refs = torch.autograd.grad(ref, inputs_64, g)
    assert rel(out, ref) < BF16, rel(out, ref)
    for a, b in zip(grads, refs):
        assert a.dtype == torch.bfloat16 and rel(a, b) < BF16, rel(a, b)


def refuse(*args):
    raise AssertionError("the other kernel ran")


# kernels/fused.py's C loops (what a bf16 CPU training step runs), its torch.compile'd formulas (where the loops are
# not built), or PyTorch's eager kernels
@pytest.mark.parametrize("kernel", ["loops", "compiled", "eager"])
def test_rms_norm_rope_swiglu_in_bf16(monkeypatch, kernel):
    monkeypatch.setattr(fused, "ENABLED", kernel != "eager")
    if kernel == "compiled":
        monkeypatch.setattr(fused, "_loops", lambda: None)
    if kernel == "loops":
        assert fused._loops() is not None, "elementwise.c did not build"
        for name in ("_rms_norm_forward", "_rms_norm_backward", "_swiglu_forward", "_swiglu_backward"):
            monkeypatch.setattr(fused, name, refuse)
    calls = []
    for name in ("rms_norm_forward", "rms_norm_backward", "swiglu_forward", "swiglu_backward"):
        monkeypatch.setattr(
            fused, name, functools.partial(lambda f, name, *a: calls.append(name) or f(*a), getattr(fused, name), name)
        )
    x, x64 = pair(2, 7, 64)
    w, w64 = pair(64, seed=1, scale=0.1)
    w.data += 1
    w64.data += 1
    check(lambda t, s: rms_norm(t, s, 1e-5), (x, w), (x64, w64))
    q, q64 = pair(2, 4, 7, 16)
    angles = torch.randn(2, 1, 7, 8, generator=torch.Generator().manual_seed(2))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    check(lambda t: apply_rope(t, cos.to(t.dtype), sin.to(t.dtype)), (q,), (q64,))
    g, g64 = pair(3, 5, 32, seed=3)
    u, u64 = pair(3, 5, 32, seed=4)
    check(swiglu, (g, u), (g64, u64))
    assert sorted(set(calls)) == (
        ["rms_norm_backward", "rms_norm_forward", "swiglu_backward", "swiglu_forward"] if kernel != "eager" else []
    )
    assert fused._broken is None


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of bf16 at the larger of the two (8 significant bits)."""
    a, b = a.double(), b.double()
    scale = torch.maximum(a.abs(), b.abs()).clamp(min=2.0**-126)
    return (a - b).abs() / torch.exp2(torch.floor(torch.log2(scale)) - 7)


@pytest.mark.parametrize("shape", [(3, 37, 576), (5, 77), (1, 4100)])  # rows of odd widths, a part-filled chunk
def test_c_loops_round_the_formulas_values(shape):
    """The C loops against the formulas run by PyTorch's eager kernels (x/rms rounded to bf16 before the weight, as HF
    does; inductor's compiled loop skips that rounding and differs from both in a quarter of the outputs): the same
    float32 formula, its sums and exp in another order, so each output is the same float32 value give or take a few
    float32 ulps, rounded once to bf16. The two differ by at most one bf16 ulp, and only for the few values within
    those ulps of a rounding boundary."""
    if fused._loops() is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(11)
    x, u, grad = ((torch.randn(shape, generator=g) * 3).bfloat16() for _ in range(3))
    weight = (1 + torch.randn(shape[-1], generator=g) * 0.1).bfloat16()
    y, rstd = fused.rms_norm_forward(x, weight, 1e-5)
    loops = [y, fused.swiglu_forward(x, u), *fused.swiglu_backward(x, u, grad)]
    loops += fused.rms_norm_backward(x, weight, rstd, grad, True)
    y_eager, rstd_eager = fused.rms_norm_formula(x, weight, 1e-5)
    rows = [t.reshape(-1, shape[-1]) for t in (x, u, grad)]
    formulas = [y_eager, fused.swiglu_formula(x, u), *fused._swiglu_backward.__wrapped__(*rows)]
    formulas += fused._rms_norm_backward.__wrapped__(rows[0], weight, rstd_eager.reshape(-1, 1), rows[2], True)
    assert torch.allclose(rstd, rstd_eager, rtol=2e-6, atol=0)  # 1/rms in float32: a few ulps
    for name, a, b in zip(["norm", "swiglu", "d/dg", "d/du", "norm dx", "norm d/dweight"], loops, formulas):
        assert a.dtype == b.dtype == torch.bfloat16, name
        ulps = bf16_ulps(a, b.view(a.shape))
        assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.01, (name, ulps.max(), (ulps > 0).float().mean())


def test_loops_at_the_ends_of_the_range():
    """Gates far beyond where sigmoid saturates, up to bf16's largest values, and rows whose squares overflow float32:
    the formulas' values, no NaN (the loops are compiled with -ffast-math, which assumes no infinities)."""
    if fused._loops() is None:
        pytest.skip("no C compiler here")
    ends = [1e4, 200.0, 100.0, 88.0, 20.0, 1e-3, 0.0, 3e38]
    g = torch.tensor([[v for e in ends for v in (e, -e)]]).bfloat16()
    u, grad = torch.full_like(g, 0.5), torch.full_like(g, -0.75)  # products within range at 3e38
    x = torch.tensor(
        [[1e30, -2e30, 3e30, 1.0], [0.0] * 4, [3e38, 1.0, 1.0, 1.0], [1e-30, 2e-38, 0.0, 1e-38]]
    ).bfloat16()
    weight = torch.tensor([1.0, 0.5, 2.0, 1.0]).bfloat16()
    y, rstd = fused.rms_norm_forward(x, weight, 1e-5)
    y_eager, rstd_eager = fused.rms_norm_formula(x, weight, 1e-5)
    loops = [fused.swiglu_forward(g, u), *fused.swiglu_backward(g, u, grad), y]
    loops += fused.rms_norm_backward(x, weight, rstd, torch.ones_like(x), True)
    formulas = [fused.swiglu_formula(g, u), *fused._swiglu_backward.__wrapped__(g, u, grad), y_eager]
    formulas += fused._rms_norm_backward.__wrapped__(x, weight, rstd_eager, torch.ones_like(x), True)
    for a, b in zip(loops, formulas):
        assert not a.isnan().any() and bf16_ulps(a, b).max() <= 1, (a, b)


def test_without_a_c_compiler_one_warning_and_the_compiled_formulas(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fused._loops.cache_clear()
    try:
        g, u = (torch.randn(4, 96, generator=torch.Generator().manual_seed(i)).bfloat16() for i in (1, 2))
        assert fused.active(g, u)  # the compiled formulas take them
        with pytest.warns(UserWarning, match="RMSNorm and SwiGLU run as compiled formulas: building elementwise.c"):
            out = fused.swiglu_forward(g, u)
        assert fused._loops() is None
        assert torch.equal(out, fused._swiglu_forward(g, u))
    finally:
        fused._loops.cache_clear()


def test_compile_failure_falls_back_to_eager_once(monkeypatch):
    """Without a working C++ compiler the compiled formulas warn once and run eagerly, with the same result."""
    monkeypatch.setattr(fused, "_broken", None)
    formula = fused._compiled(lambda t: t * 3.25 + 1.5)
    x = torch.arange(6, dtype=torch.bfloat16)
    # nothing compiled before may be reused (fx_graph_cache); inductor's own patch: its config is no plain module
    no_compiler = torch._inductor.config.patch({"fx_graph_cache": False, "cpp.cxx": ("/nonexistent/c++",)})
    with no_compiler, pytest.warns(UserWarning, match="torch.compile unavailable .*C\\+\\+ compiler") as record:
        assert torch.equal(formula(x), x * 3.25 + 1.5)
        assert torch.equal(formula(x), x * 3.25 + 1.5)
    assert len([w for w in record if "torch.compile unavailable" in str(w.message)]) == 1
    assert fused._broken
    monkeypatch.setattr(fused, "_loops", lambda: None)  # nor are the C loops built
    assert not fused.active(x)


THREAD_USE = """
import json, os, time, torch
torch.set_num_threads(2)
from lora_llama.kernels import fused

def cpu_ticks():  # user + system time of each thread of this process
    tasks = f"/proc/{os.getpid()}/task"
    def cpu_ticks(t):  # utime + stime, the 14th and 15th fields of /proc/.../stat
        return sum(map(int, open(f"{tasks}/{t}/stat").read().rsplit(")", 1)[1].split()[11:13]))

    return {t: cpu_ticks(t) for t in os.listdir(tasks)}

tiny = [torch.randn(8, 64).bfloat16() for _ in range(3)]
big = [torch.randn(2048, 1536).bfloat16() for _ in range(3)]
fused.swiglu_backward(*tiny)  # compiled from a tiny input first, as a test's model does
fused.swiglu_backward(*big)
before, start = cpu_ticks(), time.perf_counter()
while time.perf_counter() - start < 1.5:
    fused.swiglu_backward(*big)
after = cpu_ticks()
main_tid = str(os.getpid())
print(json.dumps({"main": after[main_tid] - before[main_tid],
                  "others": sum(after[t] - before.get(t, 0) for t in after if t != main_tid)}))
"""


@pytest.mark.skipif(
    (os.cpu_count() or 1) < 2 or not sys.platform.startswith("linux"),
    reason="needs two cores and Linux's per-thread CPU times",
)
@pytest.mark.slow
def test_compiled_formulas_use_every_thread_whatever_size_compiled_them(tmp_path):
    """A compiled loop first seen on a tiny input still splits a large one over the threads (inductor would
    otherwise leave it serial, and keep it so in its disk cache for every later run)."""
    ticks = helpers.fresh_python(THREAD_USE, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert ticks["others"] > 0.3 * ticks["main"], ticks


@pytest.mark.parametrize("scale", [1.0, 6.0], ids=["flat", "peaked"])  # scores of ~1, or of tens
# (BLOCK, KEYS, GROUP_TILE): one tile per block, all groups in one product; many tiles, one group at a time; many
# tiles, three groups a product (of 2 rows x 2 key/value heads: a product spans both rows' masks)
@pytest.mark.parametrize(
    "blocks", [(128, 2048, 4 << 20), (16, 24, 1), (16, 24, 3 * 24 * 16 * 3)], ids=["one-tile", "many-tiles", "3-groups"]
)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
# the forward's q·kᵀ as oneDNN bf16 products with float32 output (torch >= 2.9), or per group in float32
@pytest.mark.parametrize("bf16_sums", [True, False], ids=["batched-forward", "per-group-forward"])
def test_training_attention_in_bf16(monkeypatch, scale, blocks, packed, bf16_sums):
    """float32 scores and softmax, bf16 products (the lse and delta subtracted before rounding in backward)."""
    for name, value in zip(("BLOCK", "KEYS", "GROUP_TILE"), blocks):
        monkeypatch.setattr(blocked_attention, name, value)
    if bf16_sums and not blocked_attention._BF16_SUMS:
        pytest.skip("this torch has no torch.backends.mkldnn.matmul.fp32_precision")
    monkeypatch.setattr(blocked_attention, "_BF16_SUMS", bf16_sums)
    setting = torch.backends.mkldnn.matmul.fp32_precision if blocked_attention._BF16_SUMS else None
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, h, 70, 16, generator=g).mul(s).bfloat16().requires_grad_()
        for h, s in ((6, scale), (2, 1.0), (2, 1.0))
    )
    segments = torch.tensor([[0] * 30 + [1] * 40, [0] * 10 + [1] * 25 + [2] * 35]) if packed else None
    out = attend(q, k, v, causal=True, segments=segments)
    assert out.grad_fn.name() == "_CausalAttentionBackward" and out.dtype == torch.bfloat16
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    check(lambda a, b, c: attend(a, b, c, causal=True, segments=segments), (q, k, v), (q64, k64, v64))
    if setting is not None:  # the process-wide setting is back as it was
        assert torch.backends.mkldnn.matmul.fp32_precision == setting


@pytest.mark.parametrize("scale", [1.0, 6.0], ids=["flat", "peaked"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_flash_forward_in_bf16(monkeypatch, scale, packed):
    """aten's flash forward (what a CPU with AMX runs on unpacked rows) with the blocked backward: its base-2
    log-sum-exp is what the backward's recomputed probabilities need, so the gradients match float64 too. It runs on
    any CPU (AMX only makes it fast)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    calls = []
    monkeypatch.setattr(attention, "FLASH_FORWARD", lambda *a: calls.append(a[0].shape) or op(*a))
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(2, h, 70, 16, generator=g).mul(s).bfloat16().requires_grad_()
        for h, s in ((6, scale), (2, 1.0), (2, 1.0))
    )
    segments = torch.tensor([[0] * 30 + [1] * 40, [0] * 70]) if packed else None
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    check(lambda a, b, c: attend(a, b, c, causal=True, segments=segments), (q, k, v), (q64, k64, v64))
    assert len(calls) == (0 if packed else 1)  # packed rows: the blocked forward, which hides earlier examples' keys
    out, lse = attention.causal_attention(q.detach(), k.detach(), v.detach(), segments)
    monkeypatch.setattr(attention, "FLASH_FORWARD", None)
    out_blocked, lse_blocked = attention.causal_attention(q.detach(), k.detach(), v.detach(), segments)
    assert out.transpose(1, 2).is_contiguous() and lse.is_contiguous() and lse.dtype == torch.float32
    assert rel(out, out_blocked) < BF16, rel(out, out_blocked)
    assert torch.allclose(lse, lse_blocked, atol=1e-3), (lse - lse_blocked).abs().max()  # both base 2


def test_flash_forward_only_with_amx(monkeypatch):
    for found, chosen in ((["AMX_BF16", "AVX512_BF16"], True), (["AVX512_BF16"], False), ([], False)):
        monkeypatch.setattr(attention, "cpu_bf16_instructions", lambda: found)
        assert (attention._amx_flash_forward() is not None) == chosen, found


def test_products_and_chunked_loss_in_bf16(monkeypatch):
    monkeypatch.setattr(loss_module, "BF16_CHUNK_ELEMENTS", 300 * 16)  # 40 rows: 3 chunks of products
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 300 * 8)  # each chunk's float32 work in two passes
    x, x64 = pair(33, 64)
    w, w64 = pair(48, 64, seed=1, scale=0.1)
    assert rel(linear(x.detach(), w.detach()), x64.detach() @ w64.detach().T) < BF16
    h, h64 = pair(40, 64, seed=2)
    head = torch.nn.Linear(64, 300, bias=False).bfloat16().requires_grad_(False)
    head64 = torch.nn.Linear(64, 300, bias=False).double().requires_grad_(False)
    head64.weight.copy_(head.weight.double())
    t = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3))
    loss, ref = linear_cross_entropy(h, head.weight, t), F.cross_entropy(h64 @ head64.weight.T, t, reduction="sum")
    assert loss.dtype == torch.float32 and abs(float(loss) / float(ref) - 1) < 1e-3  # the loss itself in float32
    (gh,), (ref_gh,) = torch.autograd.grad(loss, (h,)), torch.autograd.grad(ref, (h64,))
    assert rel(gh, ref_gh) < BF16


def lora_layers(dtype, lora_dtype=torch.float32, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for out in (64, 32, 32)[:n]:
        base = torch.nn.Linear(64, out, bias=True).requires_grad_(False)
        base.weight.copy_(torch.randn(out, 64, generator=g) * 0.1)
        base.bias.copy_(torch.randn(out, generator=g) * 0.1)
        layer = LoRALinear(base.to(dtype), r=4, alpha=8)
        layer.lora_A.weight.data = (torch.randn(4, 64, generator=g) * 0.1).to(lora_dtype)
        layer.lora_B.weight.data = (torch.randn(out, 4, generator=g) * 0.1).to(lora_dtype)
        layers.append(layer)
    return layers


def run(layers, x, fused: bool):
    if not fused:  # the plain path: each layer on its own, the A and B products in float32
        for m in layers:
            m.low_rank_node = lambda _x: None
    ys = project(x, layers)
    loss = sum((y.double() * torch.linspace(-1, 1, y.shape[-1], dtype=torch.float64)).sum() for y in ys)
    params = [p for m in layers for p in (m.lora_A.weight, m.lora_B.weight)]
    return ys, torch.autograd.grad(loss, [x, *params])


@pytest.mark.parametrize("fused", [True, False])
def test_lora_paths_in_bf16_match_float64(fused):
    """bf16 base and activations, float32 A and B (returned float32 gradients), against everything in float64."""
    x, x64 = pair(2, 5, 64, seed=7)
    ys, grads = run(lora_layers(torch.bfloat16), x, fused)
    ys64, grads64 = run(lora_layers(torch.float64, torch.float64), x64, True)
    for y, y64 in zip(ys, ys64):
        assert y.dtype == torch.bfloat16 and rel(y, y64) < BF16
    assert grads[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads[1:])
    for g, g64 in zip(grads, grads64):
        assert rel(g, g64) < BF16, rel(g, g64)


def test_fused_node_runs_under_bf16_mixed(tiny_ckpt):
    model = load_model(tiny_ckpt, dtype=torch.bfloat16)
    apply_lora(model, lora_settings(r=4, alpha=8, targets=list(BLOCK_LINEARS)))
    x = torch.randn(1, 3, 64).bfloat16()
    attn = model.model.layers[0].self_attn
    assert all(m.lora_A.weight.dtype == torch.float32 for m in lora_modules(model).values())
    assert all(m.low_rank_node(x.view(-1, 64)) is not None for m in (attn.q_proj, attn.k_proj, attn.v_proj))
