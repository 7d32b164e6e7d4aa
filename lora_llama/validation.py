"""The base of every settings class a user writes (recipe sections, LoRA settings): unknown keys are refused, and
a validation error is said in one line that names the key path."""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict, ValidationError

# the names peft's LoraConfig and transformers' TrainingArguments give keys users bring (docs/coming-from.md)
PEERS_NAMES = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "per_device_train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "lr_scheduler_type": "schedule",
    "rank": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "target_modules": "targets",
}


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
        name = str(e["loc"][-1])
        peers = [PEERS_NAMES[name]] if PEERS_NAMES.get(name) in cls.model_fields else []
        near = peers or difflib.get_close_matches(name, list(cls.model_fields), n=1)
        hint = f" (did you mean {'.'.join([*map(str, e['loc'][:-1]), near[0]])!r}?)" if near else ""
        return f"unknown recipe key {path!r}{hint}"
    if e["type"] == "value_error":  # a rule across keys: its message names them
        return "recipe: " + e["msg"].removeprefix("Value error, ")
    return f"recipe key {path!r}: {e['msg']} (got {e.get('input')!r})"
