"""PiSSA / OLoRA against peft: the same A, B and residual base, outputs unchanged at the start, and the saved adapter
in its plain form gives our outputs in peft on the original base; the start-up forms for resume; recipe errors."""

from functools import partial

import pytest
import torch

from helpers import hf_model, rel, token_ids
from lora_llama import LoraSettings, apply_lora, load_model, save_adapter
from lora_llama.errors import UserError
from lora_llama.loading.adapters import load_adapter
from lora_llama.lora.adapted import lora_modules
from lora_llama.recipe.schema import load_recipe

TARGETS = ["q", "v", "up", "down"]
HF_TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


ids = partial(token_ids, 2, 20)


def principal(ckpt, how, r=4):
    model = load_model(ckpt)
    torch.manual_seed(0)
    apply_lora(model, LoraSettings(r=r, alpha=8, targets=TARGETS, init_lora_weights=how))
    return model


@pytest.mark.parametrize("how", ["pissa", "olora", "pissa_niter_4"])
def test_the_model_starts_as_the_base(tiny_ckpt, how):
    model, base = principal(tiny_ckpt, how), load_model(tiny_ckpt)
    with torch.no_grad():
        assert rel(model(ids()), base(ids())) < 1e-5
    layer = lora_modules(model)["model.layers.0.mlp.up_proj"]
    assert layer.lora_B.weight.abs().sum() > 0  # the principal part lives in the adapter now


@pytest.mark.parametrize("how", ["pissa", "olora"])
def test_adapter_and_residual_equal_peft(tiny_ckpt, how):
    from peft import LoraConfig, get_peft_model

    ours = principal(tiny_ckpt, how)
    ref = get_peft_model(
        hf_model(tiny_ckpt), LoraConfig(r=4, lora_alpha=8, target_modules=HF_TARGETS, init_lora_weights=how)
    )
    theirs = {
        k.replace("base_model.model.", "").replace(".default", "").replace(".base_layer", ""): v
        for k, v in ref.state_dict().items()
    }
    for name, value in ours.state_dict().items():
        key = name.replace(".base_layer", "")
        if "lora_" in name or name.endswith("_proj.base_layer.weight"):
            assert torch.allclose(value, theirs[key], atol=1e-5), name


@pytest.mark.parametrize("how", ["pissa", "olora"])
def test_the_saved_adapter_gives_our_outputs_in_peft_on_the_original_base(tiny_ckpt, tmp_path, how):
    from peft import PeftModel

    ours = principal(tiny_ckpt, how)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # as if trained
        for m in lora_modules(ours).values():
            m.lora_A.weight.add_(torch.randn(m.lora_A.weight.shape, generator=g) * 0.05)
            m.lora_B.weight.add_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
    save_adapter(ours, tmp_path / "plain")
    ref = PeftModel.from_pretrained(hf_model(tiny_ckpt), tmp_path / "plain").eval()
    assert ref.peft_config["default"].r == 8 and ref.peft_config["default"].lora_alpha == 16
    with torch.no_grad():
        assert rel(ours(ids()), ref(ids()).logits) < 1e-4
    # the form checkpoints keep: rank r on the residual, rebuilt from the original base when loaded
    save_adapter(ours, tmp_path / "as-trained", plain=False)
    again = load_model(tiny_ckpt)
    load_adapter(again, tmp_path / "as-trained")
    with torch.no_grad():
        assert rel(again(ids()), ours(ids())) < 1e-5


def test_a_quantized_base_quantizes_the_residual(tiny_ckpt, tmp_path):
    from lora_llama.loading.adapted import adapted_model
    from lora_llama.quant.handlers import Int8
    from lora_llama.quant.linear import QuantizedLinear

    r = load_recipe(
        None,
        [
            f"model.source={tiny_ckpt}",
            "model.quantize=int8",
            "lora.init_lora_weights=pissa",
            "lora.r=4",
            "lora.alpha=8",
            "lora.targets=[q,v]",
            "model.device=cpu",
        ],
    )
    model, _ = adapted_model(r.model.source, r.lora, quantize=r.model.quantize)
    layer = lora_modules(model)["model.layers.0.self_attn.q_proj"]
    assert type(layer.base_layer) is QuantizedLinear
    plain = principal(tiny_ckpt, "pissa")  # the float residual, quantized here by hand
    residual = lora_modules(plain)["model.layers.0.self_attn.q_proj"].base_layer.weight
    assert torch.allclose(layer.base_layer.dequantize(torch.float32), Int8().roundtrip(residual), atol=1e-6)


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["lora.init_lora_weights=pissa", "lora.dropout=0.1"], "which lora.dropout would drop"),
        (["lora.init_lora_weights=olora", "model.quantize=source"], "model.quantize source keeps"),
        (["lora.init_lora_weights=pisa"], "unknown init_lora_weights 'pisa'"),
        (["lora.init_lora_weights=pissa", "lora.use_dora=true"], "with lora.use_dora is not supported"),
    ],
)
def test_init_recipe_errors_are_one_line(overrides, words):
    with pytest.raises(UserError, match=words):
        load_recipe(None, overrides)


def test_a_pissa_run_saves_an_adapter_that_peft_loads_on_the_original_base(tiny_ckpt, tmp_path):
    from peft import PeftModel
    from test_train import chat_file, recipe

    from lora_llama.training.from_recipe import train_from_recipe

    r = recipe(
        tiny_ckpt,
        chat_file(tmp_path / "d.jsonl"),
        tmp_path / "run",
        "lora.init_lora_weights=pissa",
        "lora.dropout=0",
        "lora.r=4",
        "lora.alpha=8",
        "train.max_steps=3",
        "train.lr=1e-2",
    )
    train_from_recipe(r, log=lambda *_: None)
    ours = load_model(tiny_ckpt)
    load_adapter(ours, tmp_path / "run" / "adapter")  # the plain form: rank 8 on the original base
    resumed = load_model(tiny_ckpt)
    load_adapter(resumed, tmp_path / "run" / "checkpoints" / "step-3" / "adapter")  # as trained, rank 4
    ref = PeftModel.from_pretrained(hf_model(tiny_ckpt), tmp_path / "run" / "adapter").eval()
    with torch.no_grad():
        want = ref(ids()).logits
        assert rel(ours(ids()), want) < 1e-4 and rel(resumed(ids()), want) < 1e-4
        assert rel(want, load_model(tiny_ckpt)(ids())) > 1e-3  # the adapter trained
