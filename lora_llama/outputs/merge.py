"""Streaming merge: fold ΔW = scale·B·A into the base checkpoint, shard by shard.

Only one shard (plus the small adapter) is in memory at a time, so the size of
the model does not matter. ΔW is added to the original full-precision W0 read
from the base checkpoint (a GGUF base is dequantised first), or, with
onto="dequantized", to dequant(quant(W0)): what an adapter trained on an int8 /
nf4 base saw. The result is a standard HF folder that `AutoModelForCausalLM`
and `load_model` open.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path

import torch

from lora_llama.errors import UserError
from lora_llama.files.atomic import atomic_dir, refuse_existing
from lora_llama.files.json_files import read_config, read_json, write_json
from lora_llama.files.shards import (
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    open_safetensors,
    shard_files,
    tensor_shapes,
    write_safetensors_streaming,
)
from lora_llama.files.tokenizer_files import copy_tokenizer_files
from lora_llama.loading.adapters import CHAT_TEMPLATE, adapter_deltas, embedding_changes, read_adapter_tensors
from lora_llama.loading.models import resolve_source
from lora_llama.lora.experts import EXPERT_WEIGHTS, expert_factors
from lora_llama.lora.layer import fold
from lora_llama.model.config import portable_hf_config, torch_dtype
from lora_llama.model.moe import stacked_name
from lora_llama.quant.handlers import QuantFormat, quant_format
from lora_llama.quant.linear import DECODER_LINEARS
from lora_llama.quant.names import SETTINGS
from lora_llama.registry import base_model_id
from lora_llama.runtime.allocator import release_freed_memory


def stored_as(name: str, shapes: dict, tied: bool) -> str:
    """The checkpoint tensor that holds weight `name`: a tied lm_head without its own tensor is the embedding."""
    return "model.embed_tokens.weight" if name == "lm_head.weight" and name not in shapes and tied else name


def check_adapter_fits(deltas: dict, shapes: dict, tied: bool) -> None:
    """Every adapted module exists in the base and every LoRA shape matches its weight."""
    for name, (A, B, _) in deltas.items():
        source = stored_as(name, shapes, tied)
        if source not in shapes:
            raise UserError(f"the adapter targets {name.removesuffix('.weight')}, which the base model does not have")
        out_f, in_f = shapes[source]
        if A.shape[1] != in_f or B.shape[0] != out_f or A.shape[0] != B.shape[1]:
            raise UserError(
                f"adapter for {name} has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}, "
                f"which do not fit the base weight {(out_f, in_f)}"
            )


def expert_deltas(deltas: dict, shapes: dict) -> dict:
    """The deltas with each mixture's stacked experts' adapter (peft's target_parameters: A (r·E, in), B (out, r·E))
    cut into one (A_e, B_e) per expert linear the checkpoint holds (`experts.e.gate_proj.weight`, Mixtral's `w1`);
    gate and up take their rows of gate_up's B."""
    stacks = {k: v for k, v in deltas.items() if k.endswith(tuple(f"experts.{w}.weight" for w in EXPERT_WEIGHTS))}
    if not stacks:
        return deltas
    per_expert = {k: v for k, v in deltas.items() if k not in stacks}
    found = {k: stacked_name(k) for k in shapes}
    experts = {}  # stack -> number of experts the checkpoint holds
    for name, e, _ in filter(None, found.values()):
        experts[name] = max(experts.get(name, 0), e + 1)
    for key, (name, e, part) in ((k, f) for k, f in found.items() if f and f[0] + ".weight" in stacks):
        A, B, _ = stacks[name + ".weight"]
        a, b = expert_factors(A, B, experts[name], e)
        half = B.shape[0] // 2
        b = {"gate": b[:half], "up": b[half:], "down": b}[part]
        per_expert[key] = (a.contiguous(), b.contiguous(), None)
    unplaced = [k for k in stacks if k.removesuffix(".weight") not in experts]
    if unplaced:
        raise UserError(
            f"the adapter targets {unplaced[0].removesuffix('.weight')}, which the base model does not have"
        )
    return per_expert


def check_rows_fit(rows: dict, shapes: dict, tied: bool) -> None:
    """Every trained embedding or lm_head (whole or by rows) fits the base's matrix."""
    for name, (indices, values) in rows.items():
        vocab, dim = shapes[stored_as(name, shapes, tied)]
        if (
            values.shape[1] != dim
            or (indices is None and values.shape[0] != vocab)
            or (indices is not None and int(indices.max()) >= vocab)
        ):
            raise UserError(
                f"the adapter's {name.removesuffix('.weight')} ({tuple(values.shape)}) does not fit the base's "
                f"{(vocab, dim)}"
            )


ONTO = ("original", "dequantized")


class Merger:
    """Base + adapter, one tensor at a time, for `merge` and `export`: W0 + scale·B·A for every adapted weight.

    onto="original" folds ΔW into the full-precision W0 of the checkpoint; onto="dequantized" into
    dequant(quant(W0)) of every decoder linear, the weights an adapter trained on a base quantized in the format
    `quantize` (a handler or its name) saw.
    Without an adapter, the base's own tensors come out unchanged."""

    def __init__(
        self,
        base: str,
        adapter: str | os.PathLike | None = None,
        onto: str = "original",
        quantize: str | QuantFormat | None = None,
    ):
        if onto not in ONTO:
            raise UserError(f"unknown --onto {onto!r} (use {' or '.join(ONTO)})")
        quantize = quant_format(quantize)
        if onto == "dequantized" and quantize is None:
            raise UserError(
                "--onto dequantized needs the quantisation the adapter was trained on: "
                f"--quantize {' or '.join(SETTINGS)} (or a run folder's recipe.yaml next to the adapter)"
            )
        self.deltas, self.scale, self.rows = {}, 0.0, {}
        if adapter is not None:
            adapter = Path(adapter)
            if not adapter.is_dir():
                raise UserError(f"adapter folder not found: {adapter}")
            tensors = read_adapter_tensors(adapter)  # once: a trained embedding makes them gigabytes
            self.deltas, self.scale, adapter_cfg = adapter_deltas(adapter, tensors)
            self.rows = embedding_changes(adapter, tensors)
        self.folder = resolve_source(base)
        self.config = read_config(self.folder)
        self.files = shard_files(self.folder)
        tied = bool(self.config.get("tie_word_embeddings", False))
        shapes = tensor_shapes(self.files)
        self.deltas = expert_deltas(self.deltas, shapes)
        check_adapter_fits(self.deltas, shapes, tied)
        check_rows_fit(self.rows, shapes, tied)
        named = adapter_cfg.get("base_model_name_or_path") if adapter is not None else None
        if (
            named
            and str(named) not in (str(base), base_model_id(base))
            and Path(str(named)).name != Path(str(base)).name
        ):
            warnings.warn(f"the adapter was trained on {named!r}, merging into {base!r}", stacklevel=2)
        # a tied lm_head with its own adapter or trained copy becomes a separate weight, and so does an embedding
        # trained whole (peft's copy of one leaves the other as it was); trained rows of a tied pair stay tied
        self.untie = tied and (
            "lm_head.weight" in self.deltas or any(indices is None for indices, _ in self.rows.values())
        )
        if self.untie:
            self.config["tie_word_embeddings"] = False
        self.config.pop("quantization_config", None)
        self.onto, self.quantize = onto, quantize

    def plan(self, sf) -> list[tuple[str, str]]:
        """(output name, source name) of an open shard: a tied lm_head with an adapter comes from the embedding."""
        plan = [(k, k) for k in sf.keys() if not k.endswith("rotary_emb.inv_freq")]
        if self.untie and "model.embed_tokens.weight" in sf.keys():
            plan.append(("lm_head.weight", "model.embed_tokens.weight"))
        return plan

    def entries(self, sf, out_dtype=None) -> list[tuple[str, torch.dtype, tuple]]:
        """(name, dtype, shape) of what `tensors` yields for this shard, from its header alone."""
        entries = []
        for out_key, src in self.plan(sf):
            piece = sf.get_slice(src)
            entries.append(
                (out_key, out_dtype or getattr(torch, SAFETENSORS_DTYPES[piece.get_dtype()]), tuple(piece.get_shape()))
            )
        return entries

    def tensors(self, sf, out_dtype=None):
        """The shard's merged tensors in `plan` order. Each is a fresh copy read from the shard, folded in place:
        no (out, in) temporaries besides it."""
        for out_key, src in self.plan(sf):
            w = sf.get_tensor(src)
            target_dtype = out_dtype or w.dtype
            quantized = out_key.rsplit(".", 2)[-2] in DECODER_LINEARS or stacked_name(out_key) is not None
            if self.onto == "dequantized" and quantized and w.dim() == 2:
                w = self.quantize.roundtrip(w)
            if out_key in self.deltas:
                A, B, magnitude = self.deltas[out_key]
                w = fold(w, A, B, self.scale, inplace=True, magnitude=magnitude)
            if out_key in self.rows:
                indices, values = self.rows[out_key]
                w = values.to(w.dtype) if indices is None else w.index_copy(0, indices, values.to(w.dtype))
            yield out_key, w.to(target_dtype).contiguous()


def merge_checkpoint(
    base: str,
    adapter: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str | None = None,
    force: bool = False,
    progress: bool = True,
    onto: str = "original",
    quantize: str | QuantFormat | None = None,
) -> dict:
    """Write base + adapter as one HF checkpoint in `out`; returns {"out", "bytes", "seconds", "shards"}."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    out_dtype = torch_dtype(dtype) if dtype else None
    out = Path(out)
    refuse_existing(out, force)
    merger = Merger(base, adapter, onto, quantize)
    files, config = merger.files, merger.config

    def merge_shard(src_file: Path, dst_file: Path) -> tuple[list[str], int]:
        """One shard, one tensor at a time: read, fold, write, free. Returns (names written, bytes)."""
        with open_safetensors(src_file) as sf:
            entries = merger.entries(sf, out_dtype)
            folded = (t for _, t in merger.tensors(sf, out_dtype))
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
        if out_dtype is not None:
            config["torch_dtype"] = config["dtype"] = str(out_dtype).removeprefix("torch.")
        write_json(tmp / "config.json", portable_hf_config(config))
        if (merger.folder / "generation_config.json").is_file():
            shutil.copy2(merger.folder / "generation_config.json", tmp / "generation_config.json")
        copy_tokenizer_files(merger.folder, tmp)
        kept = Path(adapter) / CHAT_TEMPLATE if adapter is not None else None
        if kept is not None and kept.is_file():  # the template the adapter was trained with (data.chat_template)
            shutil.copy2(kept, tmp / CHAT_TEMPLATE)
            cfg = read_json(tmp / "tokenizer_config.json") if (tmp / "tokenizer_config.json").is_file() else None
            if cfg is not None and "chat_template" in cfg:  # the copy inside the config (for transformers 4.x) too
                write_json(tmp / "tokenizer_config.json", {**cfg, "chat_template": kept.read_text()})
    return {"out": str(out), "bytes": total, "seconds": time.perf_counter() - start, "shards": n}
