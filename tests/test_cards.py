"""What a run's model card and closing line say is its objective's own measures: a short run of each objective on
the tiny model, then `push --dry-run` (the card, printed) against the run's metrics.jsonl, read here."""

from __future__ import annotations

import json

import pytest

from helpers import chat_file, preference_file
from lora_llama.cli import main

QA = [("hi", "hello"), ("to be", "or not to be"), ("the quick", "brown fox"), ("how are you", "i am fine")] * 3


def data_for(objective: str, folder) -> list[str]:
    """The data overrides of a short run of the objective."""
    if objective in ("dpo", "kto"):  # KTO reads preference pairs too, as unpaired answers
        rows = [(q, a, "no idea") for q, a in QA]
        return [f"data.source={preference_file(folder / 'pairs.jsonl', rows)}", "data.format=preference"]
    if objective == "grpo":
        (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q, _ in QA))
        return [
            f"data.source={folder / 'prompts.jsonl'}",
            "data.format=prompt",
            "train.grpo.rewards=[format]",
            "train.grpo.group_size=2",
            "train.grpo.max_new_tokens=4",
            "train.batch_size=2",
        ]
    return [f"data.source={chat_file(folder / 'chat.jsonl', QA)}"]


def trained_card(objective: str, ckpt, folder, capsys) -> tuple[str, list[dict], str]:
    """(the card push --dry-run prints, the run's eval records, the training's closing lines)."""
    (folder / "empty.yaml").write_text("")
    run = folder / "run"
    args = ["train", str(folder / "empty.yaml"), f"model.source={ckpt}", f"output.dir={run}", "train.max_steps=2"]
    args += [f"train.objective={objective}", "train.eval_every=2", "data.val_size=0.25", "train.precision=fp32"]
    capsys.readouterr()
    assert main([*args, *data_for(objective, folder)]) == 0
    closing = capsys.readouterr().out
    assert main(["push", str(run), "--repo-id", "ann/tuned", "--dry-run"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return capsys.readouterr().out, [r for r in rows if any(k.startswith("eval_") for k in r)], closing


@pytest.mark.parametrize(
    ("objective", "headline", "name", "said"),
    [
        (
            "sft",
            "eval_loss",
            "eval loss",
            lambda e: [f"perplexity **{e['eval_perplexity']:.2f}**", "held-out examples"],
        ),
        (
            "dpo",
            "eval_loss",
            "eval loss",
            lambda e: [f"reward accuracy **{e['eval_rewards/accuracies']:.3f}**", "on held-out pairs"],
        ),
        (
            "kto",
            "eval_loss",
            "eval loss",
            lambda e: [
                f"reward margin (desirable minus undesirable) **{e['eval_rewards/margins']:.4f}**",
                f"KL to the reference **{e['eval_kl']:.4f}**",
                "on held-out answers judged one at a time",
            ],
        ),
        ("grpo", "eval_reward", "held-out reward", lambda e: ["on greedy completions of held-out prompts"]),
    ],
)
def test_a_card_states_the_objectives_own_measures(objective, headline, name, said, preference_ckpt, tmp_path, capsys):
    card, evals, closing = trained_card(objective, preference_ckpt, tmp_path, capsys)
    start, last = evals[0], evals[-1]
    assert (start["step"], last["step"]) == (0, 2)
    sentence = card.split("## Results\n\n")[1].split("\n")[0]
    before_after = f"**{start[headline]:.4f}** before training -> **{last[headline]:.4f}** (step 2)"
    assert sentence.startswith(f"{name[0].upper()}{name[1:]} {before_after}"), sentence
    assert all(part in sentence for part in said(last)), sentence
    assert "nan" not in sentence and (objective == "dpo") == ("pairs" in sentence), sentence
    assert f"{name} {start[headline]:.4f} (base model) -> {last[headline]:.4f} (adapter, step 2)" in closing
