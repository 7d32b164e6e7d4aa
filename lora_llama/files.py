"""Files on disk: safetensors shards and their index, atomic folders, JSON, a streaming writer.

Everything here is format-level (names, shapes, bytes); nothing knows about models or LoRA.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Iterator

from lora_llama.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
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
# safetensors dtype names <-> torch dtypes (the format's own spelling)
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def refuse_existing(path: Path, force: bool) -> None:
    """Outputs never replace an existing result unless the user passed --force."""
    if Path(path).exists() and not force:
        raise UserError(f"{path} already exists (pass --force to overwrite)")


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, force: bool = False):
    """Yield a temporary folder beside `out`; rename it to `out` only when the block succeeds.

    An existing `out` is refused unless `force`; with `force` it is replaced only
    after the new one is complete, so a crash never leaves a half-written folder.
    A failed write (disk full, file too large, no permission) is one UserError naming
    `out` and the cause; the temporary folder is removed and an existing `out` kept.
    """
    from safetensors import SafetensorError

    out = Path(out)
    refuse_existing(out, force)
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except (OSError, SafetensorError) as e:
        cause = f"{e.strerror} ({e.filename})" if getattr(e, "strerror", None) and e.filename else str(e)
        raise UserError(f"cannot write {out}: {cause}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(path: Path):
    """Yield a hidden temporary path beside `path`, renamed over it when the block succeeds and removed
    when it fails: a reader (or a kill) never sees half a file under the final name."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


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


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, in index order."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and "/" not in v for v in weight_map.values()
        ):
            raise UserError(f"{index} has no valid weight_map (file names of this folder's shards)")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise UserError(f"{folder}: shard {missing[0]} named in {INDEX_FILE} is missing")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} holds no *.safetensors weights")
    return files


def unreadable(f: Path, cause: Exception | None = None) -> UserError:
    """The one line for a weights file that cannot be read."""
    return UserError(f"cannot read {f}: truncated or not a safetensors file" + (f" ({cause})" if cause else ""))


@contextlib.contextmanager
def open_safetensors(f: Path):
    """safe_open(f) for torch, a file it cannot read (truncated, not safetensors) one UserError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        sf = safe_open(f, framework="pt")
    except (SafetensorError, OSError) as e:
        raise unreadable(f, e) from None
    with sf:
        yield sf


def iter_shards(folder: Path, owned: bool = False) -> Iterator[tuple[Path, dict]]:
    """Yield (file, {name: tensor}) one shard at a time, so only one shard is in memory.

    By default tensors are views of the memory-mapped file (lazy, shared with the page cache).
    owned=True reads them into memory of their own, so a tensor that is dropped (a weight
    replaced by its quantised copy) really frees its bytes instead of keeping the map alive.
    """
    from safetensors import SafetensorError, safe_open

    for f in shard_files(folder):
        try:
            try:
                sf = safe_open(f, framework="pt", backend="pread" if owned else "mmap")
            except TypeError:  # safetensors < 0.8 has no backend choice
                sf = safe_open(f, framework="pt")
            with sf:
                tensors = {k: sf.get_tensor(k) for k in sf.keys()}
        except (SafetensorError, OSError) as e:
            raise unreadable(f, e) from None
        yield f, tensors
        del tensors


def read_tensors(folder: Path, keys: list[str]) -> dict:
    """Read only the named tensors of a checkpoint (e.g. original weights to merge into)."""
    wanted, found = set(keys), {}
    for f in shard_files(folder):
        with open_safetensors(f) as sf:
            for k in wanted.intersection(sf.keys()):
                found[k] = sf.get_tensor(k)
    missing = wanted - set(found)
    if missing:
        raise UserError(f"{folder} lacks {sorted(missing)[0]!r}")
    return found


def tensor_shapes(files: list[Path]) -> dict[str, tuple]:
    """Every tensor's shape from the safetensors headers, without reading the data."""
    shapes = {}
    for f in files:
        with open_safetensors(f) as sf:
            for k in sf.keys():
                shapes[k] = tuple(sf.get_slice(k).get_shape())
    return shapes


class CheckpointRows:
    """Rows of a checkpoint's tensors read with pread from their byte range, without reading the rest: no
    memory map, so a process holds the rows it asked for and nothing of its neighbours' (fsdp's loading)."""

    def __init__(self, folder: Path):
        self.where = {}  # name -> (file, dtype, shape, first byte)
        for f in shard_files(folder):
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                try:
                    header = json.loads(fh.read(size))
                except ValueError:  # cut inside its header (a cut in the data is found by `rows`)
                    raise unreadable(f) from None
            for name, info in header.items():
                if name != "__metadata__":
                    self.where[name] = (
                        f,
                        SAFETENSORS_DTYPES[info["dtype"]],
                        info["shape"],
                        8 + size + info["data_offsets"][0],
                    )

    def shape(self, key: str) -> list[int]:
        if key not in self.where:
            raise UserError(f"checkpoint lacks tensor {key!r}")
        return self.where[key][2]

    def rows(self, key: str, lo: int, hi: int):
        import torch

        f, dtype, shape, start = self.where[key]
        dtype = getattr(torch, dtype)
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        with open(f, "rb") as fh:
            data = bytearray(os.pread(fh.fileno(), (hi - lo) * row_bytes, start + lo * row_bytes))
        if len(data) != (hi - lo) * row_bytes:
            raise UserError(f"{f}: truncated at tensor {key}")
        return (
            torch.frombuffer(data, dtype=dtype).view(hi - lo, *shape[1:])
            if data
            else torch.empty(0, *shape[1:], dtype=dtype)
        )


def write_safetensors_streaming(path: Path, entries: list[tuple], tensors, metadata: dict | None = None) -> int:
    """Write a safetensors file one tensor at a time; returns the bytes of tensor data.

    `entries` lists (name, torch dtype, shape) in file order, so the header is known up front;
    `tensors` yields them in that order. safetensors' own save_file needs every tensor of the
    file in memory at once (and copies them while serialising): this keeps one.
    """
    import torch

    names = {getattr(torch, v): k for k, v in SAFETENSORS_DTYPES.items()}
    header, offset = {}, 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for (name, dtype, shape), t in zip(entries, tensors, strict=True):
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: got {t.dtype} {tuple(t.shape)}, header says {dtype} {tuple(shape)}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)  # no copy
    return offset
