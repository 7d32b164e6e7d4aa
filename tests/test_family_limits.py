"""What the families refuse in one line, and Gemma 3 (text) beyond the family tests of tests/test_families.py."""

import json

import pytest
from test_families import GEMMA3

from helpers import build_checkpoint
from lora_llama.cli import main


def test_gemma3_export_is_one_line(tmp_path, capsys):
    folder = build_checkpoint(tmp_path / "g", family="gemma3_text", **GEMMA3)
    capsys.readouterr()
    assert main(["export", "--base", str(folder), "--out", str(tmp_path / "g.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "convert_hf_to_gguf.py" in err and not (tmp_path / "g.gguf").exists()


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
