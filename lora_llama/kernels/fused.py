"""bfloat16 elementwise math of a CPU training step (RMSNorm, SwiGLU) as one loop each: C loops (elementwise.c), or
loops compiled by torch.compile's inductor where those are not built; `compiled`, every torch.compile of the package.

PyTorch's eager kernels take a bf16 formula one operation at a time, each a pass over memory that converts to float32
and back: no faster per element than float32 on the CPU, so they cap what bf16 gains over a float32 step. One loop per
formula keeps the conversions in registers. On AMD EPYCs with AVX512_BF16 (2 threads; forward plus backward): RMSNorm
(4, 512, 576) 1.53 ms eager, 0.28-0.51 compiled, 0.39 in C; SwiGLU (2048, 1536) 3.4 eager, 2.3-2.6 compiled, 2.3 in
C; the bf16 training step 6.8% faster compiled than eager (paired), the float32 one unchanged, so float32 and other
devices keep the eager kernels. The C loops also spare each call the ~0.2 ms that calling a compiled function costs
(a 135M step makes ~200 such calls) and the first step its compiling.

The formulas are the eager kernels' (elementwise.py), float32 inside. elementwise.c is built for this CPU on first use
(kernels/cpu.py); a compiled formula compiles on first use (seconds; inductor keeps them on disk for later runs), with
dynamic shapes (a new row count is no new compile). Where building or compiling fails (no C or C++ compiler, an
unsupported build), a warning says so once and the next kernel runs: compiled, then eager. `compiled` also serves
quant/linear.py, whose dequantization compiles on CUDA, and the model's compiled blocks.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from lora_llama.kernels.cpu import c_library_or_none, pointers

ENABLED = True  # tests switch it off to compare with the eager kernels
LOOPS = Path(__file__).with_name("elementwise.c")
_broken: str | None = None  # why compiling failed, once it has


def compiling() -> bool:
    """Whether compiled formulas run: outside an enclosing torch.compile (which fuses the eager formulas itself),
    while compiling works."""
    return ENABLED and _broken is None and not torch.compiler.is_compiling()


def active(*tensors: torch.Tensor) -> bool:
    """Whether the bf16 loops take these tensors: bf16 on the CPU, outside an enclosing torch.compile, while the C loops
    are built or compiling works."""
    bf16_cpu = all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in tensors)
    return bf16_cpu and ENABLED and not torch.compiler.is_compiling() and (_broken is None or _loops() is not None)


@functools.cache
def _loops() -> ctypes.CDLL | None:
    """elementwise.c built and loaded; None (and one warning) where building fails."""
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    signatures = {
        "rms_norm_forward": [pointer, pointer, ctypes.c_float, pointer, pointer, count, count],
        "rms_norm_backward": [pointer] * 5 + [count, count],
        "rms_norm_weight_grad": [pointer] * 4 + [count, count],
        "swiglu_forward": [pointer] * 3 + [count],
        "swiglu_backward": [pointer] * 5 + [count],
    }
    return c_library_or_none(LOOPS, "bf16 RMSNorm and SwiGLU run as compiled formulas", signatures)


def made_once(make):
    """make(*args) cached by its (hashable) arguments, for a constant tensor made once per device (a GPU would copy
    it from the host, and wait, on every call); inside torch.compile, make itself: a constant of the kernel."""
    cached = functools.lru_cache(maxsize=None)(make)

    @functools.wraps(make)
    def get(*args):
        return make(*args) if torch.compiler.is_compiling() else cached(*args)

    return get


_strict = False  # whether strict_compiling() holds


@contextlib.contextmanager
def strict_compiling():
    """torch.compile's failures raised where `compiled` can fall back from them: the backward compiled together with
    the forward (inductor otherwise compiles it lazily, inside backward(), past any fallback), and a recompile past
    dynamo's limit raised (otherwise that call runs eager without a word from us). A forward pass enters it once
    for all the compiled calls inside it; a call outside one enters it alone (~6 µs)."""
    global _strict
    if _strict:
        yield
        return
    import torch._dynamo  # imported by torch.compile anyway; by now the first compile has done it
    import torch._functorch.config as functorch

    saved = functorch.force_non_lazy_backward_lowering, torch._dynamo.config.fail_on_recompile_limit_hit
    functorch.force_non_lazy_backward_lowering = torch._dynamo.config.fail_on_recompile_limit_hit = True
    _strict = True
    try:
        yield
    finally:
        _strict = False
        functorch.force_non_lazy_backward_lowering, torch._dynamo.config.fail_on_recompile_limit_hit = saved


_past_limit_said = False  # whether a recompile past the limit has been reported


def _past_recompile_limit(e: Exception, slower: str) -> bool:
    """Whether e is dynamo's recompile limit (said once: that call, and each new shape after it, runs eager)."""
    global _past_limit_said
    if type(e).__name__ != "FailOnRecompileLimitHit":
        return False
    if not _past_limit_said:
        _past_limit_said = True
        warnings.warn(
            "torch.compile reached its recompile limit (more input shapes than graphs it keeps); calls of new "
            f"shapes run PyTorch's eager kernels ({slower})",
            stacklevel=3,
        )
    return True


