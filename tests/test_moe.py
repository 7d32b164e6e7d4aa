"""Mixtral, Qwen2-MoE and Qwen3-MoE in the native model, each against transformers' own class (tiny random configs
made with transformers' config classes: no mixture-of-experts checkpoint can be downloaded here) and peft."""

import json

import pytest
import torch

from helpers import ROOT, build_checkpoint, hf_model, token_ids
from lora_llama import LoraSettings, apply_lora, load_model
from lora_llama.cli import main
from lora_llama.errors import UserError
from lora_llama.model.moe import load_balancing_loss, router_loss
from lora_llama.objectives.token_losses import target_loss

MOE = {  # name: (model_type, config overrides): 8 experts, top 2, with a dense layer where the family has one
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    "qwen3_moe": (
        "qwen3_moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16, norm_topk_prob=True),
    ),
    "qwen3_moe_dense_layer": (
        "qwen3_moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16, mlp_only_layers=[0]),
    ),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            decoder_sparse_step=2,  # layer 0 dense, layer 1 the mixture
        ),
    ),
}
ATTENTION = ["q", "k", "v", "o"]


@pytest.fixture(scope="module", params=MOE)
def moe(request, tmp_path_factory):
    model_type, overrides = MOE[request.param]
    folder = build_checkpoint(
        tmp_path_factory.mktemp(request.param) / "ckpt", family=model_type, router_aux_loss_coef=0.02, **overrides
    )
    return request.param, folder


def with_router_logits(folder, tmp_path):
    """A copy of the checkpoint whose config asks for the load-balancing loss in training."""
    import shutil

    copy = shutil.copytree(folder, tmp_path / "routed")
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "output_router_logits": True}))
    return copy


def test_logits_match_transformers_own_class(moe):
    name, folder = moe
    x = token_ids(2, 40, 1)
    with torch.no_grad():
        assert (load_model(folder)(x) - hf_model(folder)(x).logits).abs().max() < 1e-4


def test_loss_with_and_without_the_router_loss_equals_transformers(moe, tmp_path):
    """transformers' loss is the mean cross-entropy plus router_aux_loss_coef times its load-balancing loss
    when the config sets output_router_logits; so is the native model's training loss."""
    _, folder = moe
    x = token_ids(2, 40, 3)
    for routed in (False, True):
        source = with_router_logits(folder, tmp_path / str(routed)) if routed else folder
        model, ref = load_model(source).train(), hf_model(source).train()
        loss, n = target_loss(model, x, x)
        extra = router_loss(model)
        out = ref(input_ids=x, labels=x)
        assert abs(float(loss / n + extra) - float(out.loss)) < 1e-5
        assert isinstance(extra, torch.Tensor) == routed
        if routed:
            assert abs(float(load_balancing_loss(model.router_logits, model.args.moe)) - float(out.aux_loss)) < 1e-6


def test_training_gradients_equal_peft_on_transformers(moe, tmp_path):
    """LoRA on the attention of a mixture, router loss on: the adapter's gradients equal peft's."""
    from peft import LoraConfig, get_peft_model

    _, folder = moe
    source = with_router_logits(folder, tmp_path)
    x = token_ids(2, 30, 4)
    model = load_model(source).train()
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ATTENTION))
    peft = get_peft_model(
        hf_model(source).train(), LoraConfig(r=4, lora_alpha=8, target_modules=[f"{t}_proj" for t in ATTENTION])
    )
    theirs = {k.removeprefix("base_model.model.").replace(".default", ""): p for k, p in peft.named_parameters()}
    with torch.no_grad():  # the same non-zero B in both, so every path carries a gradient
        for n, p in model.named_parameters():
            if "lora_" in n:
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
                theirs[n].copy_(p)
    loss, n = target_loss(model, x, x)
    (loss / n + router_loss(model)).backward()
    peft(input_ids=x, labels=x).loss.backward()
    ours = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert len(ours) == 2 * 4 * 2 and all(theirs[k].grad is not None for k in ours)
    for k in ours:
        assert (ours[k] - theirs[k].grad).abs().max() < 1e-5, k


