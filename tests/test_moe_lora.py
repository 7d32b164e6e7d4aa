"""LoRA on a mixture's experts (`lora.targets: experts`) against peft's `target_parameters` adapters on
transformers' own class: the same gradients, adapters that load both ways with the same logits, merges."""

import json

import pytest
import torch
from test_moe import MOE as MIXTURES

from helpers import ROOT, build_checkpoint, hf_model, token_ids
from lora_llama import LoraSettings, apply_lora, load_adapter, load_model, save_adapter
from lora_llama.cli import main
from lora_llama.errors import UserError
from lora_llama.objectives.token_losses import target_loss

MOE = {name: MIXTURES[name] for name in ("mixtral", "qwen3_moe", "qwen2_moe")}  # one of each family
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module", params=MOE)
def moe(request, tmp_path_factory):
    model_type, overrides = MOE[request.param]
    return build_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", family=model_type, **overrides)


def peft_model(folder, targets=("q_proj", "v_proj")):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), target_parameters=EXPERT_PARAMETERS)
    return get_peft_model(hf_model(folder), config)


def randomized(model, seed=0):
    """Non-zero B everywhere, so every adapter changes the output and carries a gradient."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed + len(n)))
    return model


def test_adapter_gradients_equal_peft_target_parameters(moe, tmp_path):
    """Our adapter, saved and loaded into peft: the same logits, loss and gradient for every A and B."""
    from peft import PeftModel

    x = token_ids(2, 30, 4)
    model = load_model(moe).train()
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=["q", "v", "experts"]))
    randomized(model)
    save_adapter(model, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["target_parameters"] == EXPERT_PARAMETERS and config["target_modules"] == ["q_proj", "v_proj"]
    peft = PeftModel.from_pretrained(hf_model(moe), tmp_path / "ours", is_trainable=True).train()
    with torch.no_grad():
        assert (model(x) - peft(input_ids=x).logits).abs().max() < 1e-4
    loss, n = target_loss(model, x, x)
    (loss / n).backward()
    ref = peft(input_ids=x, labels=x)
    ref.loss.backward()
    assert abs(float(loss / n) - float(ref.loss)) < 1e-5
    theirs = {
        k.removeprefix("base_model.model.").replace(".default", ""): p.grad
        for k, p in peft.named_parameters()
        if p.grad is not None
    }
    ours = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert len(ours) == len(theirs)
    for k, g in ours.items():
        peft_key = k.replace("experts.gate_up_proj.lora_", "experts.base_layer.lora_").replace(
            "experts.down_proj.lora_", "experts.lora_"
        )
        assert (g - theirs[peft_key]).abs().max() < 1e-4, k


def test_peft_adapters_load_in_lora_llama_with_the_same_logits(moe, tmp_path):
    x = token_ids(2, 24, 5)
    peft = randomized(peft_model(moe)).eval()
    peft.save_pretrained(tmp_path / "theirs")
    model = load_model(moe)
    summary = load_adapter(model, tmp_path / "theirs")
    with torch.no_grad():
        assert (model.eval()(x) - peft(input_ids=x).logits).abs().max() < 1e-4
    assert summary["trainable"] == sum(p.numel() for p in peft.parameters() if p.requires_grad)


def test_merged_equals_unmerged_and_transformers_loads_it(moe, tmp_path):
    x = token_ids(2, 24, 6)
    model = load_model(moe)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=["experts", "o"]))
    randomized(model, seed=3)
    save_adapter(model, tmp_path / "adapter")
    args = ["merge", "--base", str(moe), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]
    assert main(args) == 0
    with torch.no_grad():
        adapted = model.eval()(x)
        assert (hf_model(tmp_path / "merged")(x).logits - adapted).abs().max() < 1e-4
        assert (load_model(tmp_path / "merged")(x) - adapted).abs().max() < 1e-4


def test_a_run_trains_the_experts_adapter(moe, tmp_path, chat_data):
    args = [
        "train",
        str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
        f"model.source={moe}",
        f"data.source={chat_data}",
        "lora.targets=[q,v,experts]",
        "train.max_steps=3",
        "train.batch_size=2",
        "train.lr=1e-2",
        f"output.dir={tmp_path / 'run'}",
    ]
    assert main(args) == 0
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    expert_b = [t for k, t in tensors.items() if k.endswith("mlp.experts.lora_B.weight")]
    assert expert_b and all(t.abs().sum() > 0 for t in expert_b)  # trained away from B = 0


def test_experts_on_a_dense_family_is_one_line(tiny_ckpt):
    with pytest.raises(UserError, match="lora.targets experts: this llama model has no mixture of experts"):
        apply_lora(load_model(tiny_ckpt), LoraSettings(targets=["q", "experts"]))


@pytest.mark.parametrize("change, message", [({"dropout": 0.1}, "dropout"), ({"use_dora": True}, "DoRA")])
def test_experts_refuse_what_peft_refuses(change, message):
    with pytest.raises(UserError, match=message):
        from lora_llama.lora.settings import lora_settings

        lora_settings(targets=["experts"], **change)


def test_merge_lora_in_memory_folds_the_experts_and_disabled_adapters_give_the_base(moe):
    from lora_llama import merge_lora
    from lora_llama.lora.adapted import adapters_disabled
    from lora_llama.lora.experts import expert_modules

    x = token_ids(2, 24, 10)
    model = load_model(moe)
    with torch.no_grad():
        base = model(x)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=["experts", "q"]))
    randomized(model, seed=5)
    with torch.no_grad():
        adapted = model.eval()(x)
        with adapters_disabled(model):  # the reference pass of DPO, ORPO, KTO and GRPO's KL
            assert torch.equal(model(x), base) and (adapted - base).abs().max() > 1e-3
        merge_lora(model)
        assert not expert_modules(model) and (model(x) - adapted).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_an_expert_adapter_as_a_llama_cpp_lora_gguf_is_the_merge_delta(name, tmp_path):
    """`export --lora-gguf` of an adapter on the experts: each stacked expert weight's lora_a (E, r, in) and lora_b
    (E, out, r), as llama.cpp's LoRA multiplies them per expert (ggml_mul_mat_id on both), times alpha / r give each
    expert's change of its gate, up and down weights that `merge` makes, within float32 rounding."""
    from gguf import GGUFReader

    model_type, overrides = MOE[name]
    folder = build_checkpoint(tmp_path / "ckpt", family=model_type, **overrides)
    model = load_model(folder)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=["q", "experts"]))
    save_adapter(randomized(model), tmp_path / "adapter")
    args = ["--base", str(folder), "--adapter", str(tmp_path / "adapter")]
    assert main(["export", *args, "--lora-gguf", str(tmp_path / "lora.gguf")]) == 0
    assert main(["merge", *args, "--out", str(tmp_path / "merged")]) == 0
    reader = GGUFReader(tmp_path / "lora.gguf")
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    scale = float(reader.fields["adapter.lora.alpha"].contents()) / 4
    base, merged = (hf_model(f).state_dict() for f in (folder, tmp_path / "merged"))
    E, layers = model.args.moe.num_experts, model.args.n_layers
    for i in range(layers):
        stack = f"model.layers.{i}.mlp.experts"
        gate_up = merged[f"{stack}.gate_up_proj"] - base[f"{stack}.gate_up_proj"]  # (E, 2I, H)
        half = gate_up.shape[1] // 2
        want = {"gate": gate_up[:, :half], "up": gate_up[:, half:]}
        want["down"] = merged[f"{stack}.down_proj"] - base[f"{stack}.down_proj"]
        for part, delta in want.items():
            a, b = tensors[f"blk.{i}.ffn_{part}_exps.weight.lora_a"], tensors[f"blk.{i}.ffn_{part}_exps.weight.lora_b"]
            assert a.shape == (E, 4, delta.shape[2]) and b.shape == (E, delta.shape[1], 4)
            got = scale * b @ a
            assert (got - delta).abs().max() < 1e-5 * max(1.0, float(delta.abs().max())), (i, part)
    assert {f"blk.{i}.attn_q.weight.lora_a" for i in range(layers)} <= set(tensors)
