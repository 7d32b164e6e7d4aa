"""Model sources -> the native model: HF safetensors folders (sharded or not), GGUF files,
Hub ids and registered names; `load_model` and `load_tokenizer`.

Every source is resolved to a local HF folder first. A GGUF file is dequantised
once into a cached HF folder, so loading, merging and tokenizers share one path.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import NamedTuple

from lora_llama.errors import UserError
from lora_llama.files.atomic import atomic_dir, write_text_atomic
from lora_llama.files.json_files import read_config, write_json
from lora_llama.files.shards import aligned, iter_shards
from lora_llama.files.tokenizer_files import make_tokenizer_config_portable
from lora_llama.loading.gguf_mixtures import (
    check_readable,
    complete_config,
    fit_shapes,
    gguf_fields,
    mixture_architecture,
)
from lora_llama.model.config import ModelArgs, family_of, portable_hf_config
from lora_llama.model.llama import Llama
from lora_llama.model.moe import ExpertStacks, native_name, stacked_name
from lora_llama.quant.experts import quantize_loaded_experts
from lora_llama.quant.gguf_blocks import row_bytes
from lora_llama.quant.gguf_tensors import linear_blocks
from lora_llama.quant.handlers import QuantFormat, quant_format
from lora_llama.quant.linear import QuantizedLinear, quantize_loaded_linears
from lora_llama.registry import REGISTERED_MODELS, cache_dir, is_hub_id, registered_model_path
from lora_llama.runtime.allocator import release_freed_memory
from lora_llama.runtime.auto import resolve_device

CACHE_FORMAT = 2  # of the folders gguf_to_folder writes (2: portable config.json and tokenizer_config.json)


class ModelSource(NamedTuple):
    """A model source resolved once (`model_source`): the name the user gave, its local HF folder, and the GGUF file
    behind it (None for other sources). Every loader takes one in place of the name and resolves nothing again."""

    name: str
    folder: Path
    gguf: Path | None

    def __str__(self) -> str:
        return self.name


def model_source(source: str | os.PathLike | ModelSource) -> ModelSource:
    if isinstance(source, ModelSource):
        return source
    return ModelSource(str(source), resolve_source(source), gguf_file(source))


def resolve_source(source: str | os.PathLike | ModelSource) -> Path:
    """Return a local HF folder (config.json + safetensors + tokenizer) for any accepted source."""
    if isinstance(source, ModelSource):
        return source.folder
    source = str(source)
    if (gguf := gguf_file(source)) is not None:
        return gguf_to_folder(gguf)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.exists():
        raise UserError(f"{path} is neither a model folder nor a .gguf file")
    if is_hub_id(source):
        return download_from_hub(source)
    known = ", ".join(REGISTERED_MODELS)
    raise UserError(f"model not found: {source!r} is no local path, Hub id or registered name ({known})")


def gguf_file(source: str | os.PathLike) -> Path | None:
    """The GGUF file behind a source (a registered name or a .gguf path), or None for other sources."""
    if isinstance(source, ModelSource):
        return source.gguf
    if str(source) in REGISTERED_MODELS:
        return registered_model_path(str(source))
    path = Path(source).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(
            snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        )
    except RepositoryNotFoundError:
        raise UserError(f"Hub model {repo_id!r} not found (or it is gated and no token was given)") from None
    except LocalEntryNotFoundError:
        raise UserError(
            f"cannot download {repo_id!r}: the Hub is unreachable and it is not in the local cache"
        ) from None
    except HfHubHTTPError as e:
        raise UserError(f"cannot download {repo_id!r}: {str(e).splitlines()[0]}") from None


def gguf_cache_key(gguf: Path) -> tuple[str, Path]:
    """The cache key of a GGUF file's contents, and the small file that remembers it for this path.

    Keyed by content, not by path: every new virtual environment installs the same file at a new path,
    and a path key would add a full float32 copy per environment (514 MB for SmolLM2). The content hash
    is remembered per (path, size, mtime), so a hit does not re-read a multi-GB file; a file changed in
    place gets a new mtime and is hashed again.
    """
    stat = gguf.stat()
    place = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    seen = cache_dir() / "gguf" / ".seen" / hashlib.sha1(place.encode()).hexdigest()[:16]
    if seen.is_file():
        return seen.read_text().strip(), seen
    digest = hashlib.sha1()
    with open(gguf, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    # CACHE_FORMAT in the key: a change to what is written here makes a fresh folder, not a stale hit
    return hashlib.sha1(f"{CACHE_FORMAT}:{digest.hexdigest()}".encode()).hexdigest()[:12], seen


def remember(seen: Path, key: str) -> None:
    """Note the key for next time; only a shortcut, so a read-only cache just goes without it."""
    try:
        seen.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(seen, key)  # a reader sees the whole key or none
    except OSError:
        pass


def gguf_to_folder(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a cached HF folder (float32 safetensors + tokenizer)."""
    key, seen = gguf_cache_key(gguf)
    folder = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        if not seen.is_file():
            remember(seen, key)
        return folder
    fields = gguf_fields(gguf)  # read once, before the first conversion (seconds for a large file)
    mixture = mixture_architecture(fields)
    if mixture is not None:
        check_readable(gguf, mixture)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # gguf raises many types for a bad file
        raise UserError(f"cannot read GGUF file {gguf}: {e}") from None
    if mixture is not None:
        complete_config(config, fields, mixture)
    family_of(config.to_dict())  # an unsupported family or option is refused before anything is written
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)  # only used to map GGUF tensor names to HF names
    try:
        tensors = fit_shapes(
            load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=hf_model)["tensors"], hf_model
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # a truncated or damaged file fails in many ways inside gguf / transformers
        raise UserError(
            f"cannot read GGUF file {gguf}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    with atomic_dir(folder, force=True) as tmp:
        cfg = config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["torch_dtype"] = cfg["dtype"] = "float32"
        write_json(tmp / "config.json", portable_hf_config(cfg))
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        make_tokenizer_config_portable(tmp)
        try:
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        except Exception:  # generation_config is optional metadata
            pass
    remember(seen, key)
    return folder


def load_tokenizer(source: str | os.PathLike):
    from transformers import AutoTokenizer

    folder = resolve_source(source)
    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token is None:  # pad positions are never targets, so any id will do
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: str | os.PathLike, dtype=None, quantize: str | QuantFormat | None = None, device="cpu"):
    """Build the native `Llama` from any accepted source (device "auto": CUDA when present).

    The model is built on the `meta` device and each shard's tensors are assigned
    as they are read (and quantised right away when `quantize` is set: a format's
    handler, or its name), so two full copies of the weights never exist at once.
    """
    import torch

    dtype = dtype or torch.float32
    device = resolve_device(device)
    folder = resolve_source(source)
    model = meta_model(folder)
    args = model.args
    fmt = quant_format(quantize)
    from_float = fmt is not None and fmt.from_float
    blocks = gguf_linear_blocks(source, args) if fmt is not None and fmt.keeps_file_blocks else {}
    reader = _ShardReader(model, dtype, device, from_float, {f"{path}.weight" for path in blocks})
    for file, shard in iter_shards(folder, owned=from_float):
        model.load_state_dict(reader.tensors(file, shard), strict=False, assign=True)
        del shard
        if from_float:
            quantize_loaded_linears(model, fmt)
            quantize_loaded_experts(model, fmt)
            release_freed_memory()  # the shard's full-precision weights are gone now
    install_blocks(model, blocks, device)
    if args.tie_word_embeddings:
        model.tie_weights()
        reader.seen.add("lm_head.weight")
    missing = sorted(set(reader.expected) - reader.seen)
    if missing:
        raise UserError(f"{folder}: checkpoint lacks {len(missing)} tensors, first {missing[0]!r}")
    for p in model.parameters():
        p.requires_grad_(p.is_floating_point())
    model.source, model.folder = str(source), folder
    return model.eval()


