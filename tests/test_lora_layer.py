"""One LoRALinear against the written-out formula: the fused node, autocast, layers sharing an input, fold by hand."""

import pytest
import torch


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_needs_grad", [True, False])
def test_fused_lora_layer_matches_the_written_out_formula(bias, x_needs_grad):
    """The one-node LoRA layer (frozen float base, no dropout) against y = x·W0ᵀ + b + s·x·Aᵀ·Bᵀ by autograd."""
    from lora_llama.lora.layer import LoRALinear

    torch.manual_seed(0)
    layer = LoRALinear(torch.nn.Linear(12, 7, bias=bias), r=3, alpha=6)
    layer.base_layer.requires_grad_(False)
    torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(2, 5, 12, requires_grad=x_needs_grad)
    assert layer.fused(x)
    gy = torch.randn(2, 5, 7)
    y = layer(x)
    y.backward(gy)
    got = [layer.lora_A.weight.grad, layer.lora_B.weight.grad] + ([x.grad] if x_needs_grad else [])

    w0, a, b = (
        layer.base_layer.weight,
        layer.lora_A.weight.detach().requires_grad_(),
        layer.lora_B.weight.detach().requires_grad_(),
    )
    x_ref = x.detach().requires_grad_(x_needs_grad)
    ref = x_ref @ w0.T + (layer.base_layer.bias if bias else 0) + 2.0 * (x_ref @ a.T) @ b.T
    ref.backward(gy)
    want = [a.grad, b.grad] + ([x_ref.grad] if x_needs_grad else [])
    assert (y - ref).abs().max() < 1e-5
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 1e-5
    if not x_needs_grad:
        assert x.grad is None


def test_lora_layer_under_autocast():
    """bf16 autocast (the trainer's CUDA mode, CPU here) takes the unfused path: no dtype clash in the update."""
    from lora_llama.lora.layer import LoRALinear

    layer = LoRALinear(torch.nn.Linear(12, 7, bias=False), r=3, alpha=6)
    layer.base_layer.requires_grad_(False)
    x = torch.randn(5, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not layer.fused(x)
        y = layer(x)
    y.float().sum().backward()
    assert layer.lora_A.weight.grad is not None and (y.float() - layer.base_layer(x)).abs().max() < 0.1


def test_layers_sharing_an_input_run_as_one_node_with_the_same_gradients():
    """q, k, v (or gate, up) through `project`: outputs and gradients equal the layer-by-layer path,
    also with different ranks and an output that takes no part in the loss."""
    from lora_llama.lora.layer import LoRALinear
    from lora_llama.lora.layer import shared_input_projection as project

    torch.manual_seed(0)
    layers = [
        LoRALinear(torch.nn.Linear(12, out, bias=bias), r=r, alpha=4)
        for out, r, bias in [(12, 2, False), (6, 3, True), (6, 2, False)]
    ]
    for m in layers:
        m.base_layer.requires_grad_(False)
        torch.nn.init.normal_(m.lora_B.weight)
    x = torch.randn(2, 5, 12, requires_grad=True)
    results = []
    for grouped in (True, False):
        x.grad = None
        for m in layers:
            m.zero_grad()
        ys = project(x, layers) if grouped else [m(x) for m in layers]
        (ys[0].square().sum() + ys[1].sum()).backward()  # ys[2] unused: no gradient reaches it
        results.append(
            [y.detach() for y in ys]
            + [x.grad]
            + [p.grad.clone() for m in layers for p in (m.lora_A.weight, m.lora_B.weight) if p.grad is not None]
        )
    assert len(results[0]) == len(results[1]) == 3 + 1 + 4
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fold_hand_computed():
    from lora_llama.lora.layer import fold

    w0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    lora_a, lora_b = torch.tensor([[1.0, -1.0]]), torch.tensor([[2.0], [0.5]])  # B·A = [[2, -2], [0.5, -0.5]]
    want = torch.tensor([[1.0 + 3 * 2, 2.0 - 3 * 2], [3.0 + 3 * 0.5, 4.0 - 3 * 0.5]])
    assert torch.equal(fold(w0, lora_a, lora_b, 3.0), want)
    assert torch.equal(w0, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # left as it was
    assert torch.equal(fold(w0.bfloat16(), lora_a, lora_b, 3.0), want)  # float32 arithmetic, float32 result
    mine = w0.clone()
    assert fold(mine, lora_a, lora_b, 3.0, inplace=True) is mine and torch.equal(mine, want)
    assert torch.equal(fold(want, lora_a, lora_b, -3.0), w0)  # the unmerge