def test_a_moe_checkpoint_trains_from_a_recipe(moe, tmp_path, chat_data):
    _, folder = moe
    args = [
        "train",
        str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
        f"model.source={folder}",
        f"data.source={chat_data}",
        "lora.targets=[q,v]",
        "train.max_steps=2",
        "train.batch_size=2",
        f"output.dir={tmp_path / 'run'}",
    ]
    assert main(args) == 0
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_checkpoint_with_a_wrong_expert_shape_is_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = build_checkpoint(tmp_path / "ckpt", family="qwen3_moe", **MOE["qwen3_moe"][1])
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    tensors[key] = tensors[key][:-1]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # the checkpoint's own writing
    assert main(["generate", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{key} has shape (23, 64), config.json implies (24, 64)" in err


def test_lora_on_a_mixtures_mlp_names_what_the_layer_has(moe):
    name, folder = moe
    model = load_model(folder)
    sparse = model.args.moe.sparse_layers[0]
    with pytest.raises(
        UserError, match=f"layer {sparse} of this .* model is a mixture of experts, with no mlp.up_proj"
    ):
        apply_lora(model, LoraSettings(r=4, targets=["q", "up"]))
    dense = [i for i in range(model.args.n_layers) if i not in model.args.moe.sparse_layers]
    if dense:  # the dense layers' MLPs take LoRA as a dense model's do
        summary = apply_lora(model, LoraSettings(r=4, targets=["up"], layers=dense))
        assert summary["trainable"] == len(dense) * 4 * (64 + model.args.intermediate_size)


def test_merge_folds_attention_adapters_and_export_stacks_the_experts(moe, tmp_path, capsys):
    """merge streams the experts' tensors through unchanged and transformers loads the folder with the merged
    model's logits; export stacks each layer's experts into one (E, out, in) tensor per weight, as llama.cpp's
    converter does, with the router in float32 and the experts' counts in the metadata."""
    from gguf import GGUFReader

    from lora_llama import save_adapter

    _, folder = moe
    model = load_model(folder)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ATTENTION))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    save_adapter(model, tmp_path / "adapter")
    merged = tmp_path / "m"
    assert main(["merge", "--base", str(folder), "--adapter", str(tmp_path / "adapter"), "--out", str(merged)]) == 0
    x = token_ids(2, 24, 5)
    with torch.no_grad():
        assert (hf_model(merged)(x).logits - model.eval()(x)).abs().max() < 1e-4
    moe_args = load_model(merged).args.moe
    export = ["export", "--base", str(merged), "--out", str(tmp_path / "m.gguf"), "--type", "bf16"]
    if len(moe_args.sparse_layers) < model.args.n_layers:  # llama.cpp's mixtures have no dense layers
        capsys.readouterr()
        assert main(export) == 2 and "reads a mixture of experts in every layer" in capsys.readouterr().err
        assert not (tmp_path / "m.gguf").exists()
        return
    assert main(export) == 0
    reader = GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    assert reader.fields[f"{arch}.expert_count"].contents() == moe_args.num_experts
    assert reader.fields[f"{arch}.expert_used_count"].contents() == moe_args.top_k
    ref = hf_model(merged).model.layers
    for i in moe_args.sparse_layers:
        experts = ref[i].mlp.experts
        half = experts.gate_up_proj.shape[1] // 2
        want = {"gate": experts.gate_up_proj[:, :half], "up": experts.gate_up_proj[:, half:], "down": experts.down_proj}
        for part, w in want.items():
            t = tensors[f"blk.{i}.ffn_{part}_exps.weight"]
            assert tuple(int(d) for d in reversed(t.shape)) == tuple(w.shape)  # GGUF lists dims innermost first
            got = torch.from_numpy(t.data.copy()).view(torch.bfloat16).float().reshape(w.shape)
            assert torch.equal(got, w.detach().bfloat16().float())
        assert tensors[f"blk.{i}.ffn_gate_inp.weight"].tensor_type.name == "F32"


