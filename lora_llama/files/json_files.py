"""JSON files: read with one clear line when unreadable, written atomically; a model folder's config.json."""

from __future__ import annotations

import json
from pathlib import Path

from lora_llama.errors import UserError


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> dict:
    """A JSON object from a file that must exist and parse; a broken one is a user error naming the file."""
    try:
        obj = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} does not hold a JSON object (got {type(obj).__name__})")
    return obj


def read_config(folder: Path) -> dict:
    return read_json(Path(folder) / "config.json")