def compiled(fn, slower: str, graphs: int | None = None, **compile_args):
    """fn (a function, or a module such as a decoder block) through torch.compile(**compile_args), compiled on first
    use (forward and backward together, under strict_compiling); on a compile failure, a warning once (saying what
    runs `slower`) and fn itself, then and from then on, for everything compiled here; past dynamo's recompile
    limit, a warning once and fn for the calls of new shapes. `graphs`: how many graphs fn may compile (dynamo's
    recompile limit, 8, raised for each call: the patch costs ~40 µs a call, so only a formula that needs more,
    one graph per format and dtype, asks for it)."""
    compiled_fn = None

    def run(*args, **kwargs):
        global _broken
        nonlocal compiled_fn
        if _broken is None:
            try:
                if compiled_fn is None:  # torch.compile imports dynamo (~2 s): only once a formula is needed
                    compiled_fn = torch.compile(fn, **compile_args)
                with strict_compiling():
                    if graphs is None:
                        return compiled_fn(*args, **kwargs)
                    with torch._dynamo.config.patch(recompile_limit=graphs):
                        return compiled_fn(*args, **kwargs)
            except Exception as e:  # inductor's compiler errors have no common base; a real error repeats in fn
                if _past_recompile_limit(e, slower):
                    return fn(*args, **kwargs)
                # dynamo's wrapper reads "backend='inductor' raised:" and then the cause
                lines = [line for line in str(e).splitlines() if line.strip() and not line.endswith("raised:")]
                _broken = lines[0][:200] if lines else type(e).__name__
                warnings.warn(
                    f"torch.compile unavailable ({_broken}); using PyTorch's eager kernels ({slower})", stacklevel=2
                )
        return fn(*args, **kwargs)

    return functools.wraps(fn, updated=())(run)  # a module's own attributes stay its own


