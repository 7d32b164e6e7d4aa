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
from lora_llama.recipe.schema import load_recipe
from lora_llama.studio.form import base_recipes
from lora_llama.training.run_folder import ADAPTER, read_run_recipe, run_of_adapter

REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# where adapters and written models lie in a runs folder: a run's final adapter and its checkpoints', or a folder
# of one's own (an adapter copied in); a run's merged model and its GGUF export
ADAPTERS = ("*/adapter_config.json", "*/*/adapter_config.json", "*/checkpoints/step-*/adapter/adapter_config.json")
WRITTEN_MODELS = ("*/merged/config.json", "*/model.gguf")


def _visible(path: Path, runs: Path) -> bool:
    """Not a half-written temporary (atomic writes' and the studio's own files start with a dot)."""
    return not any(part.startswith(".") for part in path.relative_to(runs).parts)


def chat_choices(runs: Path) -> dict:
    """{"models": the model sources a chat may load, "adapters": [{"path": under runs, "model": its base}]}."""
    models = []
    for recipe in base_recipes(runs).values():
        try:
            models.append(load_recipe(recipe).model.source)
        except UserError:  # a recipe the schema refuses names no model to offer
            continue
    models += [str(p.parent if p.name == "config.json" else p) for g in WRITTEN_MODELS for p in sorted(runs.glob(g))]
    adapters = []
    for config in sorted({p for g in ADAPTERS for p in runs.glob(g) if _visible(p, runs)}):
        run = run_of_adapter(config.parent)
        named = read_run_recipe(run).get("model", {}).get("source") if run else None
        base = named or json.loads(config.read_text()).get("base_model_name_or_path")
        adapters.append({"path": str(config.parent.relative_to(runs)), "model": base})
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
    if not (adapter / "adapter_config.json").is_file():
        raise UserError(f"{run.name} has no adapter yet: it must finish first")
    base = read_run_recipe(run)["model"]["source"]
    if action == "merge":
        return ["merge", "--base", base, "--adapter", str(adapter), "--out", str(run / "merged"), "--force"]
    if action == "export":
        return ["export", "--base", base, "--adapter", str(adapter), "--out", str(run / "model.gguf"), "--force"]
    if action == "push":
        if not REPO_ID.match(repo_id):
            raise UserError(f"push needs a repository as USER/NAME (got {repo_id!r})")
        return ["push", str(adapter), "--repo-id", repo_id, *(["--private"] if private else [])]
    raise UserError(f"unknown action {action!r} (merge, export, push)")
