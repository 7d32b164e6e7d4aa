"""The CPU training attention (blocked forward and backward; packed rows without a mask) against SDPA
with k/v repeated per head and a dense mask."""

import pytest
import torch
import torch.nn.functional as F

from lora_llama.kernels import attention, blocked_attention
from lora_llama.kernels.attention import _CausalAttention, attend, causal_segment_mask


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


@pytest.mark.parametrize("packed", [False, True])
def test_gradcheck_across_block_and_key_tile_boundaries(monkeypatch, packed):
    monkeypatch.setattr(blocked_attention, "BLOCK", 3)  # T=8: blocks of 3, 3 and 2
    monkeypatch.setattr(blocked_attention, "KEYS", 2)  # and tiles of 2 keys: the online softmax rescales
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]]) if packed else None
    assert torch.autograd.gradcheck(lambda q, k, v: _CausalAttention.apply(q, k, v, seg), qkv(1, 4, 2, 8, 4))


def reference(q, k, v, segments=None):
    """SDPA with repeated k/v, and with the dense mask for packed rows."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if segments is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_segment_mask(segments)[:, None])


def packed_segments(B, T, mean_len, seed=1):
    """Segment ids of rows packed with examples of random lengths, the last row ending in padding (id -1)."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.stack([torch.cumsum((torch.rand(T, generator=g) < 1 / mean_len).long(), 0) for _ in range(B)])
    seg[-1, -(T // 10) :] = -1
    return seg


@pytest.mark.parametrize("packed", [False, True, "runs"], ids=["rows", "packed", "packed-runs"])
@pytest.mark.parametrize("blocks", [(32, 1024), (16, 24)], ids=["one-tile", "many-tiles"])
def test_packed_and_long_rows_match_sdpa_with_a_dense_mask(monkeypatch, packed, blocks):
    """packed-runs: every batch row's blocks in products of their own, from their own first keys."""
    from lora_llama.kernels import packed_rows

    monkeypatch.setattr(blocked_attention, "BLOCK", blocks[0])
    monkeypatch.setattr(blocked_attention, "KEYS", blocks[1])
    monkeypatch.setattr(packed_rows, "_kept", {})  # made afresh: runs depend on TILE_COST
    if packed == "runs":
        monkeypatch.setattr(packed_rows, "TILE_COST", 0)
    q, k, v = qkv(2, 6, 2, 150, 16)
    seg = packed_segments(2, 150, 20) if packed else None
    out = attend(q, k, v, causal=True, segments=seg)
    assert out.grad_fn.name() == "_CausalAttentionBackward"
    grad_out = torch.randn_like(out)
    ref = reference(q, k, v, seg)
    assert (out - ref).abs().max() < 1e-12
    for g, e in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out)):
        assert (g - e).abs().max() < 1e-12


def test_packed_rows_build_no_square_buffer(monkeypatch):
    """At T=4096 nothing of T x T elements is allocated in forward or backward (the dense bool mask alone is 16 MB)."""
    q, k, v = qkv(1, 6, 2, 4096, 16, dtype=torch.float32)
    seg = packed_segments(1, 4096, 300)
    biggest = []

    def watch(t):
        biggest.append(t.numel())
        return t

    monkeypatch.setattr(attention, "causal_segment_mask", lambda *a: pytest.fail("a dense mask was built"))
    with torch.autograd.graph.saved_tensors_hooks(watch, lambda t: t):
        out = attend(q, k, v, causal=True, segments=seg)
    out.sum().backward()
    assert max(biggest) == 4096 * 6 * 16  # q and out (T x heads x d) are the largest saved; nothing of T x T


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


def test_packed_inference_uses_the_blocked_forward():
    q, k, v = qkv(2, 6, 2, 40, 8)
    seg = packed_segments(2, 40, 8)
    with torch.no_grad():
        assert (attend(q, k, v, causal=True, segments=seg) - reference(q, k, v, seg)).abs().max() < 1e-12


@pytest.mark.parametrize("causal", [True, False])
def test_torch_without_enable_gqa_gets_repeated_key_values(monkeypatch, causal):
    q, k, v = qkv(2, 6, 2, 9, 8)
    mask = None if causal else torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    with torch.no_grad():
        want = attend(q, k, v, mask, causal=causal)  # this torch: enable_gqa
        monkeypatch.setattr(attention, "_SDPA_GQA", False)
        got = attend(q, k, v, mask, causal=causal)
    assert (got - want).abs().max() < 1e-12


def per_example_reference(q, k, v, segments):
    """SDPA run on each example of the (single) row alone, the outputs concatenated: what packing must equal."""
    new = torch.ones(segments.shape[1], dtype=torch.bool)
    new[1:] = segments[0, 1:] != segments[0, :-1]
    bounds = torch.nonzero(new)[:, 0].tolist() + [segments.shape[1]]
    return torch.cat([reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in zip(bounds, bounds[1:])], dim=2)


