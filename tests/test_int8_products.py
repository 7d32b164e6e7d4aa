"""int8 x int8 products (model.int8_products): against hand-computed integer products, within the bound per-row int8
rounding of the activations allows of the dequantized product, and wired to the gate and up projections only."""

import pytest
import torch

from lora_llama import LoraSettings, apply_lora, load_model
from lora_llama.kernels import fused
from lora_llama.quant import int8_products
from lora_llama.quant.formats import quantize_int8
from lora_llama.quant.handlers import Int8
from lora_llama.quant.linear import QuantizedLinear


def by_hand(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows of x rounded to int8 at absmax / 127, the products summed exactly in int64, scaled back in float32."""
    s = x.float().abs().amax(1, keepdim=True) / 127
    q = (x.float() / s).round()
    sums = (q.long() @ codes.long().t()).float()
    return (sums * s * scales[None, :]).bfloat16()


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x·wᵀ - qx·wᵀ|: each activation rounded by at most half its row's step, times the row of |w|, plus the
    output's own bf16 rounding."""
    step = x.float().abs().amax(1, keepdim=True) / 127
    exact = x.float() @ w.t()
    return step / 2 @ w.abs().sum(1, keepdim=True).t() + exact.abs() * 2**-8


@pytest.fixture
def layer():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g) * 0.1
    codes, scales = quantize_int8(w)
    x = (torch.randn(10, 40, generator=g) * 2).bfloat16()
    return x, codes, scales, codes.float() * scales[:, None]


def test_product_is_the_integer_product_scaled_back(layer):
    x, codes, scales, w = layer
    got = int8_products.product(x, codes, scales)
    assert fused._broken is None and got.dtype == torch.bfloat16
    want = by_hand(x, codes, scales)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-8).all()  # one bf16 rounding apart
    assert ((got.float() - x.float() @ w.t()).abs() <= bound(x, w)).all()


def test_input_gradient_folds_the_weight_scales_into_the_rows(layer):
    x, codes, scales, w = layer
    gy = torch.randn(10, 24, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = int8_products.input_gradient(gy, codes, scales)
    scaled = gy.float() * scales[None, :]  # gy·W = (gy·diag(s))·Wq
    want = by_hand(scaled, codes.t().contiguous(), torch.ones(40))
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-8).all()
    assert ((got.float() - gy.float() @ w).abs() <= bound(gy.float(), w.t())).all()


def test_the_layer_runs_int8_products_where_set_and_keeps_nothing_for_backward(layer):
    x, codes, scales, w = layer
    q = QuantizedLinear(40, 24, "int8", codes, scales, bias=torch.randn(24))
    q.integer_products = True
    xx = x[None].clone().requires_grad_()
    y = q(xx)
    node = y.grad_fn.next_functions[0][0]  # under the view back to (1, 10, 24)
    assert node.name() == "Int8ProductBackward" and not node.saved_tensors
    want = int8_products.product(x, codes, scales).add_(q.bias.bfloat16())
    assert torch.equal(y[0], want)
    y.backward(torch.ones_like(y))
    assert torch.equal(xx.grad[0], int8_products.input_gradient(torch.ones(10, 24).bfloat16(), codes, scales))
    q.integer_products = False  # the dequantized product
    assert q(xx).grad_fn.name() == "_QuantizedProductBackward"
    assert not int8_products.applies(x.float()) and not int8_products.applies(x.to("meta"))


def test_only_gate_and_up_take_it_and_lora_on_them_trains(tiny_ckpt, monkeypatch):
    calls = []
    run = int8_products.int8_linear
    monkeypatch.setattr(int8_products, "int8_linear", lambda *a: calls.append(a[1].shape) or run(*a))
    model = load_model(tiny_ckpt, dtype=torch.bfloat16, quantize=Int8(products=True))
    block = model.model.layers[0]
    taken = {n: getattr(block.mlp, n).integer_products for n in ("gate_proj", "up_proj", "down_proj")}
    assert taken == {"gate_proj": True, "up_proj": True, "down_proj": False}
    assert not block.self_attn.q_proj.integer_products
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=["gate", "up", "down"]))
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    model(ids).float().sum().backward()
    inter, hidden = block.mlp.gate_proj.base_layer.out_features, block.mlp.gate_proj.in_features
    assert calls == [(inter, hidden)] * 2 * len(model.model.layers)  # gate and up, under their adapters
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())


def test_int8_products_need_an_int8_base():
    from lora_llama import UserError
    from lora_llama.recipe.schema import load_recipe

    with pytest.raises(UserError, match="int8_products needs model.quantize int8"):
        load_recipe(None, ["model.quantize=nf4", "model.int8_products=true"])
    assert load_recipe(None, ["model.quantize=int8", "model.int8_products=true"]).model.int8_products


def test_training_and_eval_share_one_compiled_quantization(layer, monkeypatch):
    """x requires grad in training and not in eval: one compiled loop serves both, where dynamo would compile a
    graph for each (each compile costs seconds and resident memory)."""
    import torch._dynamo

    x, codes, scales, _ = layer
    torch._dynamo.reset()  # graphs compiled by earlier tests would hide a recompile
    monkeypatch.setattr(fused, "_broken", None)  # a recompile would set it (and fall back to eager)
    with torch._dynamo.config.patch(error_on_recompile=True):
        with torch.no_grad():
            evaluated = int8_products.int8_linear(x, codes, scales, None)
        trained = int8_products.int8_linear(x.clone().requires_grad_(), codes, scales, None)
    assert fused._broken is None and torch.equal(trained, evaluated)
