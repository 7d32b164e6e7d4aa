"""DoRA against peft (forward both ways, gradients, merge), its row norm by hand, and LoRA+'s first step."""

import pytest
import torch

from helpers import ALL, hf_model, rel
from helpers import token_ids as ids
from lora_llama import LoraSettings, apply_lora, load_model, save_adapter
from lora_llama.loading.adapters import load_adapter
from lora_llama.lora.adapted import lora_modules, merge_lora
from lora_llama.lora.layer import row_norms
from lora_llama.objectives.token_losses import target_loss


def dora_model(ckpt, quantize=None, seed=1):
    """Our model with DoRA on every decoder linear; B and the magnitudes moved off their start."""
    model = load_model(ckpt, quantize=quantize)
    torch.manual_seed(0)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL, use_dora=True))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
            m.lora_magnitude_vector.mul_(1 + 0.2 * torch.rand(m.lora_magnitude_vector.shape, generator=g))
    return model


def test_row_norms_equal_the_norm_of_the_sum():
    g = torch.Generator().manual_seed(0)
    w0, a, b = (torch.randn(s, generator=g) for s in ((48, 32), (4, 32), (48, 4)))
    direct = (w0 + 0.7 * b @ a).norm(dim=1)
    assert torch.allclose(row_norms(w0, a, b, 0.7, w0.square().sum(1)), direct, rtol=1e-5)


def test_our_dora_adapter_in_peft_gives_our_logits(tiny_ckpt, tmp_path):
    from peft import PeftModel

    ours = dora_model(tiny_ckpt)
    save_adapter(ours, tmp_path / "a")
    ref = PeftModel.from_pretrained(hf_model(tiny_ckpt), tmp_path / "a").eval()
    x = ids()
    with torch.no_grad():
        assert rel(ours(x), ref(x).logits) < 1e-5


