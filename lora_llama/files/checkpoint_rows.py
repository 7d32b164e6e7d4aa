"""`CheckpointRows`: rows of a checkpoint's tensors read without loading whole tensors (fsdp's loading by rows)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lora_llama.errors import UserError
from lora_llama.files.shards import SAFETENSORS_DTYPES, shard_files, unreadable


class CheckpointRows:
    """Rows of a checkpoint's tensors read from their byte range, without reading the rest: no
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
        """Rows lo..hi-1 of tensor `key`, read straight into a new tensor (torch's CPU allocator aligns it to 64
        bytes, as oneDNN's products want: files/shards.py's `aligned` leaves it as it is)."""
        import torch

        f, dtype, shape, start = self.where[key]
        dtype = getattr(torch, dtype)
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        out = torch.empty(hi - lo, *shape[1:], dtype=dtype)
        if out.numel():
            with open(f, "rb") as fh:
                fh.seek(start + lo * row_bytes)
                read = fh.readinto(out.view(-1).view(torch.uint8).numpy())
            if read != (hi - lo) * row_bytes:
                raise UserError(f"{f}: truncated at tensor {key}")
        return out
