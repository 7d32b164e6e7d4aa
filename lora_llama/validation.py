"""The base of every settings class a user writes (recipe sections, LoRA settings): unknown keys are refused, and
a validation error is said in one line that names the key path."""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict, ValidationError


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def describe(err: ValidationError, model: type[BaseModel]) -> str:
    """One line naming the key path; for an unknown key, the closest valid name."""
    e = err.errors()[0]
    path = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        cls = model
        for p in e["loc"][:-1]:
            cls = cls.model_fields[p].annotation
        near = difflib.get_close_matches(str(e["loc"][-1]), list(cls.model_fields), n=1)
        hint = f" (did you mean {'.'.join([*map(str, e['loc'][:-1]), near[0]])!r}?)" if near else ""
        return f"unknown recipe key {path!r}{hint}"
    if e["type"] == "value_error":  # a rule across keys: its message names them
        return "recipe: " + e["msg"].removeprefix("Value error, ")
    return f"recipe key {path!r}: {e['msg']} (got {e.get('input')!r})"