def test_fsdp_on_a_mixture_is_one_line(moe, chat_data):
    from lora_llama.loading.models import model_source
    from lora_llama.recipe.schema import load_recipe
    from lora_llama.runtime.distributed import Ranks
    from lora_llama.training.from_recipe import _choose_strategy

    _, folder = moe
    two = Ranks(rank=0, world=2)
    fsdp = load_recipe(None, [f"data.source={chat_data}", "train.distributed=fsdp"])
    with pytest.raises(UserError, match="train.distributed=fsdp on a mixture of experts is not supported; use ddp"):
        _choose_strategy(fsdp, two, "cpu", model_source(str(folder)))
    assert (
        _choose_strategy(load_recipe(None, [f"data.source={chat_data}"]), two, "cpu", model_source(str(folder)))
        == "ddp"
    )


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_a_mixture_exported_to_gguf_reads_back_as_the_model_it_was(name, tmp_path):
    """A Qwen3-MoE / Qwen2-MoE GGUF (written by export, as llama.cpp's converter writes one) is read as a base: each
    tensor is the checkpoint's, rounded to bf16 where the file holds bf16; the experts' sizes and the top-k
    renormalisation, which transformers' GGUF config mapping drops, are the checkpoint's; and transformers' own class
    on the folder read gives the native model's logits on the file."""
    from safetensors.torch import load_file

    from lora_llama.loading.models import gguf_to_folder

    model_type, overrides = MOE[name]
    overrides = {**overrides, "vocab_size": 300, "decoder_sparse_step": 1}  # a mixture in every layer, as llama.cpp
    folder = build_checkpoint(tmp_path / "ckpt", family=model_type, **overrides)
    assert main(["export", "--base", str(folder), "--out", str(tmp_path / "m.gguf"), "--type", "bf16"]) == 0
    read = gguf_to_folder(tmp_path / "m.gguf")
    want_cfg, got_cfg = (json.loads((f / "config.json").read_text()) for f in (folder, read))
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok"):
        assert got_cfg.get(key) == want_cfg.get(key), key
    assert got_cfg["norm_topk_prob"] == want_cfg.get("norm_topk_prob", False)
    want, got = hf_model(folder).state_dict(), load_file(read / "model.safetensors")
    assert set(got) <= set(want) and "lm_head.weight" not in set(want) - set(got)
    for key, w in got.items():
        assert w.shape == want[key].shape, key
        assert torch.equal(w, want[key]) or torch.equal(w, want[key].bfloat16().float()), key
    x = token_ids(2, 24, 5)
    with torch.no_grad():
        assert (hf_model(read)(x).logits - load_model(tmp_path / "m.gguf")(x)).abs().max() < 1e-4


def test_a_mixtral_gguf_file_is_one_line(tmp_path, capsys):
    """Mixtral's GGUF form (llama.cpp's llama with experts) is not read (transformers reads it as a dense Llama):
    one line, nothing cached."""
    folder = build_checkpoint(tmp_path / "ckpt", family="mixtral", **{**MOE["mixtral"][1], "vocab_size": 300})
    assert main(["export", "--base", str(folder), "--out", str(tmp_path / "m.gguf")]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "m.gguf"), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mixture of experts in llama.cpp's llama architecture, which is not" in err


def test_routing_llama_cpp_computes_otherwise_has_no_gguf_form(tmp_path, capsys):
    """llama.cpp's qwen3moe renormalises the chosen experts' weights: a Qwen3-MoE with norm_topk_prob false is one
    line, and no file."""
    overrides = {**MOE["qwen3_moe"][1], "norm_topk_prob": False}
    folder = build_checkpoint(tmp_path / "ckpt", family="qwen3_moe", **overrides)
    capsys.readouterr()
    assert main(["export", "--base", str(folder), "--out", str(tmp_path / "m.gguf")]) == 2
    assert "qwen3moe renormalises the chosen experts' weights" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
