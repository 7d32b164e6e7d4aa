"""What the page asks of a run's adapter, as the CLI's commands: chat (`generate` of the base and of the adapter,
side by side, on the same prompt and seed) and ship (`merge`, `export` to GGUF, `push` to the Hub). The base is
the run's own `model.source`; what they write stays in the run folder. A Hub token comes from the environment or
huggingface_hub's login, as `push` finds it: the page never sees one."""

from __future__ import annotations

import re
from pathlib import Path

from lora_llama.errors import UserError
from lora_llama.training.run_folder import ADAPTER, read_run_recipe

REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _finished(run: Path) -> tuple[str, Path]:
    """The run's base model and its final adapter, or one line when it has none yet."""
    adapter = run / ADAPTER
    if not (adapter / "adapter_config.json").is_file():
        raise UserError(f"{run.name} has no adapter yet: it must finish first")
    return read_run_recipe(run)["model"]["source"], adapter


def chat_commands(run: Path, prompt: str, seed: int, max_new_tokens: int, temperature: float) -> dict[str, list]:
    """{log name: generate's arguments} for the base and the adapter on one prompt, through the chat template."""
    if not prompt.strip():
        raise UserError("write a prompt first")
    base, adapter = _finished(run)
    common = ["generate", "--model", base, "--chat", "--prompt", prompt, "--seed", str(seed)]
    common += ["--max-new-tokens", str(max_new_tokens), "--temperature", str(temperature)]
    return {"chat-base": common, "chat-adapter": [*common, "--adapter", str(adapter)]}


def ship_command(run: Path, action: str, repo_id: str = "") -> list[str]:
    """merge into run/merged, export to run/model.gguf, or push the adapter to a Hub repository."""
    base, adapter = _finished(run)
    if action == "merge":
        return ["merge", "--base", base, "--adapter", str(adapter), "--out", str(run / "merged"), "--force"]
    if action == "export":
        return ["export", "--base", base, "--adapter", str(adapter), "--out", str(run / "model.gguf"), "--force"]
    if action == "push":
        if not REPO_ID.match(repo_id):
            raise UserError(f"push needs a repository as USER/NAME (got {repo_id!r})")
        return ["push", str(adapter), "--repo-id", repo_id]
    raise UserError(f"unknown action {action!r} (merge, export, push)")
