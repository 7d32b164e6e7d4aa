"""lora.modules_to_save and lora.trainable_token_indices against peft: adapters open in peft (and peft's in ours)
with the same logits, merge to peft's merge_and_unload, train only what they name, and refuse what they cannot do."""

import json

import pytest
import torch

from helpers import build_checkpoint, hf_model, one_error_line, random_lora_b, token_ids
from lora_llama import LoraSettings, apply_lora, load_adapter, load_model, save_adapter
from lora_llama.cli import main
from lora_llama.errors import UserError
from lora_llama.lora.adapted import adapters_disabled

# token ids the test batch holds, so that trained rows change the logits
ROWS = [5, 17, 40]
CASES = {
    "whole": dict(modules_to_save=["embed_tokens", "lm_head"]),
    "embedding": dict(modules_to_save=["embed_tokens"]),
    "head": dict(modules_to_save=["lm_head"]),
    "rows": dict(trainable_token_indices=ROWS),
    "rows_of_both": dict(trainable_token_indices={"embed_tokens": ROWS, "lm_head": [7, 40]}),
}


def ids() -> torch.Tensor:
    x = token_ids(2, 16, seed=3)
    x[0, :3] = torch.tensor(ROWS)
    return x


def moved(model, seed: int = 2) -> None:
    """Every trained tensor moved off its start (seeded), as training would."""
    random_lora_b(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "lora" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def base(request, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("emb"), tie_word_embeddings=request.param, seed=4)


def cases(base) -> list[str]:
    tied = json.loads((base / "config.json").read_text())["tie_word_embeddings"]
    return [c for c in CASES if not (tied and c == "rows_of_both")]


@pytest.mark.parametrize("case", list(CASES))
def test_our_adapter_opens_in_peft_and_merges_as_peft_does(base, case, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if case not in cases(base):
        pytest.skip("a tied lm_head has no rows of its own")
    model = load_model(base)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=["q", "v"], **CASES[case]))
    moved(model)
    save_adapter(model, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert {k: config[k] for k in CASES[case]} == CASES[case]
    x = ids()
    with torch.no_grad():
        ours = model(x)
        with adapters_disabled(model):
            assert (model(x) - hf_model(base)(x).logits).abs().max() < 1e-5  # the frozen originals answer
        peft = PeftModel.from_pretrained(hf_model(base), tmp_path / "a")
        assert (peft(x).logits - ours).abs().max() < 1e-5
        reloaded = load_model(base)
        load_adapter(reloaded, tmp_path / "a")
        assert (reloaded(x) - ours).abs().max() < 1e-6
        assert main(["merge", "--base", str(base), "--adapter", str(tmp_path / "a"), "--out", str(tmp_path / "m")]) == 0
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)(x).logits
        assert (merged - peft.merge_and_unload()(x).logits).abs().max() < 1e-5
        load_adapter(native := load_model(base), tmp_path / "a")
        from lora_llama.lora.adapted import merge_lora

        merge_lora(native)
        assert (native(x) - merged).abs().max() < 1e-4


@pytest.mark.parametrize("case", ["whole", "rows", "rows_of_both"])
def test_peft_adapter_opens_here(base, case, tmp_path):
    from peft import LoraConfig, get_peft_model

    if case not in cases(base):
        pytest.skip("a tied lm_head has no rows of its own")
    torch.manual_seed(0)
    peft = get_peft_model(hf_model(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **CASES[case]))
    moved(peft)
    peft.save_pretrained(tmp_path / "p")
    model = load_model(base)
    load_adapter(model, tmp_path / "p")
    x = ids()
    with torch.no_grad():
        assert (model(x) - peft(x).logits).abs().max() < 1e-5


def test_training_changes_only_the_named_rows(tmp_path):
    """One optimizer step through the chunked loss: the listed rows move, every other row and the base stay."""
    from lora_llama.lora.tokens import TrainableTokens
    from lora_llama.objectives.token_losses import target_loss

    folder = build_checkpoint(tmp_path / "b", tie_word_embeddings=True)
    model = load_model(folder)
    apply_lora(model, LoraSettings(r=4, targets=["q"], trainable_token_indices=ROWS))
    assert isinstance(model.lm_head, TrainableTokens)  # the tied head reads the same rows
    before = model.model.embed_tokens.trainable_tokens_delta.detach().clone()
    base = model.model.embed_tokens.weight.detach().clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = ids()
    loss, _ = target_loss(model, x, x)
    loss.backward()
    grad = model.model.embed_tokens.trainable_tokens_delta.grad
    assert grad is not None and (grad.abs().sum(1) > 0).all()
    optimizer.step()
    assert (model.model.embed_tokens.trainable_tokens_delta - before).abs().min() > 0
    assert torch.equal(model.model.embed_tokens.weight, base)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(modules_to_save=["embed_tokens"], trainable_token_indices=[3]), "pick one"),
        (dict(targets=["q", "lm_head"], modules_to_save=["lm_head"]), "pick one"),
        (dict(trainable_token_indices=[3, 3]), "distinct"),
        (dict(trainable_token_indices=[-1]), "distinct"),
        (dict(modules_to_save=["norm"]), "modules_to_save"),
    ],
)
def test_settings_refused_in_one_line(settings, message):
    from lora_llama.lora.settings import lora_settings

    with pytest.raises(UserError, match=message):
        lora_settings(**settings)


def test_bad_uses_are_one_line(tiny_ckpt, tmp_path, capsys):
    model = load_model(tiny_ckpt)
    with pytest.raises(UserError, match="past the vocabulary"):
        apply_lora(model, LoraSettings(targets=["q"], trainable_token_indices=[300]))
    model = load_model(tiny_ckpt)
    apply_lora(model, LoraSettings(r=4, targets=["q"], modules_to_save=["lm_head"]))
    save_adapter(model, tmp_path / "a")
    assert main(["export", "--adapter", str(tmp_path / "a"), "--lora-gguf", str(tmp_path / "a.gguf")]) == 2
    err = capsys.readouterr().err
    assert one_error_line(err) and "export the merged model" in err and not (tmp_path / "a.gguf").exists()


@pytest.mark.parametrize("case", ["embedding", "rows"])
def test_export_writes_the_trained_embeddings(case, tmp_path, capsys):
    """A GGUF export of base + adapter reads back (transformers' GGUF reader) as the merged checkpoint: the
    untied copy of a tied embedding (modules_to_save), or its trained rows shared with lm_head."""
    from test_export import assert_same_model

    base = build_checkpoint(tmp_path / "base", tie_word_embeddings=True, seed=4)
    model = load_model(base)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=["q", "v"], **CASES[case]))
    moved(model)
    save_adapter(model, tmp_path / "a")
    assert main(["merge", "--base", str(base), "--adapter", str(tmp_path / "a"), "--out", str(tmp_path / "m")]) == 0
    out = tmp_path / "g" / "model.gguf"
    out.parent.mkdir()
    assert main(["export", "--base", str(base), "--adapter", str(tmp_path / "a"), "--out", str(out)]) == 0
    capsys.readouterr()
    assert_same_model(out, tmp_path / "m", "f16", 300)
