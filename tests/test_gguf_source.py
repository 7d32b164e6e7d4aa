"""A GGUF base held as its own blocks (model.quantize source): every block format against ggml's dequantization
(gguf's own quants module), the same logits as the dequantized model, training on the file's blocks."""

import pytest
import torch

from helpers import ALL, ROOT, token_ids
from lora_llama import LoraSettings, apply_lora, load_model
from lora_llama.quant.linear import QuantizedLinear, base_weight_bytes


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_blocks_dequantize_as_ggml_does(kind):
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from lora_llama.quant.gguf_blocks import dequantize_gguf

    x = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32) * 0.1
    blocks = quants.quantize(x, GGMLQuantizationType[kind])
    ours = dequantize_gguf(kind.lower(), torch.from_numpy(blocks))
    assert np.array_equal(ours.numpy(), quants.dequantize(blocks, GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_blocks_dequantize_as_ggml_does(kind):
    """gguf-py quantizes no K format, so every byte of each super-block is random (every scale, min and code bit
    pattern occurs) but its float16 factors, which are kept finite."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from helpers import random_k_blocks
    from lora_llama.quant.gguf_blocks import dequantize_gguf

    blocks = random_k_blocks(kind, rows=6, in_features=512, seed=1)
    ours = dequantize_gguf(kind.lower(), torch.from_numpy(blocks))
    theirs = quants.dequantize(blocks, GGMLQuantizationType[kind])
    assert np.isfinite(theirs).all() and np.abs(theirs).max() > 0.01
    assert np.array_equal(ours.numpy(), theirs)


def test_source_keeps_the_gguf_blocks_and_gives_the_dequantized_models_logits(smollm2):
    float_model, source = load_model("smollm2-135m-instruct"), load_model("smollm2-135m-instruct", quantize="source")
    q_proj = source.model.layers[0].self_attn.q_proj
    assert type(q_proj) is QuantizedLinear and q_proj.kind == "q4_1"  # the file's own Q4_1 blocks, q rows reordered
    assert base_weight_bytes(source, True) < 0.16 * base_weight_bytes(float_model, True)  # 20 bytes / 32 weights
    x = token_ids(2, 24, seed=0)
    with torch.no_grad():
        assert torch.equal(source(x), float_model(x))


# a GGUF file of every block format source keeps: the default recipe's Q4_1, llama.cpp's Q4_K_M mix, and the rest
MIXED_BLOCKS = {
    "attn_q": "Q4_K",
    "attn_k": "Q6_K",
    "attn_v": "Q5_K",
    "attn_output": "Q5_0",
    "ffn_gate": "Q5_1",
    "ffn_up": "Q4_1",
    "ffn_down": "Q4_0",
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A tiny llama (rows of 256, as K blocks need) in a GGUF file holding each format source keeps."""
    from helpers import build_checkpoint, gguf_with_blocks
    from lora_llama.outputs.export import export_gguf

    folder = tmp_path_factory.mktemp("mixed")
    ckpt = build_checkpoint(folder / "ckpt", hidden_size=256, intermediate_size=512)
    export_gguf(str(ckpt), folder / "f16.gguf", progress=False)
    return gguf_with_blocks(folder / "f16.gguf", folder / "mixed.gguf", MIXED_BLOCKS)


def test_source_keeps_every_block_format_and_gives_the_dequantized_models_logits(mixed_gguf):
    """Against transformers' GGUF loader, which dequantizes each tensor with gguf-py."""
    float_model, source = load_model(mixed_gguf), load_model(mixed_gguf, quantize="source")
    attn, mlp = source.model.layers[1].self_attn, source.model.layers[1].mlp
    layers = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    assert [q.kind for q in layers] == [k.lower() for k in MIXED_BLOCKS.values()]
    x = token_ids(2, 24, seed=0)
    with torch.no_grad():
        assert torch.equal(source(x), float_model(x))


def test_quantize_auto_trains_the_files_blocks_in_fp32_as_the_same_model(mixed_gguf, tmp_path, capsys):
    """The default recipe's `quantize: auto` on a GGUF base in fp32 on the CPU trains source: the run folder records
    the kind (merge --onto dequantized reads it), and the eval loss before training equals the unquantized run's."""
    import json

    import yaml
    from test_train import chat_file

    from lora_llama.cli import main

    data, losses, logs = chat_file(tmp_path / "d.jsonl"), {}, {}
    for setting in ("auto", "null"):
        out = tmp_path / setting
        assert (
            main(
                [
                    "train",
                    str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
                    f"model.source={mixed_gguf}",
                    f"data.source={data}",
                    f"output.dir={out}",
                    f"model.quantize={setting}",
                    "train.precision=fp32",
                    "model.device=cpu",
                    "train.max_steps=1",
                    "train.batch_size=2",
                    "data.val_size=0.25",
                ]
            )
            == 0
        )
        logs[setting] = capsys.readouterr().out
        losses[setting] = next(
            r["eval_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["step"] == 0
        )
        kept = yaml.safe_load((out / "recipe.yaml").read_text())["model"]["quantize"]
        assert kept == ("source" if setting == "auto" else None), kept
    assert "model.quantize source (auto: float32 on the CPU" in logs["auto"]
    assert "model.quantize" not in logs["null"]
    assert losses["auto"] == losses["null"], losses


@pytest.mark.parametrize("kind", ["int8", "nf4", "source"])
def test_a_quantized_base_counts_the_parameters_of_the_float_one(mixed_gguf, kind):
    """The start-up line's "N parameters, M trainable (P%)": a quantized weight counts as out x in parameters."""
    settings = LoraSettings(r=4, alpha=8, targets=ALL)
    float_summary, summary = [apply_lora(load_model(mixed_gguf, quantize=q), settings) for q in (None, kind)]
    assert summary == float_summary and summary["trainable"] > 0, (summary, float_summary)


def test_source_needs_a_gguf_base(tiny_ckpt):
    from lora_llama import UserError

    with pytest.raises(UserError, match="not a GGUF base"):
        load_model(tiny_ckpt, quantize="source")
