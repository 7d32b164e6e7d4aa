"""A GGUF file's decoder linears read as the blocks they are stored in, and llama.cpp's q / k row order.

llama.cpp's llama architecture rotates interleaved pairs where HF checkpoints rotate halves, so its converter
permutes the rows of q and k (`permute_rows`); reading puts them back in HF's order, writing (outputs/export.py)
permutes them again.
"""

from __future__ import annotations

from pathlib import Path

from lora_llama.model.config import BLOCK_LINEARS, LINEARS, ModelArgs
from lora_llama.quant.gguf_blocks import GGUF_FORMATS


def permute_rows(w, n_heads: int, inverse: bool = False):
    """q or k rows from HF's rotate-half order to the interleaved pairs llama.cpp's llama architecture rotates
    (`LlamaModel.permute` in convert_hf_to_gguf.py), or back with inverse; a bias is a tensor of one column, and
    rows of quantized blocks move whole."""
    halves = (2, w.shape[0] // n_heads // 2)
    return w.reshape(n_heads, *(halves[::-1] if inverse else halves), *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def linear_blocks(gguf: Path, args: ModelArgs, copy: bool = True) -> dict:
    """{module path: (kind, rows of blocks)} for the decoder linears a GGUF base stores in a block format that
    gguf_blocks.py knows, read from the file as they are (other types come from its dequantized copy), found by
    gguf's own HF -> GGUF name map.
    llama.cpp stores llama's q and k rows in its interleaved RoPE order: they are put back in HF's order.
    copy=False: (kind, the file's memory-mapped rows, heads to reorder or None), for `block_rows` to read later."""
    import gguf as gg

    reader = gg.GGUFReader(gguf)
    field = reader.fields["general.architecture"]
    arch = next(a for a, name in gg.MODEL_ARCH_NAMES.items() if name == bytes(field.parts[field.data[0]]).decode())
    names, tensors = gg.get_tensor_name_map(arch, args.n_layers), {t.name: t for t in reader.tensors}
    found = {}
    for i in range(args.n_layers):
        for target in BLOCK_LINEARS:
            path = f"model.layers.{i}.{LINEARS[target]}"
            t = tensors.get(names.get_name(f"{path}.weight", try_suffixes=(".weight",)) or "")
            if t is None or t.tensor_type.name.lower() not in GGUF_FORMATS:
                continue
            heads = (
                (args.n_heads if target == "q" else args.n_kv_heads)
                if arch == gg.MODEL_ARCH.LLAMA and target in ("q", "k")
                else None
            )
            entry = (t.tensor_type.name.lower(), t.data, heads)  # (out, blocks x bytes) of the mapped file
            found[path] = (entry[0], block_rows(entry)) if copy else entry
    return found


def block_rows(entry, lo: int = 0, hi: int | None = None):
    """A copy of rows lo..hi of a GGUF tensor's rows of blocks (the quantized bytes only), in HF's row order."""
    import numpy as np
    import torch

    _, data, heads = entry
    if not heads:
        return torch.from_numpy(np.array(data[lo:hi]))
    rows = permute_rows(torch.from_numpy(np.array(data)), heads, inverse=True)  # rows move within each head
    return rows if (lo, hi) == (0, None) else rows[lo:hi].clone()