def test_peft_dora_adapter_in_ours_gives_peft_logits(tiny_ckpt, tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    ref = get_peft_model(
        hf_model(tiny_ckpt),
        LoraConfig(
            r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
    )
    ref.save_pretrained(tmp_path / "p")
    ours = load_model(tiny_ckpt)
    load_adapter(ours, tmp_path / "p")
    x = ids()
    with torch.no_grad():
        assert rel(ours(x), ref.eval()(x).logits) < 1e-5


def test_dora_gradients_equal_peft(tiny_ckpt, tmp_path):
    from peft import PeftModel

    ours = dora_model(tiny_ckpt)
    save_adapter(ours, tmp_path / "a")
    ref = PeftModel.from_pretrained(hf_model(tiny_ckpt), tmp_path / "a", is_trainable=True).train()
    x = ids()
    ours.train()
    loss, n = target_loss(ours, x, x)
    (loss / n).backward()
    ref(x, labels=x).loss.backward()
    want = {
        k.replace("base_model.model.", "").replace(".default", ""): p.grad
        for k, p in ref.named_parameters()
        if p.grad is not None
    }
    want = {k.removesuffix(".weight") if "magnitude" in k else k: v for k, v in want.items()}
    grads = {k: p.grad for k, p in ours.named_parameters() if p.grad is not None}
    assert set(grads) == set(want) and len(grads) == 3 * 7 * 2
    for k in grads:
        assert torch.allclose(grads[k], want[k], atol=1e-6, rtol=1e-4), k


def test_dora_merges_as_peft_does(tiny_ckpt, tmp_path):
    from peft import PeftModel

    from lora_llama.outputs.merge import merge_checkpoint

    ours = dora_model(tiny_ckpt)
    save_adapter(ours, tmp_path / "a")
    x = ids()
    with torch.no_grad():
        adapted = ours(x)
        merge_lora(ours)
        in_place = ours(x)
    ref = PeftModel.from_pretrained(hf_model(tiny_ckpt), tmp_path / "a").merge_and_unload().eval()
    merge_checkpoint(str(tiny_ckpt), tmp_path / "a", tmp_path / "m", progress=False)
    streamed = hf_model(tmp_path / "m")
    with torch.no_grad():
        want = ref(x).logits
        assert rel(in_place, want) < 1e-5 and rel(adapted, want) < 1e-5 and rel(streamed(x).logits, want) < 1e-5


def test_dora_merge_and_unmerge_of_one_layer_round_trip(tiny_ckpt):
    model = dora_model(tiny_ckpt)
    layer = lora_modules(model)["model.layers.0.mlp.down_proj"]
    x = torch.randn(5, layer.in_features)
    w0 = layer.base_layer.weight.clone()
    with torch.no_grad():
        before = layer(x)
        layer.merge()
        merged = layer(x)
        layer.unmerge()
    assert torch.allclose(merged, before, atol=1e-5) and torch.allclose(layer.base_layer.weight, w0, atol=1e-6)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_dora_on_a_quantized_base_takes_the_norm_of_the_dequantized_weight(tiny_ckpt, kind):
    from lora_llama.quant.linear import QuantizedLinear

    model = dora_model(tiny_ckpt, quantize=kind)
    layer = lora_modules(model)["model.layers.1.self_attn.o_proj"]
    assert type(layer.base_layer) is QuantizedLinear
    w = layer.base_layer.dequantize(torch.float32)
    x = torch.randn(3, layer.in_features)
    direction = w + layer.scale * layer.lora_B.weight @ layer.lora_A.weight
    want = x @ (layer.lora_magnitude_vector[:, None] * direction / direction.norm(dim=1, keepdim=True)).t()
    with torch.no_grad():
        assert torch.allclose(layer(x), want, atol=1e-5)


def test_loraplus_first_step_moves_b_by_ratio_times_lr(tiny_ckpt, tmp_path):
    """AdamW's first step moves each tensor by about lr where its gradient is not ~0: B by ratio x lr, A (whose
    gradient is 0 while B is 0) not at all."""
    from test_train import chat_file, recipe

    from lora_llama.loading.adapted import adapted_model
    from lora_llama.loading.models import load_tokenizer
    from lora_llama.objectives.catalog import objective_named
    from lora_llama.training.trainer import Trainer

    moved = {}
    for ratio in (None, 16.0):
        r = recipe(
            tiny_ckpt,
            chat_file(tmp_path / "d.jsonl"),
            tmp_path / str(ratio),
            "train.lr=1e-4",
            f"train.loraplus_lr_ratio={ratio if ratio else 'null'}",
            "train.max_grad_norm=null",
        )
        model, _ = adapted_model(r.model.source, r.lora, quantize=r.model.quantize)
        tok = load_tokenizer(r.model.source)
        train, val = objective_named(r.train.objective).examples(r, tok, lambda *_: None)
        trainer = Trainer(r, model, tok, train, val, tmp_path / str(ratio))
        before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
        trainer.train_step()
        moved[ratio] = {k: (v.detach() - before[k]).abs().max() for k, v in model.named_parameters() if v.requires_grad}
    lr = 1e-4  # no warmup in test_train.recipe
    for k, plain in moved[None].items():
        if "lora_B" in k:
            assert abs(float(plain) / lr - 1) < 0.05 and abs(float(moved[16.0][k]) / (16 * lr) - 1) < 0.05, k
        else:
            assert float(plain) == 0 and float(moved[16.0][k]) == 0, k


def test_dora_on_nf4_merges_onto_the_dequantized_weights_it_trained_on(tiny_ckpt, tmp_path):
    from lora_llama.outputs.merge import merge_checkpoint

    trained = dora_model(tiny_ckpt, quantize="nf4")
    save_adapter(trained, tmp_path / "a")
    x = ids()
    merge_checkpoint(str(tiny_ckpt), tmp_path / "a", tmp_path / "m", progress=False, onto="dequantized", quantize="nf4")
    with torch.no_grad():
        assert rel(load_model(tmp_path / "m")(x), trained(x)) < 1e-5
