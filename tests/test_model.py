"""The native LLaMA against transformers' LlamaForCausalLM on the same random checkpoints."""

import json

import pytest
import torch

from helpers import build_checkpoint, hf_model, token_ids
from lora_llama import load_model
from lora_llama.model.generate import generate

CONFIGS = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa4": dict(num_attention_heads=8, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "head_dim": dict(head_dim=32),
    "attention_bias": dict(attention_bias=True, mlp_bias=True),
}


def ids(batch=2, seq=40, seed=1):
    return token_ids(batch, seq, seed)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(tmp_path, name):
    folder = build_checkpoint(tmp_path / name, **CONFIGS[name])
    x = ids()
    with torch.no_grad():
        ref = hf_model(folder)(x).logits
        out = load_model(folder)(x)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < 1e-4


def test_legacy_rope_config_form(tmp_path):
    """Hub checkpoints carry top-level rope_theta + rope_scaling instead of rope_parameters."""
    folder = build_checkpoint(tmp_path / "l3", **CONFIGS["llama3_rope"])
    x = ids(seq=120)
    with torch.no_grad():
        ref = hf_model(folder)(x).logits
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {**rope, "rope_type": "llama3"}
    (folder / "config.json").write_text(json.dumps(cfg))
    model = load_model(folder)
    assert model.args.rope_theta == 500000.0 and model.args.rope_scaling["factor"] == 8.0
    with torch.no_grad():
        assert (model(x) - ref).abs().max() < 1e-4


def test_sharded_equals_unsharded(tmp_path):
    one = build_checkpoint(tmp_path / "one", seed=3)
    three = build_checkpoint(tmp_path / "three", seed=3, shards=3)
    assert len(list(three.glob("model-*.safetensors"))) == 3
    x = ids()
    with torch.no_grad():
        assert torch.equal(load_model(one)(x), load_model(three)(x))


def _misaligned_checkpoint(folder):
    """The checkpoint rewritten with a header padded so that its first tensor's data is off a 64-byte boundary."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    f = next(folder.glob("*.safetensors"))
    tensors = load_file(f)
    for pad in range(1, 65):
        save_file(tensors, f, metadata={"format": "pt", "pad": "x" * pad})
        with safe_open(f, framework="pt") as sf:
            if sf.get_tensor(sorted(tensors)[0]).data_ptr() % 64:
                return folder
    raise AssertionError("no padding moved the data off a 64-byte boundary")


def test_loaded_weights_start_on_64_byte_boundaries(tmp_path):
    """oneDNN's products run at about half their rate on a weight off a 64-byte boundary, where a tensor mapped
    from a safetensors file (aligned to 8 bytes) usually starts: the model holds aligned copies of those."""
    from lora_llama.files.shards import aligned, iter_shards

    folder = _misaligned_checkpoint(build_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True))
    mapped = [t for _, shard in iter_shards(folder) for t in shard.values()]
    assert any(t.data_ptr() % 64 for t in mapped)
    model = load_model(folder)
    held = dict(model.named_parameters())
    assert all(p.data_ptr() % 64 == 0 for p in held.values()), [n for n, p in held.items() if p.data_ptr() % 64]
    view = torch.arange(40.0)[3:35]
    assert view.data_ptr() % 64 and torch.equal(aligned(view), view) and aligned(view).data_ptr() % 64 == 0
    whole = torch.arange(32.0)
    assert aligned(whole) is whole


def test_checkpoint_rows_equal_the_file_start_aligned_and_name_a_cut(tmp_path):
    """fsdp's row reader: any rows of a tensor equal safetensors' own reading, in memory on a 64-byte boundary
    (held as read: no second copy to align them); a file cut inside a tensor's data names the file and tensor."""
    from safetensors.torch import load_file

    from lora_llama.errors import UserError
    from lora_llama.files.checkpoint_rows import CheckpointRows

    folder = _misaligned_checkpoint(build_checkpoint(tmp_path / "ckpt", tie_word_embeddings=True))
    whole = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    rows = CheckpointRows(folder)
    for key, t in whole.items():
        n = t.shape[0]
        for lo, hi in ((0, n), (1, n), (n // 2, n // 2)):
            got = rows.rows(key, lo, hi)
            assert got.dtype == t.dtype and torch.equal(got, t[lo:hi]) and got.data_ptr() % 64 == 0, key
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    last = max(rows.where.values(), key=lambda w: w[3])  # the tensor whose data ends the file
    key = next(k for k, w in rows.where.items() if w == last)
    with pytest.raises(UserError, match=f"model.safetensors: truncated at tensor {key}"):
        rows.rows(key, 0, whole[key].shape[0])


def test_packed_segments_match_separate_runs(tiny_ckpt):
    model = load_model(tiny_ckpt)
    a, b = ids(1, 7, seed=4), ids(1, 11, seed=5)
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(11)])[None]
    seg = torch.tensor([[0] * 7 + [1] * 11])
    with torch.no_grad():
        out = model(packed, position_ids=pos, segment_ids=seg)
        assert (out[:, :7] - model(a)).abs().max() < 1e-5
        assert (out[:, 7:] - model(b)).abs().max() < 1e-5


