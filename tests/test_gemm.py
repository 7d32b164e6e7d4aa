"""gemm.linear (oneDNN on CPU float32) against float64 products, and which path it takes."""

import pytest
import torch

from lora_llama.kernels import gemm
from lora_llama.model.linears import run_linear

needs_onednn = pytest.mark.skipif(gemm._ONEDNN is None, reason="this torch build has no oneDNN linear")


@pytest.fixture
def calls(monkeypatch):
    """Counts the products that went through oneDNN."""
    seen = []
    if gemm._ONEDNN is not None:
        op = gemm._ONEDNN
        monkeypatch.setattr(gemm, "_ONEDNN", lambda *a: seen.append(a[0].shape) or op(*a))
    return seen


def case(shape, out_features, g):
    x = torch.randn(*shape, generator=g)
    w = torch.randn(out_features, shape[-1], generator=g) / shape[-1] ** 0.5
    return x, w


@needs_onednn
def test_values_of_every_layout_the_training_step_uses(calls):
    g = torch.Generator().manual_seed(0)
    x, w = case((2, 37, 48), 80, g)
    b = torch.randn(80, generator=g)
    gy = torch.randn(50, 80, generator=g)
    wide = torch.randn(50, 100, generator=g)
    products = {
        "x·Wᵀ + b, 3-D x": (gemm.linear(x, w, b), x.double() @ w.double().t() + b.double()),
        "gy·W (W.t() as a view)": (gemm.linear(gy, w.t()), gy.double() @ w.double()),
        "columns of a wider x": (gemm.linear(wide[:, 10:58], w), wide[:, 10:58].double() @ w.double().t()),
    }
    for name, (got, want) in products.items():
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert (got.double() - want).abs().max() < 1e-5, name
    assert len(calls) == 3  # all of them went through oneDNN


def test_other_cases_take_f_linear_with_the_same_values(calls):
    g = torch.Generator().manual_seed(1)
    x, w = case((20, 48), 16, g)
    for xi, wi in [(x.double(), w.double()), (x.half(), w.half()), (x.t().contiguous().t(), w)]:
        got = gemm.linear(xi, wi)
        assert got.dtype == xi.dtype
        tol = 5e-2 if xi.dtype == torch.half else 1e-5
        assert (got.double() - x.double() @ w.double().t()).abs().max() < tol
    assert torch.equal(gemm.linear(x[:, :0], w[:, :0]), torch.zeros(20, 16))  # an empty sum: zeros
    assert calls == []  # float64, float16, an x transposed in memory (oneDNN would copy it), in = 0 skip oneDNN
    got = gemm.linear(x.bfloat16(), w.bfloat16())  # bf16-mixed's products: oneDNN, float32 accumulation
    assert len(calls) == (torch.bfloat16 in gemm.ONEDNN_DTYPES) and got.dtype == torch.bfloat16  # AVX2 CPUs: F.linear
    assert (got.double() - x.bfloat16().double() @ w.bfloat16().double().t()).abs().max() < 5e-2
    gy = torch.randn(20, 16, generator=g).bfloat16()  # bf16's gy·W, W.t() a view: row-major first where F.linear
    got = gemm.linear(gy, w.bfloat16().t())  # takes it (its kernel for the view is ~70x slower)
    assert got.dtype == torch.bfloat16 and (got.double() - gy.double() @ w.bfloat16().double()).abs().max() < 5e-2


def test_frozen_linear_gives_autograds_values_and_input_gradient_and_keeps_hooks(calls):
    g = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(48, 80).requires_grad_(False)
    x = torch.randn(3, 5, 48, generator=g, requires_grad=True)
    gy = torch.randn(3, 5, 80, generator=g)
    y = run_linear(layer, x)
    (gx,) = torch.autograd.grad(y, x, gy)
    y_ref = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert (y.double() - y_ref).abs().max() < 1e-5
    assert (gx.double() - gy.double() @ layer.weight.double()).abs().max() < 1e-5
    assert y.grad_fn.name() == "_FrozenLinearBackward"
    assert len(calls) == (2 if gemm._ONEDNN is not None else 0)  # forward and input gradient

    seen = []
    layer.register_forward_hook(lambda m, i, o: seen.append(o))
    assert torch.equal(run_linear(layer, x), seen[0])  # a hooked layer is called as a module


def test_trainable_linear_is_left_to_autograd():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8)
    run_linear(layer, x).sum().backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None


@needs_onednn
def test_under_torch_compile_the_products_still_go_through_onednn(calls):
    g = torch.Generator().manual_seed(3)
    x, w = case((6, 48), 16, g)
    compiled = torch.compile(lambda x, w: gemm.linear(gemm.linear(x, w), w.t()), fullgraph=True)
    got = compiled(x, w)
    assert (got.double() - x.double() @ w.double().t() @ w.double()).abs().max() < 1e-5
    assert len(calls) == 2
