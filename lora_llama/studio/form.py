"""The New run form, made from the recipe schema: one field per recipe key (its path, type, choices, default and
description), so a key added to the schema appears without page code; and what the form's values make: the
overrides on a base recipe, the `lora-llama train` command, the resolved recipe as YAML, or the CLI's one-line
error."""

from __future__ import annotations

import shlex
import types
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel

from lora_llama.errors import UserError
from lora_llama.recipe.schema import Recipe, load_recipe
from lora_llama.training.run_folder import RECIPE

DEFAULT_RECIPE = "smollm2-chat-cpu.yaml"  # the one `make demo` trains


def _section(annotation) -> type[BaseModel] | None:
    """The settings class a field holds, when it is a section (possibly optional) rather than a value."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _choices(annotation) -> list | None:
    """A Literal's values (with None for an optional one); None for any other type (a list of Literals is text)."""
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        literal = [a for a in typing.get_args(annotation) if typing.get_origin(a) is typing.Literal]
        if literal:
            return list(typing.get_args(literal[0])) + ([None] if type(None) in typing.get_args(annotation) else [])
    return None


def fields(model: type[BaseModel] = Recipe, prefix: str = "") -> list[dict]:
    """Every recipe key as a form field: path, kind (bool, choice, text), choices, default (YAML), description."""
    out = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        section = _section(info.annotation)
        if section is not None and typing.get_origin(info.annotation) is not list:
            out += fields(section, f"{path}.")
            continue
        choices = _choices(info.annotation)
        kind = "bool" if info.annotation is bool else "choice" if choices else "text"
        out.append(
            {
                "path": path,
                "kind": kind,
                "choices": [yaml_value(c) for c in choices] if choices else None,
                "default": yaml_value(info.get_default(call_default_factory=True)),
                "description": info.description or "",
            }
        )
    return out


def yaml_value(value) -> str:
    """A value as the form shows it and an override writes it: one line of YAML."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def flat_values(recipe: Recipe) -> dict[str, str]:
    """A resolved recipe's value for each form field."""
    data = recipe.model_dump(mode="json")
    values = {}
    for f in fields():
        node = data
        for key in f["path"].split("."):
            node = node.get(key) if isinstance(node, dict) else None
        values[f["path"]] = yaml_value(node)
    return values


def plan(base: str, values: dict[str, str], runs: Path, name: str) -> dict:
    """What the form's values make on the base recipe: the overrides (the keys whose value differs from the base's,
    and output.dir in the runs folder), the command, the resolved recipe as YAML; or the CLI's one-line error."""
    if not name or "/" in name or name.startswith("."):
        return {"error": "give the run a name (a folder name under the runs folder)"}
    try:
        before = flat_values(load_recipe(base))
        overrides = [f"{k}={v}" for k, v in values.items() if k in before and v != before[k] and k != "output.dir"]
        overrides.append(f"output.dir={runs / name}")
        recipe = load_recipe(base, overrides)
    except UserError as e:
        return {"error": str(e)}
    command = shlex.join(["lora-llama", "train", base, *overrides])
    return {"overrides": overrides, "command": command, "yaml": yaml.safe_dump(recipe.model_dump(mode="json"))}


def base_recipes(runs: Path) -> dict[str, str]:
    """{label: path} of the recipes a run may start from: the shipped ones (recipes/ here or in the checkout the
    package runs from), the default recipe first (the form opens on it: it trains on any CPU), then each run's
    resolved recipe."""
    shipped = {}
    for folder in (Path.cwd() / "recipes", Path(__file__).resolve().parents[2] / "recipes"):
        for f in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            shipped.setdefault(f"recipes/{f.name}", str(f))
    shipped = dict(sorted(shipped.items(), key=lambda item: item[0] != f"recipes/{DEFAULT_RECIPE}"))
    own = {f"run {p.parent.name}": str(p) for p in sorted(runs.glob(f"*/{RECIPE}"))}
    return {**shipped, **own}
