"""Every recipe a page shows trains: each YAML block of README.md and docs/ is loaded as a recipe and trained for one
step (or its epochs, where it sets them) on the tiny random model, with small data files of its formats made under
the names it gives, so that a recipe a page tells users to copy cannot fail where it stands."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from test_docs import code_blocks

from helpers import ROOT, build_checkpoint

SNIPPETS = code_blocks("yaml")
ROWS = 8  # a few examples of each shape: a step's batch, and an epoch of one or two steps
QUESTIONS = [(f"what is {i} plus {i}?", f"{2 * i}") for i in range(ROWS)]


def rows_of(fmt: str) -> list:
    """ROWS records in a data format's shape (docs/data.md's table)."""
    if fmt == "text":
        return [f"{q} The answer is {a}." for q, a in QUESTIONS]
    if fmt == "preference":
        return [{"prompt": q, "chosen": f"It is {a}.", "rejected": "No idea."} for q, a in QUESTIONS]
    if fmt == "unpaired":
        return [{"prompt": q, "completion": f"It is {a}.", "label": i % 2 == 0} for i, (q, a) in enumerate(QUESTIONS)]
    if fmt == "prompt":
        return [{"prompt": q, "answer": a} for q, a in QUESTIONS]
    return [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": f"It is {a}."}]}
        for q, a in QUESTIONS
    ]  # chat: ShareGPT's shape, which the chat format reads beside messages


def write_data(path, fmt: str) -> None:
    """A data file under the name a snippet gives it (a glob's first match), in its format."""
    path = path.parent / path.name.replace("*", "part-0")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = rows_of(fmt)
    if fmt == "text":
        path.write_text("\n".join(rows) + "\n")
    elif path.suffix == ".json":  # a JSON array, as exported data sets often are
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def local(source: str) -> bool:
    return "." in source.rsplit("/", 1)[-1]  # a file name (registered data sets and Hub ids have no suffix)


def make_files(recipe: dict, folder) -> None:
    """The files a snippet names, made in the folder it runs in: data in its format, reward functions."""
    data = recipe.get("data") or {}
    fmt = data.get("format", "chat")
    sources = [(s["source"], s.get("format", fmt)) for s in data.get("sources", [])]
    sources += [(data[k], fmt) for k in ("source", "val_source") if k in data]
    for source, source_fmt in sources:
        if local(source):
            write_data(folder / source, source_fmt)
    rewards = ((recipe.get("train") or {}).get("grpo") or {}).get("rewards", [])
    for reward in rewards:
        module = reward.split(":")[0] if ":" in reward else None
        if module and not (folder / module).exists():
            (folder / module).write_text(
                "def correct(prompts, completions, answer, **columns):\n    return [0.5] * len(completions)\n"
            )


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """The tiny random model with room for the longer token sequences its small vocabulary makes."""
    return build_checkpoint(tmp_path_factory.mktemp("stand-in"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def moe_stand_in(tmp_path_factory):
    """The same, as a mixture of experts (Qwen3-MoE), for a recipe whose adapter targets experts."""
    return build_checkpoint(
        tmp_path_factory.mktemp("moe-stand-in"),
        family="qwen3_moe",
        max_position_embeddings=4096,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        head_dim=16,
    )


@pytest.mark.parametrize("page,block", SNIPPETS, ids=[f"{page}-{i}" for i, (page, _) in enumerate(SNIPPETS)])
def test_a_recipe_a_page_shows_trains(page, block, stand_in, moe_stand_in, tmp_path, monkeypatch):
    from lora_llama.cli import main

    recipe = yaml.safe_load(block) or {}
    if "experts" in ((recipe.get("lora") or {}).get("targets") or []):
        stand_in = moe_stand_in
    for folder in ("recipes", "tasks"):  # recipes/tools/..., tasks/ as the pages name them, from the checkout
        (tmp_path / folder).symlink_to(ROOT / folder)
    make_files(recipe, tmp_path)
    (tmp_path / "recipe.yaml").write_text(block)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")  # the trackers a page names write locally
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:./mlruns")  # the local store docs/tracking.md gives
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    train = recipe.get("train") or {}
    steps = [] if train.get("epochs") else ["train.max_steps=1"]  # where epochs decide, they decide here too
    overrides = [f"model.source={stand_in}", f"output.dir={tmp_path / 'run'}", "train.eval_every=1000", *steps]
    data = recipe.get("data") or {}
    if "max_seq_len" in data:  # the stand-in's 300-token vocabulary spells a text in several times a real one's tokens
        overrides.append(f"data.max_seq_len={8 * data['max_seq_len']}")
    if data.get("val_source") is None and not data.get("streaming"):
        overrides.append("data.val_size=0.25")
    assert main(["train", "recipe.yaml", *overrides]) == 0, f"{page}: {block}"
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("step" in m for m in metrics) and (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    assert os.path.isfile(tmp_path / "run" / "recipe.yaml")