@pytest.mark.parametrize("T", [4096, 8192])
@pytest.mark.parametrize("packed", [False, True])
def test_long_rows_match_sdpa(T, packed):
    """float32 at 4096 and 8192 tokens: values and gradients equal SDPA's (on each example alone for packed rows)
    within 1e-5 of their largest magnitude; several blocks of queries and, at 8192, several tiles of keys."""
    q, k, v = qkv(1, 6, 2, T, 32, dtype=torch.float32)
    seg = packed_segments(1, T, 700) if packed else None
    out = attend(q, k, v, causal=True, segments=seg)
    grad_out = torch.randn_like(out)
    ref = per_example_reference(q, k, v, seg) if packed else reference(q, k, v)
    pairs = [
        (out, ref),
        *zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out)),
    ]
    for got, want in pairs:
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_long_packed_rows_in_float64():
    """A float64 spot check at 4096 tokens of packed rows: equal to 1e-12."""
    q, k, v = qkv(1, 3, 1, 4096, 16)
    seg = packed_segments(1, 4096, 500)
    out = attend(q, k, v, causal=True, segments=seg)
    grad_out = torch.randn_like(out)
    ref = per_example_reference(q, k, v, seg)
    assert (out - ref).abs().max() < 1e-12
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out)):
        assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_kernels_are_well_formed_custom_ops(packed, rope):
    """torch.library.opcheck: schema, fake (meta) outputs equal the real ones' shapes and strides (what
    torch.compile traces with), no aliasing of inputs; with RoPE's cos and sin too (packed rows of head dimension
    64: the C loop's)."""
    q, k, v = (t.detach().float() for t in qkv(2, 6, 2, 20, 64))
    seg = packed_segments(2, 20, 5) if packed else None
    angles = torch.rand(2, 1, 20, 32, generator=torch.Generator().manual_seed(3)) * 6
    tables = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()) if rope else (None, None)
    out, lse = attention.causal_attention(q, k, v, seg, *tables)
    torch.library.opcheck(attention.causal_attention, (q, k, v, seg, *tables))
    grad_out = torch.randn_like(out)
    torch.library.opcheck(attention.causal_attention_backward, (q, k, v, out, lse, grad_out, seg, *tables))


def test_packed_rows_are_made_once_per_batch_and_mask_by_hand():
    from lora_llama.kernels.packed_rows import KEPT, _kept, packed_rows

    segments = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]])
    rows = packed_rows(segments, 2)
    assert packed_rows(segments.clone(), 2) is rows  # every layer of a step: its own tensor of the same ids
    assert packed_rows(segments.flip(0), 2) is not rows  # another batch's rows: made for them
    assert rows.starts.tolist() == [[0, 0, 0, 3, 3], [0, 0, 2, 2, 2]]
    # per batch row, blocks 0-1, 2-3, 4
    assert rows.first_key == [[0, 0, 3], [0, 2, 2]] and rows.last_start == [[0, 3, 3], [0, 2, 2]]
    # queries 2-3 (two heads each) and keys 1-4: key j hidden after query i or before i's example
    inf = float("-inf")
    by_hand = [
        [[0, 0, inf, inf], [0, 0, inf, inf], [inf, inf, 0, inf], [inf, inf, 0, inf]],  # row 0: starts 0, 3
        [[inf, 0, inf, inf], [inf, 0, inf, inf], [inf, 0, 0, inf], [inf, 0, 0, inf]],  # row 1: starts 2, 2
    ]
    assert rows.additive_mask(2, 4, 1, 5, 2, False, torch.float32).tolist() == by_hand
    assert rows.additive_mask(2, 4, 1, 5, 2, True, torch.bfloat16).float().transpose(1, 2).tolist() == by_hand
    for shift in range(1, 4):
        packed_rows(segments + shift, 2)
    assert len(_kept) == KEPT and packed_rows(segments, 2) is not rows  # the last KEPT batches only


def test_a_batch_row_of_short_examples_gets_its_own_key_range_beside_a_long_one(monkeypatch):
    """Runs of batch rows: merged while one product over the earliest first key costs less than one more tile;
    split, a row of short examples starts its keys at its own example."""
    from lora_llama.kernels import packed_rows as module

    monkeypatch.setattr(module, "_kept", {})
    segments = torch.tensor([[0] * 8, [0, 0, 1, 1, 2, 2, 3, 3]])  # one example of 8; four of 2
    rows = module.packed_rows(segments, 2)
    # block 3 (queries 6-7), two key/value heads a row: groups 0-1 are row 0's, 2-3 row 1's
    assert rows.runs(3, 8, 0, 4, 2) == [(0, 4, 0, 6)]  # 4 x 8 keys against 2 x 8 + 2 x 2 and a tile: merged
    monkeypatch.setattr(module, "TILE_COST", 0)
    monkeypatch.setattr(module, "_kept", {})
    rows = module.packed_rows(segments, 2)
    assert rows.runs(3, 8, 0, 4, 2) == [(0, 2, 0, 0), (2, 4, 6, 6)]
    assert rows.runs(3, 8, 1, 3, 2) == [(1, 2, 0, 0), (2, 3, 6, 6)]  # a chunk of groups across the rows
