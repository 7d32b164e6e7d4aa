"""bench/memory_estimate's weight and adapter terms against what the native model holds: the GPU guide's computed
memory table rests on them."""

import json

import pytest
import torch

from bench.memory_estimate import base_bytes, lora_parameters
from lora_llama import LoraSettings, apply_lora, load_model
from lora_llama.quant.linear import base_weight_bytes


@pytest.mark.parametrize("quantize", ["nf4", "int8", None])
def test_base_and_adapter_terms_match_the_loaded_model(make_ckpt, quantize):
    folder = make_ckpt(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    cfg = json.loads((folder / "config.json").read_text())
    model = load_model(folder, dtype=torch.bfloat16, quantize=quantize)
    held = base_weight_bytes(model)
    assert abs(base_bytes(cfg, quantize) - held) / held < 0.01
    summary = apply_lora(model, LoraSettings(r=16, targets=["q", "k", "v", "o", "gate", "up", "down"]))
    assert lora_parameters(cfg, 16, ["q", "k", "v", "o", "gate", "up", "down"]) == summary["trainable"]
