"""Streaming merge: fold ΔW = scale·B·A into the base checkpoint, shard by shard.

Only one shard (plus the small adapter) is in memory at a time, so the size of
the model does not matter. ΔW is always added to the ORIGINAL full-precision W0
read from the base checkpoint, never to quantised weights (a GGUF base is
dequantised first). The result is a standard HF folder that
`AutoModelForCausalLM` and `load_model` open.
"""
from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path

import torch

from .adapters import adapter_deltas
from .checkpoint import resolve_source
from .config import portable_hf_config, torch_dtype
from .errors import UserError
from .files import (INDEX_FILE, SAFETENSORS_DTYPES, atomic_dir, copy_tokenizer_files, read_config,
                    release_freed_memory, shard_files, tensor_shapes, write_json, write_safetensors_streaming)
from .lora import fold
from .registry import base_model_id


def check_adapter_fits(deltas: dict, shapes: dict, tied: bool) -> None:
    """Every adapted module exists in the base and every LoRA shape matches its weight."""
    for name, (A, B) in deltas.items():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" and name not in shapes and tied else name
        if source not in shapes:
            raise UserError(f"the adapter targets {name.removesuffix('.weight')}, which the base model does not have")
        out_f, in_f = shapes[source]
        if A.shape[1] != in_f or B.shape[0] != out_f or A.shape[0] != B.shape[1]:
            raise UserError(f"adapter for {name} has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}, "
                            f"which do not fit the base weight {(out_f, in_f)}")


def merge_checkpoint(base: str, adapter: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None,
                     force: bool = False, progress: bool = True) -> dict:
    """Write base + adapter as one HF checkpoint in `out`; returns {"out", "bytes", "seconds", "shards"}."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    start = time.perf_counter()
    out_dtype = torch_dtype(dtype) if dtype else None
    adapter = Path(adapter)
    if not adapter.is_dir():
        raise UserError(f"adapter folder not found: {adapter}")
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out} already exists (pass --force to overwrite)")
    deltas, scale, adapter_cfg = adapter_deltas(adapter)
    folder = resolve_source(base)
    config = read_config(folder)
    files = shard_files(folder)
    tied = bool(config.get("tie_word_embeddings", False))
    check_adapter_fits(deltas, tensor_shapes(files), tied)
    named = adapter_cfg.get("base_model_name_or_path")
    if named and str(named) not in (str(base), base_model_id(base)) and Path(str(named)).name != Path(str(base)).name:
        warnings.warn(f"the adapter was trained on {named!r}, merging into {base!r}", stacklevel=2)
    # a tied lm_head with its own adapter becomes a separate weight; the embedding stays as it was
    untie = tied and "lm_head.weight" in deltas

    def merged_tensor(name: str, w: torch.Tensor) -> torch.Tensor:
        """W0 + scale·B·A for an adapted weight, in the output dtype. `w` is a fresh copy read
        from the shard, so it is folded in place: no (out, in) temporaries besides it."""
        target_dtype = out_dtype or w.dtype
        if name in deltas:
            w = fold(w, *deltas[name], scale, inplace=True)
        return w.to(target_dtype).contiguous()

    def merge_shard(src_file: Path, dst_file: Path) -> tuple[list[str], int]:
        """One shard, one tensor at a time: read, fold, write, free. Returns (names written, bytes)."""
        with safe_open(src_file, framework="pt") as sf:
            # (output name, source name): a tied lm_head with an adapter is written from the embedding
            plan = [(k, k) for k in sf.keys() if not k.endswith("rotary_emb.inv_freq")]
            if untie and "model.embed_tokens.weight" in sf.keys():
                plan.append(("lm_head.weight", "model.embed_tokens.weight"))
            entries = []
            for out_key, src in plan:
                piece = sf.get_slice(src)
                dtype = out_dtype or getattr(torch, SAFETENSORS_DTYPES[piece.get_dtype()])
                entries.append((out_key, dtype, tuple(piece.get_shape())))
            folded = (merged_tensor(out_key, sf.get_tensor(src)) for out_key, src in plan)
            size = write_safetensors_streaming(dst_file, entries, folded, metadata={"format": "pt"})
        return [k for k, _, _ in entries], size  # returning drops the shard's mapping before the next one

    n = len(files)
    weight_map, total = {}, 0
    with atomic_dir(out, force=force) as tmp:
        for i, f in enumerate(tqdm(files, desc="merge", unit="shard", disable=not progress)):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            keys, size = merge_shard(f, tmp / name)
            release_freed_memory()
            weight_map.update({k: name for k in keys})
            total += size
        write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        if untie:
            config["tie_word_embeddings"] = False
        if out_dtype is not None:
            config["torch_dtype"] = config["dtype"] = str(out_dtype).removeprefix("torch.")
        config.pop("quantization_config", None)
        write_json(tmp / "config.json", portable_hf_config(config))
        if (folder / "generation_config.json").is_file():
            shutil.copy2(folder / "generation_config.json", tmp / "generation_config.json")
        copy_tokenizer_files(folder, tmp)
    return {"out": str(out), "bytes": total, "seconds": time.perf_counter() - start, "shards": n}
