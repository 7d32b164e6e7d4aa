"""model/config.py, lora/settings.py and recipe/schema.py: ModelArgs from HF configs, the vocabularies against
transformers/peft, recipes and overrides."""

import pytest
import torch

from helpers import TINY
from lora_llama import UserError
from lora_llama.lora.settings import LoraSettings, lora_scale
from lora_llama.model.config import BLOCK_LINEARS, LINEAR_NAMES, LINEARS, ModelArgs, torch_dtype
from lora_llama.recipe.schema import load_recipe


def test_model_args_from_a_llama3_config_written_by_transformers():
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = LlamaConfig(
        **{
            **TINY,
            "head_dim": 32,
            "rope_theta": 500000.0,
            "rope_scaling": rope,
            "tie_word_embeddings": True,
            "attention_bias": True,
        }
    ).to_dict()
    args = ModelArgs.from_hf_config(cfg)
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == (64, 2, 4, 2, 32)
    assert args.rope_theta == 500000.0 and args.rope_scaling["rope_type"] == "llama3"
    assert args.rope_scaling["factor"] == 32.0
    assert args.tie_word_embeddings and args.qkv_bias and args.o_bias and not args.mlp_bias
    assert args.hf_config == cfg  # kept for merge to write back


def test_model_args_defaults_and_refusals():
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
    }
    args = ModelArgs.from_hf_config(base)
    assert args.n_kv_heads == 2 and args.head_dim == 4  # MHA and dim // heads when the config is silent
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
        ModelArgs.from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(UserError, match="hidden_act 'gelu' is not supported"):
        ModelArgs.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(UserError, match="not a multiple"):
        ModelArgs.from_hf_config({**base, "num_key_value_heads": 3})
    with pytest.raises(UserError, match="'yarn' is not supported"):
        ModelArgs.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_target_vocabulary_is_transformers_module_names():
    """The decoder targets are exactly the nn.Linear layers of transformers' LlamaDecoderLayer, by path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(**TINY))
    linears = {
        n.removeprefix("model.layers.0.")
        for n, m in hf.named_modules()
        if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.0.")
    }
    assert linears == {LINEARS[t] for t in BLOCK_LINEARS}
    assert LINEARS["lm_head"] == "lm_head" and isinstance(hf.lm_head, torch.nn.Linear)
    assert LINEAR_NAMES["q"] == "q_proj" and LINEAR_NAMES["down"] == "down_proj"
    # and a mixture's experts, which are parameters, not linears (tests/test_moe_lora.py)
    assert set(LoraSettings.model_fields["targets"].annotation.__args__[0].__args__) == {*LINEARS, "experts"}


def test_lora_scale_and_settings():
    assert lora_scale(8, 16) == 2.0 and lora_scale(16, 8, rslora=True) == 2.0
    s = LoraSettings(r=4, alpha=8, targets=["q", "v", "q"])
    assert s.targets == ["q", "v"] and s.scale == 2.0
    with pytest.raises(Exception, match="at least one target"):
        LoraSettings(targets=[])


def test_dtype_spellings():
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("float32") is torch.float32
    assert torch_dtype("fp16") is torch.float16
    with pytest.raises(UserError, match="unknown dtype 'fp8'"):
        torch_dtype("fp8")


def test_recipe_overrides_are_yaml_values_and_errors_name_the_key(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("lora: {r: 4}\ntrain: {max_steps: 7}\n")
    r = load_recipe(str(f), ["lora.targets=[q,v]", "train.lr=1e-3", "data.packing=true", "model.dtype=bfloat16"])
    assert (r.lora.r, r.lora.targets, r.train.max_steps, r.train.lr, r.data.packing) == (4, ["q", "v"], 7, 1e-3, True)
    assert r.model.dtype == "bfloat16"
    assert load_recipe(str(f), ["train.gradient_checkpointing=selective"]).train.gradient_checkpointing == "selective"
    cases = {
        "lora.alhpa=4": "unknown recipe key 'lora.alhpa' (did you mean 'lora.alpha'?)",
        "lora.r=0": "recipe key 'lora.r'",
        "model.dtype=fp8": "recipe key 'model.dtype'",
        "lora.targets=[q,x]": "recipe key 'lora.targets.1'",
        "train=3": "recipe key 'train'",
        "noequals": "must look like key.path=value",
        "lora.r.x=1": "'r' is not a section",
        "train.gradient_checkpointing=sometimes": "recipe key 'train.gradient_checkpointing': Input should be "
        "False, True, 'block' or 'selective'",
    }
    for override, message in cases.items():
        with pytest.raises(UserError) as e:
            load_recipe(str(f), [override])
        assert message in str(e.value) and "\n" not in str(e.value), override


def test_recipe_file_errors(tmp_path):
    with pytest.raises(UserError, match="recipe file not found"):
        load_recipe(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_recipe(str(tmp_path / "bad.yaml"))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="must be a mapping"):
        load_recipe(str(tmp_path / "list.yaml"))
    (tmp_path / "len.yaml").write_text("train: {max_steps: null}\n")
    with pytest.raises(UserError, match="set train.max_steps or train.epochs"):
        load_recipe(str(tmp_path / "len.yaml"))
