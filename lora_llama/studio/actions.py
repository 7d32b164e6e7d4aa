"""What the page asks of models and adapters, as the CLI's commands: chat (`generate` of a model alone and with an
adapter, side by side, on the same prompt and seed) and ship (`merge`, `export` to GGUF, `push` to the Hub) of a
finished run. A chat's model is one a recipe names (a shipped one's or a run's) or one a run wrote (merged, GGUF),
its adapter one under the runs folder; what ship writes stays in the run folder. A Hub token comes from the
environment or huggingface_hub's login, as `push` finds it: the page never sees one."""

from __future__ import annotations

import json
import re
from pathlib import Path

from lora_llama.errors import UserError
from lora_llama.loading.adapters import ADAPTER_CONFIG
from lora_llama.recipe.schema import load_recipe
from lora_llama.studio.form import base_recipes
from lora_llama.training.run_folder import (
    ADAPTER,
    EXPORTED,
    MERGED,
    adapters_under,
    read_run_recipe,
    run_of_adapter,
    written_models,
)

REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
SHIP = ("merge", "export", "push")  # what a finished run's page ships, each a job of its own


def chat_choices(runs: Path) -> dict:
    """{"models": the model sources a chat may load, "adapters": [{"path": under runs, "model": its base}]}."""
    models = []
    for recipe in base_recipes(runs).values():
        try:
            models.append(load_recipe(recipe).model.source)
        except UserError:  # a recipe the schema refuses names no model to offer
            continue
    models += [str(p) for p in written_models(runs)]
    adapters = []
    for folder in adapters_under(runs):
        run = run_of_adapter(folder)
        named = read_run_recipe(run).get("model", {}).get("source") if run else None
        base = named or json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        adapters.append({"path": str(folder.relative_to(runs)), "model": base})
        models += [base] if base else []
    return {"models": list(dict.fromkeys(m for m in models if m)), "adapters": adapters}


def chat_commands(runs: Path, model: str, adapter: str, prompt: str, **settings) -> dict[str, list]:
    """{log name: generate's arguments} for the model alone ("chat-base") and, when an adapter is named, with it
    ("chat-adapter"), on one prompt through the chat template. settings: seed, max_new_tokens, temperature."""
    choices = chat_choices(runs)
    if model not in choices["models"]:
        raise UserError(f"unknown model {model!r}: chat loads a model a recipe names or a run wrote")
    if adapter and adapter not in [a["path"] for a in choices["adapters"]]:
        raise UserError(f"no adapter {adapter!r} under {runs}")
    if not prompt.strip():
        raise UserError("write a prompt first")
    common = ["generate", "--model", model, "--chat", "--prompt", prompt]
    for key, value in settings.items():
        common += [f"--{key.replace('_', '-')}", str(value)]
    made = {"chat-base": common}
    return {**made, "chat-adapter": [*common, "--adapter", str(runs / adapter)]} if adapter else made


def ship_command(run: Path, action: str, repo_id: str = "", private: bool = True) -> list[str]:
    """merge into run/merged, export to run/model.gguf, or push the adapter to a Hub repository (a new one private
    unless asked otherwise: a fine-tune is published only by choice)."""
    adapter = run / ADAPTER
    if not (adapter / ADAPTER_CONFIG).is_file():
        raise UserError(f"{run.name} has no adapter yet: it must finish first")
    base = read_run_recipe(run)["model"]["source"]
    if action == "merge":
        return ["merge", "--base", base, "--adapter", str(adapter), "--out", str(run / MERGED), "--force"]
    if action == "export":
        return ["export", "--base", base, "--adapter", str(adapter), "--out", str(run / EXPORTED), "--force"]
    if action == "push":
        if not REPO_ID.match(repo_id):
            raise UserError(f"push needs a repository as USER/NAME (got {repo_id!r})")
        return ["push", str(adapter), "--repo-id", repo_id, *(["--private"] if private else [])]
    raise UserError(f"unknown action {action!r} (merge, export, push)")
