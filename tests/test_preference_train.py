"""DPO and ORPO through lora-llama train: rewards and margins rise, bad recipes are one line, an int8 base is its
own reference."""

import json

import pytest
import torch

from helpers import PREFERENCE_ROWS, preference_file, preference_records
from lora_llama import load_model
from lora_llama.cli import main
from lora_llama.data.preference import collate_pairs, tokenize_pairs
from lora_llama.loading.models import load_tokenizer
from lora_llama.lora.adapted import adapters_disabled, apply_lora, lora_modules
from lora_llama.lora.settings import lora_settings
from lora_llama.objectives.dpo import DPO, DPOSettings
from lora_llama.recipe.schema import DataSection, load_recipe


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_trainer_raises_reward_accuracy_and_margin(objective, preference_ckpt, tmp_path):
    data = preference_file(tmp_path / "pairs.jsonl", PREFERENCE_ROWS * 2)
    out = tmp_path / "run"
    r = load_recipe(
        None,
        [
            f"model.source={preference_ckpt}",
            f"data.source={data}",
            "data.format=preference",
            f"train.objective={objective}",
            f"output.dir={out}",
            "data.val_size=0.25",
            "train.max_steps=30",
            "train.warmup_steps=0",
            "train.lr=5e-3",
            "train.batch_size=2",
            "train.eval_every=30",
            "train.save_every=100",
            "lora.targets=[q,k,v,o,gate,up,down]",
        ],
    )
    from lora_llama.training.from_recipe import train_from_recipe

    result = train_from_recipe(r, log=lambda *_: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "loss" in m]
    evals = [m for m in rows if "eval_loss" in m]
    assert len(steps) == 30 and {"rewards/margins", "rewards/accuracies"} <= set(steps[0])
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 30
    assert evals[-1]["eval_rewards/accuracies"] > 0.5
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"]
    assert result["eval_loss"] < evals[0]["eval_loss"]
    assert (out / "loss.png").is_file() and (out / "adapter" / "adapter_model.safetensors").is_file()
    from lora_llama.outputs.hub import model_card

    card = model_card(out / "adapter", out, "me/pref")
    assert (
        f"| objective | {objective.upper()} (beta " in card and "reward accuracy" in card and f"- {objective}" in card
    )


@pytest.mark.parametrize(
    "override, message",
    [
        (["train.objective=dpo"], "train.objective dpo reads data.format preference"),
        (["data.format=preference"], "not preference (which train.objective dpo, orpo, kto reads)"),
    ],
)
def test_bad_preference_recipes_exit_2(override, message, preference_ckpt, tmp_path, capsys):
    data = preference_file(tmp_path / "pairs.jsonl", PREFERENCE_ROWS)
    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: {preference_ckpt}}}\ndata: {{source: {data}}}\noutput: {{dir: {out}}}\n")
    assert main(["train", str(recipe), *override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


def test_dpo_on_an_int8_base_uses_the_int8_base_as_reference(preference_ckpt, tmp_path):
    from datasets import Dataset

    from lora_llama.objectives.token_losses import answer_logps

    tok = load_tokenizer(str(preference_ckpt))
    pairs, _ = tokenize_pairs(Dataset.from_list(preference_records(False)), tok, DataSection(max_seq_len=128))
    batch = collate_pairs(pairs, tok.pad_token_id)
    plain = load_model(preference_ckpt, quantize="int8")
    with torch.no_grad():
        expected = answer_logps(plain, batch)[0]
    model = load_model(preference_ckpt, quantize="int8")
    apply_lora(model, lora_settings(r=4, alpha=8, targets=["q", "v", "down"]))
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_B.weight, std=0.05)
    with torch.no_grad(), adapters_disabled(model):
        assert torch.equal(answer_logps(model, batch)[0], expected)
    terms, stats = DPO(DPOSettings(beta=0.1)).terms(model, batch)
    terms[0].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
    assert stats["rewards/margins"] != 0
