"""The chunked target-only cross-entropy against PyTorch's full-logits cross-entropy."""

import pytest
import torch
import torch.nn.functional as F

from helpers import ALL
from lora_llama.kernels import cross_entropy as loss
from lora_llama.objectives.token_losses import target_loss


@pytest.mark.parametrize("weight_grad", [False, True])
def test_chunked_loss_and_gradients_equal_full_logits(monkeypatch, weight_grad):
    monkeypatch.setattr(loss, "CHUNK_ELEMENTS", 4 * 50)  # 4 rows per chunk: 11 rows = 3 chunks, the last partial
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight.requires_grad_(weight_grad)
    h = torch.randn(11, 16, requires_grad=True)
    targets = torch.randint(0, 50, (11,))
    got = loss.linear_cross_entropy(h, head.weight, targets)
    got.backward(torch.tensor(0.5))
    grads = [h.grad] + ([head.weight.grad] if weight_grad else [])

    h_ref = h.detach().requires_grad_()
    w_ref = head.weight.detach().requires_grad_(weight_grad)
    want = F.cross_entropy(h_ref @ w_ref.T, targets, reduction="sum")
    want.backward(torch.tensor(0.5))
    assert abs(got.item() - want.item()) < 1e-4
    for g, w in zip(grads, [h_ref.grad] + ([w_ref.grad] if weight_grad else [])):
        assert (g - w).abs().max() < 1e-5


def test_target_loss_with_masked_prompts_equals_transformers(tiny_ckpt):
    """Completion-only labels: the last block runs its MLP at the predicting positions only;
    loss and gradients of every weight (last block included) against transformers' full forward."""
    from helpers import hf_model
    from lora_llama import load_model

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (3, 20), generator=g)
    labels = ids.clone()
    labels[:, :9] = -100  # prompts
    labels[1, 15] = -100  # a hole inside a completion
    labels[2] = -100  # a row with no target at all
    model = load_model(tiny_ckpt).train()
    total, n = target_loss(model, ids, labels)
    (total / n).backward()
    ref = hf_model(tiny_ckpt).train()
    ref_loss = ref(input_ids=ids, labels=labels).loss
    ref_loss.backward()
    assert n == 2 * 11 - 1 and abs(total.item() / n - ref_loss.item()) < 1e-5
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad - grads[name].grad).abs().max() < 1e-5, name


@pytest.mark.parametrize("checkpointing", [False, True])
def test_batch_without_targets_gives_zero_loss_and_zero_gradients(tiny_ckpt, checkpointing):
    """All labels -100 (a micro-batch of prompts only): the last block runs on no rows at all."""
    from lora_llama import LoraSettings, apply_lora, load_model

    model = load_model(tiny_ckpt).train()
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    model.gradient_checkpointing = checkpointing
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(4))
    total, n = target_loss(model, ids, torch.full_like(ids, -100))
    total.backward()
    assert n == 0 and total.item() == 0.0
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is None or not g.any() for g in grads)


LIGER_AGAINST_OURS = """
import torch
from lora_llama.kernels import cross_entropy as loss

torch.manual_seed(0)
for weight_grad in (False, True):
    h = torch.randn(37, 64, requires_grad=True)
    weight = (torch.randn(300, 64) * 0.2).requires_grad_(weight_grad)
    targets = torch.randint(0, 300, (37,))
    results = []
    for kernel in (loss.liger_cross_entropy, loss.linear_cross_entropy):
        h.grad = weight.grad = None
        total = kernel(h, weight, targets)
        total.backward(torch.tensor(0.5))
        results.append([total.detach(), h.grad.clone()] + ([weight.grad.clone()] if weight_grad else []))
    for theirs, ours in zip(*results):
        scale = ours.abs().max()
        assert (theirs - ours).abs().max() <= 1e-5 * max(1.0, float(scale)), (weight_grad, theirs, ours)
print("equal")
"""


def test_ligers_fused_loss_equals_ours_under_the_triton_interpreter():
    """liger-kernel's fused linear cross-entropy (the GPU's loss) against ours on the CPU, through Triton's
    interpreter (which must be chosen before Triton loads: a process of its own): the sum and both gradients
    within 1e-5 in float32."""
    import os
    import subprocess
    import sys

    pytest.importorskip("liger_kernel")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", LIGER_AGAINST_OURS], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "equal", r.stderr[-3000:]
