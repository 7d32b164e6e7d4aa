"""Tokenized examples kept between runs, so that a second run of a recipe, or a resume, does not tokenize its data
again: stored under the cache folder (`LORA_LLAMA_CACHE`, default ~/.cache/lora_llama) in `tokenized/KEY`, as
`datasets`' Arrow files. KEY hashes everything the examples depend on: the data section, the objective and its
settings, train.seed (the split and packing order), the tokenizer (its vocabulary, special tokens and chat
template), and for local files their sizes and modification times; a change to any of them tokenizes afresh.
`datasets` keeps the raw data sets in its own cache as usual."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from lora_llama.data.loading import glob_files, is_glob
from lora_llama.files.atomic import atomic_dir
from lora_llama.registry import cache_dir

FORMAT = 2  # how examples are made (packing included) and laid out: raised when that changes, so old entries go unread


def tokenizer_stamp(tokenizer) -> str:
    """A digest of what tokenizing depends on in the tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [
        backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items())),
        tokenizer.chat_template or "",
        repr(tokenizer.special_tokens_map),
        repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def source_stamp(source: str) -> list:
    """Local files' (name, size, modification time), a glob's too; nothing for a Hub id or a registered name."""
    path = Path(source).expanduser()
    if is_glob(source):
        files = [Path(f) for f in glob_files(source)]
    else:
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()]


def examples_key(parts: dict, tokenizer, source: str) -> str:
    """The cache key of the examples `parts` (data section, objective, settings, seed) make from `source`."""
    described = json.dumps(
        {"format": FORMAT, **parts, "tokenizer": tokenizer_stamp(tokenizer), "files": source_stamp(source)},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(described.encode()).hexdigest()[:32]


def cached_examples(key: str, make, log) -> tuple[list[dict], list[dict]]:
    """(train, val) from the cache when `key` is there, else from make() and kept (when the examples fit Arrow's
    columns: rows whose columns change type are tokenized each run); one line says which."""
    import datasets

    folder = cache_dir() / "tokenized" / key
    if (folder / "train").is_dir():
        try:
            train, val = (_read(folder / split) for split in ("train", "val"))
            log(f"data: {len(train)} + {len(val)} tokenized examples read from the cache ({folder})")
            return train, val
        except Exception as e:  # an entry that cannot be read (a disk error, another datasets) is made again
            log(f"data: the cache's entry could not be read ({type(e).__name__}); tokenizing again")
    train, val = make()
    try:
        with atomic_dir(folder, force=True) as tmp:
            for split, rows in (("train", train), ("val", val)):
                if rows:  # an empty split is no folder
                    datasets.Dataset.from_list(rows).save_to_disk(str(Path(tmp) / split))
        log(f"data: tokenized {len(train)} + {len(val)} examples, kept for the next run in {folder}")
    except Exception as e:  # Arrow refuses columns whose type changes from row to row; the run goes on
        log(f"data: tokenized {len(train)} + {len(val)} examples (not cached: {type(e).__name__})")
    return train, val


def _read(folder: Path) -> list[dict]:
    import datasets

    return datasets.load_from_disk(str(folder)).to_list() if folder.is_dir() else []
