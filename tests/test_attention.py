"""The CPU training attention (flash forward, blocked backward) against SDPA with k/v repeated per head."""
import pytest
import torch
import torch.nn.functional as F

from lora_llama import attention
from lora_llama.attention import _CausalAttention, attend


def qkv(B, H, H_kv, T, d, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, d, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()  # strided as in the model
    k, v = (torch.randn(B, H_kv, T, d, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("T", [1, 7, 70])  # 70: blocks of 32, 32 and a last one of 6
def test_values_and_gradients_match_sdpa(heads, T):
    H, H_kv = heads
    q, k, v = qkv(2, H, H_kv, T, 16)
    out = attend(q, k, v, causal=True)
    assert out.grad_fn.name() == "_CausalAttentionBackward"  # the blocked backward is what runs here
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    rep = H // H_kv
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    expected = torch.autograd.grad(ref, (q, k, v), grad_out)
    assert (out - ref).abs().max() < 1e-12
    for g, e in zip(got, expected):
        assert g.shape == e.shape and (g - e).abs().max() < 1e-12


def test_gradcheck_across_block_boundaries(monkeypatch):
    monkeypatch.setattr(attention, "BLOCK", 3)  # T=8: blocks of 3, 3 and 2
    assert torch.autograd.gradcheck(_CausalAttention.apply, qkv(1, 4, 2, 8, 4))


def test_float32_close_to_sdpa_and_backward_twice():
    q, k, v = qkv(2, 6, 2, 70, 16, dtype=torch.float32)
    out = attend(q, k, v, causal=True)
    grad_out = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), grad_out)  # the saved tensors are left intact
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = torch.autograd.grad(ref, (q, k, v), grad_out)
    for a, b, e in zip(first, second, expected):
        assert torch.equal(a, b) and (a - e).abs().max() < 1e-4


def test_inference_and_other_devices_keep_sdpa():
    q, k, v = qkv(1, 4, 2, 5, 8)
    with torch.no_grad():
        assert attend(q, k, v, causal=True).grad_fn is None
    out = attend(q.detach(), k.detach(), v.detach(), causal=True)  # nothing to differentiate
    assert out.grad_fn is None
    fp16 = attend(*(t.detach().half().requires_grad_() for t in (q, k, v)), causal=True)
    assert fp16.grad_fn.name() != "_CausalAttentionBackward"


def test_long_sequences_keep_sdpa(monkeypatch):
    monkeypatch.setattr(attention, "MAX_LEN", 6)
    q, k, v = qkv(1, 4, 2, 7, 8)
    assert attend(q, k, v, causal=True).grad_fn.name() != "_CausalAttentionBackward"


@pytest.mark.parametrize("causal", [True, False])
def test_torch_without_enable_gqa_gets_repeated_key_values(monkeypatch, causal):
    q, k, v = qkv(2, 6, 2, 9, 8)
    mask = None if causal else torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    with torch.no_grad():
        want = attend(q, k, v, mask, causal=causal)  # this torch: enable_gqa
        monkeypatch.setattr(attention, "_SDPA_GQA", False)
        got = attend(q, k, v, mask, causal=causal)
    assert (got - want).abs().max() < 1e-12
