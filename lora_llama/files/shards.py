"""safetensors shards and their index: listed, opened with one clear line when unreadable, read by key or shape,
and written streaming (a tensor at a time)."""

from __future__ import annotations

import contextlib
import json
import math
import struct
from pathlib import Path
from typing import Iterator

from lora_llama.errors import UserError
from lora_llama.files.json_files import read_json

INDEX_FILE = "model.safetensors.index.json"


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


# oneDNN's products run at about half their rate on a weight that does not start on a 64-byte boundary (measured on
# an AVX2 EPYC: a vocabulary projection's input gradient at 42 GFLOP/s against 95-120); safetensors aligns tensor
# data to 8 bytes only, so a tensor memory-mapped from a file rarely starts on one
ALIGNMENT = 64


def aligned(t):
    """`t` where it starts on a 64-byte boundary or lives off the CPU; otherwise a copy that does (torch's CPU
    allocator aligns every block to 64 bytes)."""
    if t.device.type != "cpu" or t.numel() == 0 or t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone()


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
