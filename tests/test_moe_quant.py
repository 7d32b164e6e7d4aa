"""A mixture's experts frozen in int8 and nf4: the same model as its float copy holding the round-tripped weights,
the bytes where an MoE keeps them, LoRA on top, and merges onto the weights training saw."""

import pytest
import torch

from helpers import build_checkpoint, token_ids
from lora_llama import LoraSettings, apply_lora, load_model, save_adapter
from lora_llama.cli import main
from lora_llama.objectives.token_losses import target_loss
from lora_llama.quant.experts import QuantizedExperts
from lora_llama.quant.handlers import quant_format
from lora_llama.quant.linear import base_weight_bytes

EXPERTS_DOMINATE = dict(  # 16 experts of 256 x 256 per layer: the experts hold ~90% of the weights
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qmoe") / "ckpt", family="qwen3_moe", **EXPERTS_DOMINATE)


def round_tripped(folder, kind):
    """The float model whose decoder linears and experts hold dequant(quant(W)): what a quantized base computes."""
    model, fmt = load_model(folder), quant_format(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")) and "layers." in name:
                rows = p.reshape(-1, p.shape[-1]) if p.dim() == 2 else None
                p.copy_(
                    fmt.roundtrip(rows).view_as(p) if rows is not None else torch.stack([fmt.roundtrip(w) for w in p])
                )
    return model


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_experts_compute_the_round_tripped_model(moe, kind):
    x = token_ids(2, 32, 7)
    quantized = load_model(moe, quantize=kind)
    assert all(isinstance(b.mlp.experts, QuantizedExperts) for b in quantized.model.layers)
    with torch.no_grad():
        ours, reference, plain = quantized(x), round_tripped(moe, kind)(x), load_model(moe)(x)
        assert (ours - reference).abs().max() < 1e-4
        loss = [torch.nn.functional.cross_entropy(o[:, :-1].flatten(0, 1), x[:, 1:].flatten()) for o in (ours, plain)]
    assert abs(float(loss[0] - loss[1])) < (0.01 if kind == "int8" else 0.05)  # the quantization's own error


def test_frozen_base_bytes_against_bf16(moe):
    bf16 = base_weight_bytes(load_model(moe, dtype=torch.bfloat16))
    ratios = {k: base_weight_bytes(load_model(moe, dtype=torch.bfloat16, quantize=k)) / bf16 for k in ("int8", "nf4")}
    assert ratios["int8"] <= 0.55 and ratios["nf4"] <= 0.35, ratios


def test_expert_lora_on_quantized_experts_has_the_round_tripped_gradients(moe):
    x = token_ids(2, 24, 8)
    grads = []
    for model in (load_model(moe, quantize="int8"), round_tripped(moe, "int8")):
        torch.manual_seed(0)  # the same A in both
        apply_lora(model.train(), LoraSettings(r=4, alpha=8, targets=["q", "experts"]))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
        loss, n = target_loss(model, x, x)
        (loss / n).backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        assert (grads[0][k] - grads[1][k]).abs().max() < 1e-4, k


def test_merge_onto_dequantized_experts_gives_the_trained_model(moe, tmp_path):
    x = token_ids(2, 24, 9)
    model = load_model(moe, quantize="int8")
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=["experts"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    save_adapter(model, tmp_path / "adapter")
    args = ["merge", "--base", str(moe), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "m")]
    assert main([*args, "--onto", "dequantized", "--quantize", "int8"]) == 0
    with torch.no_grad():
        assert (load_model(tmp_path / "m")(x) - model.eval()(x)).abs().max() < 1e-4