def test_greedy_cache_equals_no_cache_and_transformers(tiny_ckpt):
    model = load_model(tiny_ckpt)
    prompt = ids(1, 9, seed=7)[0].tolist()
    with_cache = generate(model, prompt, max_new_tokens=24)
    without = generate(model, prompt, max_new_tokens=24, use_cache=False)
    ref = (
        hf_model(tiny_ckpt)
        .generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(prompt) :
        ]
        .tolist()
    )
    assert with_cache == without == ref


def test_sampling_is_seeded_and_respects_top_k(tiny_ckpt):
    model = load_model(tiny_ckpt)
    prompt = ids(1, 5, seed=8)[0].tolist()
    a = generate(model, prompt, 16, temperature=1.0, top_k=5, top_p=0.9, seed=11)
    b = generate(model, prompt, 16, temperature=1.0, top_k=5, top_p=0.9, seed=11)
    assert a == b
    # top_k=1 is greedy whatever the temperature
    assert generate(model, prompt, 16, temperature=2.0, top_k=1, seed=3) == generate(model, prompt, 16)


def test_bf16_forward_close_to_fp32(tiny_ckpt):
    x = ids()
    with torch.no_grad():
        ref = load_model(tiny_ckpt)(x)
        out = load_model(tiny_ckpt, dtype=torch.bfloat16)(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() / ref.abs().max() < 0.05


def test_training_forward_without_backward_frees_its_graph(tiny_ckpt, monkeypatch):
    """The memory-lean training path must not tie saved outputs to their own graph (an uncollectable cycle):
    a forward whose loss is dropped (e.g. a skipped NaN step) has to give all its activations back."""
    import gc
    import weakref

    import lora_llama.model.llama

    outputs = []
    attend = lora_llama.model.llama.attend

    def recording_attention(*args, **kwargs):
        y = attend(*args, **kwargs)
        outputs.append(weakref.ref(y))
        return y

    monkeypatch.setattr(lora_llama.model.llama, "attend", recording_attention)
    model = load_model(tiny_ckpt)
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)  # so that a graph is recorded
    model.train()
    h = model.hidden(ids())
    assert h.requires_grad and outputs
    del h
    gc.collect()
    assert all(ref() is None for ref in outputs)


def test_rope_function_matches_rotate_half_formula():
    """The one-buffer RoPE against HF's x·cos + rotate_half(x)·sin, values and gradients (float64 gradcheck)."""
    from lora_llama.kernels.elementwise import apply_rope

    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64).transpose(1, 2).requires_grad_()  # (B, heads, T, D), strided as q
    angles = torch.rand(2, 1, 5, 4, dtype=torch.float64) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    x1, x2 = x.chunk(2, -1)
    ref = x * cos + torch.cat((-x2, x1), -1) * sin
    assert (apply_rope(x, cos, sin) - ref).abs().max() < 1e-12
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))


def test_rms_norm_function_matches_hf_formula():
    """The two-buffer RMSNorm against HF's weight · (x · rsqrt(mean(x²) + eps)): values and gradients (gradcheck)."""
    from lora_llama.kernels.elementwise import rms_norm
    from lora_llama.model.llama import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(6, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6))
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert (norm(x) - ref).abs().max() < 1e-12
    assert torch.autograd.gradcheck(lambda t, w: rms_norm(t, w, 1e-5), (x, norm.weight))


def test_swiglu_function_matches_autograd():
    """The recomputing SwiGLU against autograd's silu(g)·u: values and both input gradients (gradcheck)."""
    from lora_llama.kernels.elementwise import swiglu

    g, u = (
        torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s), requires_grad=True)
        for s in (0, 1)
    )
    assert (swiglu(g, u) - torch.nn.functional.silu(g) * u).abs().max() < 1e-12
    assert torch.autograd.gradcheck(swiglu, (g, u))


def test_packed_rows_get_a_mask_only_where_attend_cannot_take_segments():
    from lora_llama.model.llama import attention_mask

    seg = torch.tensor([[0, 0, 1, 1, 1]])
    assert attention_mask(5, 0, torch.device("cpu"), seg) is None  # the CPU kernel runs each example alone
    mask = attention_mask(5, 0, torch.device("meta"), seg.to("meta"))  # other devices (CUDA): one mask, all layers
    assert mask.shape == (1, 1, 5, 5)