class _ShardReader:
    """A checkpoint's tensors under the model's names, checked against its shapes, in the dtype they are held in;
    each expert's linears stacked as the model holds them."""

    def __init__(self, model, dtype, device, from_float: bool, seen: set[str]):
        self.args, self.dtype, self.device, self.from_float = model.args, dtype, device, from_float
        self.expected = {k: v.shape for k, v in model.state_dict().items()}
        self.seen = seen  # a GGUF's own blocks replace its dequantized copy
        # experts to be quantized are quantized from the checkpoint's own precision, as the linears are
        self.stacks = ExpertStacks(self.expected, None if from_float else dtype, device)

    def tensors(self, file: Path, shard: dict) -> dict:
        out = {}
        for key in list(shard):
            t = shard.pop(key)
            if key.endswith("rotary_emb.inv_freq") or key in self.seen:  # old checkpoints store the RoPE buffer
                continue
            if self.args.moe is not None and stacked_name(key) is not None:
                try:
                    done = self.stacks.add(key, t)
                except ValueError as e:
                    raise UserError(f"{file.name}: {e}") from None
                if done:
                    out[done[0]] = done[1]
                    self.seen.add(done[0])
                continue
            name = native_name(key)
            if name not in self.expected:
                raise UserError(f"{file.name}: unexpected tensor {key!r} for a {self.args.model_type} model")
            if t.shape != self.expected[name]:
                raise UserError(
                    f"{file.name}: {key} has shape {tuple(t.shape)}, config.json implies {tuple(self.expected[name])}"
                )
            # a linear to be quantized is quantized from the checkpoint's own precision, not from dtype's rounding
            keep = self.from_float and name.endswith("_proj.weight") and name.startswith("model.layers.")
            t = t.to(device=self.device, dtype=None if keep else self.dtype)
            out[name] = t if keep else aligned(t)  # quantized right away: no aligned copy of a weight about to go
            self.seen.add(name)
        return out


def meta_model(folder: Path):
    """The `Llama` of a folder's config.json on the meta device: its shapes, no memory (loaders assign the weights)."""
    import torch

    with torch.device("meta"):
        return Llama(ModelArgs.from_hf_config(read_config(folder)))


def gguf_linear_blocks(source, args: ModelArgs, copy: bool = True) -> dict:
    """A GGUF base's decoder linears as its own blocks (see `quant.gguf_tensors.linear_blocks`)."""
    gguf = gguf_file(source)
    if gguf is None:
        raise UserError(f"model.quantize source keeps a GGUF file's own blocks; {source} is not a GGUF base")
    return linear_blocks(gguf, args, copy)


def install_blocks(model, blocks: dict, device) -> None:
    """Each linear named in `blocks` becomes a QuantizedLinear over the file's blocks (its bias kept)."""
    import torch

    for path, (kind, rows) in blocks.items():
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        lin = getattr(parent, name)
        if rows.shape != (lin.out_features, row_bytes(kind, lin.in_features)):
            raise UserError(
                f"GGUF tensor for {path} has {tuple(rows.shape)} bytes of {kind} blocks, "
                f"which does not fit a {lin.out_features} x {lin.in_features} weight"
            )
        bias = lin.bias.detach() if lin.bias is not None else None
        setattr(
            parent,
            name,
            QuantizedLinear(
                lin.in_features,
                lin.out_features,
                kind,
                rows.to(device),
                rows.new_empty(0, dtype=torch.float32, device=device),
                bias,
            ),
        )


# ---------------------------------------------------------------------------- PEFT adapters
