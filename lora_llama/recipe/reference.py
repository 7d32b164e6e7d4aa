"""The recipe reference, docs/recipes.md, rendered from the schema in recipe/schema.py.

`python -m lora_llama.recipe.reference docs/recipes.md` writes it; tests/test_docs.py fails when the file
differs from what the schema gives, so the reference never drifts from the code.
"""

from __future__ import annotations

import sys
import types
import typing

from pydantic import BaseModel

from lora_llama.recipe.schema import Recipe

INTRO = """# Recipe reference

A recipe is a YAML file of six sections; every key has a default, so a recipe names only what it
changes. `lora-llama train RECIPE.yaml key.path=value ...` overrides any key from the command line
(values are read as YAML: `train.max_steps=20`, `lora.targets=[q,v]`). A key that is not listed here
is refused in one line that names the closest valid key.

This page is generated from `lora_llama/recipe/schema.py` by `python -m lora_llama.recipe.reference docs/recipes.md`.
"""


def type_name(annotation) -> str:
    """A field's type as a reader writes it in YAML: `int`, `a | b`, `list of ...`, `null`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join("true" if a is True else "false" if a is False else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin in (list, tuple):
        inner = type_name(args[0]) if args else "any"
        return f"list of {inner}" if origin is list else f"pair of {inner}"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def default_text(value) -> str:
    if isinstance(value, BaseModel):
        return "see below"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value) if value != {} else "{}"


def section(path: str, model: type[BaseModel]) -> list[str]:
    """A heading, the section's docstring and its keys' table; nested sections follow as their own."""
    lines = [
        f"## `{path}`",
        "",
        (model.__doc__ or "").strip(),
        "",
        "| key | type | default | meaning |",
        "| --- | --- | --- | --- |",
    ]
    nested = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            nested.append((f"{path}.{name}", field.annotation))
        lines.append(
            f"| `{name}` | {type_name(field.annotation)} | `{default_text(field.default)}` | "
            f"{field.description or ''} |"
        )
    lines.append("")
    for sub_path, sub_model in nested:
        lines += section(sub_path, sub_model)
    return lines


def reference() -> str:
    lines = [INTRO]
    for name, field in Recipe.model_fields.items():
        lines += section(name, field.annotation)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    with open(sys.argv[1], "w") if len(sys.argv) > 1 else sys.stdout as out:
        out.write(reference())
