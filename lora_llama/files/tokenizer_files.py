"""A model folder's tokenizer files: which they are, copied, and their config made readable by transformers 4 and 5."""

from __future__ import annotations

import shutil
from pathlib import Path

from lora_llama.files.json_files import read_json, write_json

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


# tokenizer_config.json keys that transformers 5 writes for itself: load-time flags, its own backend name
_TOKENIZER_LOAD_TIME_KEYS = ("is_local", "local_files_only", "backend", "name_or_path", "_commit_hash")


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy a model folder's tokenizer files, then make their config portable (see below)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    make_tokenizer_config_portable(dst)


def make_tokenizer_config_portable(folder: Path) -> None:
    """Rewrite tokenizer_config.json so transformers 4.4x reads it as well as 5.x: no load-time flags,
    a fast-tokenizer class name that 4.x knows (5.x's `...Backend` names are new), and the chat
    template inside it too (4.x before chat_template.jinja reads it only there)."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return
    cfg = {k: v for k, v in read_json(path).items() if k not in _TOKENIZER_LOAD_TIME_KEYS}
    if str(cfg.get("tokenizer_class", "")).endswith("Backend") and (folder / "tokenizer.json").is_file():
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if "chat_template" not in cfg and (folder / "chat_template.jinja").is_file():
        cfg["chat_template"] = (folder / "chat_template.jinja").read_text()
    write_json(path, cfg)
