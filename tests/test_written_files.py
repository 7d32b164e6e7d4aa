"""What we write opens unchanged in the ecosystem's tools: merged config, tokenizer files, adapter config."""

import json
import re
from pathlib import Path

import pytest
import torch

from helpers import hf_model, make_adapter
from lora_llama import load_model
from lora_llama.cli import main


def local_paths(folder) -> list[str]:
    """Every string in the folder's JSON files that is an absolute path or names this machine's folders."""
    found = []

    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str) and (re.match(r"(/[\w.@+-]+){2,}", v) or "site-packages" in v or str(Path.home()) in v):
            found.append(v)

    for f in folder.glob("*.json"):
        walk(json.loads(f.read_text()))
    return found


def check_merged_folder(out, architecture="LlamaForCausalLM"):
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [architecture]
    assert not local_paths(out), local_paths(out)
    assert "id2label" not in cfg and "_name_or_path" not in cfg
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert not {"is_local", "local_files_only"} & set(tok_cfg)
    assert not tok_cfg.get("tokenizer_class", "").endswith("Backend")
    tok = PreTrainedTokenizerFast.from_pretrained(out)
    assert tok.chat_template and tok("hello world")["input_ids"]
    return cfg, tok


def test_merged_hf_folder_is_portable(tiny_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    adapter = make_adapter(tiny_ckpt, tmp_path / "a", targets=["q", "v", "down"], std=0.05)
    assert main(["merge", "--base", str(tiny_ckpt), "--adapter", str(adapter), "--out", str(tmp_path / "m")]) == 0
    cfg, tok = check_merged_folder(tmp_path / "m")
    assert cfg["rope_theta"] == 10000.0  # where transformers < 5 and llama.cpp's converter read it
    reference = AutoTokenizer.from_pretrained(tiny_ckpt)
    text = reference.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False)
    assert tok(text)["input_ids"] == reference(text)["input_ids"]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert type(merged) is LlamaForCausalLM
    x = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (merged(x).logits - load_model(tmp_path / "m")(x)).abs().max() < 1e-4


def test_merged_gguf_base_is_portable(smollm2, tmp_path):
    adapter = make_adapter(None, tmp_path / "a", targets=["q", "v", "down"], std=0.05, source="smollm2-135m-instruct")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub id, not our name
    code = main(["merge", "--base", "smollm2-135m-instruct", "--adapter", str(adapter), "--out", str(tmp_path / "m")])
    assert code == 0
    cfg, tok = check_merged_folder(tmp_path / "m")
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert "<|im_start|>assistant" in tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_adapter_on_a_local_base_loads_with_auto_peft(tiny_ckpt, tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel

    adapter = make_adapter(tiny_ckpt, tmp_path / "a", targets=["q", "v", "down"], std=0.05)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_ckpt)
    auto = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
    ref = PeftModel.from_pretrained(hf_model(tiny_ckpt), adapter).eval()
    x = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(auto(x).logits, ref(x).logits, atol=1e-6)


@pytest.mark.parametrize(
    "base, shown",
    [("/home/me/models/llama-local", "llama-local"), ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B")],
)
def test_model_card_names_no_local_path(tmp_path, base, shown):
    import yaml

    from lora_llama.outputs.hub import model_card

    (tmp_path / "adapter_config.json").write_text(
        json.dumps(
            {
                "base_model_name_or_path": base,
                "r": 4,
                "lora_alpha": 8,
                "lora_dropout": 0.0,
                "target_modules": ["q_proj"],
            }
        )
    )
    card = model_card(tmp_path, None, "alice/x")
    meta = yaml.safe_load(card.split("---")[1])
    assert "/home/me" not in card and shown in card
    assert meta.get("base_model") == (base if shown == base else None)