# dynamic threads: with dynamic shapes one loop serves every size, and inductor leaves it serial for good if the
# first input was small (a test's tiny model: seen here running SwiGLU's backward on one thread of two in later
# full-size steps, from inductor's disk cache); with this the loop always has a parallel region and OpenMP splits
# it at run time
_compiled = functools.partial(
    compiled, slower="bf16 training on the CPU runs slower", dynamic=True, options={"cpp.dynamic_threads": True}
)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (rows, n), detached: one compile per formula, where inputs of rank 2 and 3, views and requires_grad
    each made dynamo compile again during the first step (they run inside autograd Functions or under no_grad, so
    nothing needs their graph). Alone, inductor's 2-D loops also ran ~2x faster than its 3-D ones (SwiGLU (4, 512,
    1536) forward 1.28 vs 0.67 ms); in the training step their time did not change."""
    return t.reshape(-1, t.shape[-1]).detach()


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight · x/rms(x), 1/rms(x) (..., 1)), x/rms in float32 and cast back before the weight, as HF does."""
    lib = _loops() if weight.dtype == torch.bfloat16 else None
    if lib is None:
        y, rstd = _rms_norm_forward(_rows(x), weight, eps)
    else:
        rows, weight = _rows(x).contiguous(), weight.detach().contiguous()
        y, rstd = torch.empty_like(rows), torch.empty(rows.shape[0], dtype=torch.float32)
        lib.rms_norm_forward(*pointers(rows, weight), eps, *pointers(y, rstd), *rows.shape)
    return y.view(x.shape), rstd.view(*x.shape[:-1], 1)


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dx = (gw - x̂·mean(gw·x̂))·rstd with x̂ = x·rstd, gw = grad·weight (kernels._RMSNorm), and, if asked,
    the weight's gradient Σ grad·x̂ over the rows."""
    lib = _loops() if weight.dtype == torch.bfloat16 else None
    if lib is None:
        dx, grad_w = _rms_norm_backward(_rows(x), weight, _rows(rstd), _rows(grad), weight_grad)
        return dx.view(x.shape), grad_w
    rows, weight, rstd, grad = (_rows(t).contiguous() for t in (x, weight, rstd, grad))
    dx, grad_w = torch.empty_like(rows), None
    lib.rms_norm_backward(*pointers(rows, weight, rstd, grad, dx), *rows.shape)
    if weight_grad:
        grad_w = torch.empty(rows.shape[1], dtype=torch.float32)
        lib.rms_norm_weight_grad(*pointers(rows, rstd, grad, grad_w), *rows.shape)
        grad_w = grad_w.to(weight.dtype)
    return dx.view(x.shape), grad_w


def swiglu_forward(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    lib = _loops()
    if lib is None:
        return _swiglu_forward(_rows(g), _rows(u)).view(g.shape)
    rows = [_rows(t).contiguous() for t in (g, u)]
    out = torch.empty_like(rows[0])
    lib.swiglu_forward(*pointers(*rows, out), g.numel())
    return out.view(g.shape)


def swiglu_backward(g: torch.Tensor, u: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d/dg, d/du) of silu(g)·u."""
    lib = _loops()
    if lib is None:
        dg, du = _swiglu_backward(_rows(g), _rows(u), _rows(grad))
        return dg.view(g.shape), du.view(u.shape)
    rows = [_rows(t).contiguous() for t in (g, u, grad)]
    dg, du = torch.empty_like(rows[0]), torch.empty_like(rows[1])
    lib.swiglu_backward(*pointers(*rows, dg, du), g.numel())
    return dg.view(g.shape), du.view(u.shape)


# the formulas: plain (a compiled decoder block inlines them) and compiled on (rows, n) tensors
def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight · x/rms(x), 1/rms(x)): x/rms in float32, cast back before the weight, as HF does."""
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight, rstd


def swiglu_formula(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g)·u in float32, cast back."""
    return (F.silu(g.float()) * u.float()).to(g.dtype)


_rms_norm_forward = _compiled(rms_norm_formula)
_swiglu_forward = _compiled(swiglu_formula)


@_compiled
def _rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x_hat = x.float() * rstd
    gradf = grad.float()
    gw = gradf * weight.float()
    c = (gw * x_hat).mean(-1, keepdim=True)
    grad_w = (gradf * x_hat).sum(0).to(weight.dtype) if weight_grad else None
    return ((gw - x_hat * c) * rstd).to(x.dtype), grad_w


@_compiled
def _swiglu_backward(g: torch.Tensor, u: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad·u·silu'(g) with silu'(g) = s·(1 + g·(1 - s)), s = sigmoid(g); grad·silu(g)."""
    gf, gradf = g.float(), grad.float()
    s = torch.sigmoid(gf)
    return (gradf * u.float() * s * (1 + gf * (1 - s))).to(g.dtype), (gradf * gf * s).to(u.dtype)
