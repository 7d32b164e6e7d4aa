"""PEFT adapter files in and out: adapter_config.json + adapter_model.safetensors.

Tensor keys are PEFT's (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), so
`peft.PeftModel.from_pretrained` loads what `save_adapter` writes and the other way round.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lora_llama.errors import UserError
from lora_llama.files.atomic import atomic_dir
from lora_llama.files.json_files import read_json, write_json
from lora_llama.lora.adapted import EMBEDDING_SUFFIXES, adapter_settings, apply_lora, lora_modules, lora_state_dict
from lora_llama.lora.experts import EXPERT_WEIGHTS
from lora_llama.lora.init import plain_adapter
from lora_llama.lora.settings import lora_settings
from lora_llama.lora.tokens import EMBEDDING_PATHS
from lora_llama.model.config import BLOCK_LINEARS, LINEAR_NAMES
from lora_llama.registry import base_model_id

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
CHAT_TEMPLATE = "chat_template.jinja"  # data.chat_template, kept beside the adapter that was trained with it


def save_adapter(
    model,
    out: str | os.PathLike,
    base_model: str | None = None,
    force: bool = False,
    tensors: dict | None = None,
    plain: bool = True,
) -> Path:
    """Write the model's adapter in PEFT format (adapter_config.json + adapter_model.safetensors), atomically.
    tensors: the adapter's tensors under native names when the model's own are shards (gathered by the caller).
    plain: a PiSSA / OLoRA adapter is written as the plain rank-2r LoRA adapter of the original base (peft and
    merges load it on the base as published); without, as trained, for the residual base (checkpoints)."""
    from safetensors.torch import save_file

    settings = adapter_settings(model)
    if settings is None:
        raise UserError("the model has no LoRA adapter to save")
    tensors = tensors or lora_state_dict(model)
    r, alpha, init = settings.r, settings.alpha, settings.init_lora_weights
    initial = {
        f"{path}.lora_{x}.weight": getattr(m, f"lora_{x}0")
        for path, m in lora_modules(model).items()
        if hasattr(m, "lora_A0")
        for x in "AB"
    }
    if plain and initial:
        tensors, alpha, r = plain_adapter(tensors, initial, alpha, r, settings.rslora)
        init = True
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(LINEAR_NAMES[t] for t in settings.targets if t != "experts"),
        **({"target_parameters": list(EXPERT_PARAMETERS)} if "experts" in settings.targets else {}),
        "layers_to_transform": settings.layers,
        "use_rslora": settings.rslora,
        "bias": "none",
        "base_model_name_or_path": base_model or (model.source and base_model_id(model.source)),
        "use_dora": settings.use_dora,
        "fan_in_fan_out": False,
        "init_lora_weights": init,
        "inference_mode": True,
        "modules_to_save": settings.modules_to_save,
        "trainable_token_indices": settings.trainable_token_indices,
    }
    tensors = {PEFT_PREFIX + peft_name(k): v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_dir(out, force=force) as tmp:
        write_json(tmp / ADAPTER_CONFIG, config)
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return Path(out)


def read_adapter_config(folder: str | os.PathLike):
    """Validate a PEFT adapter_config.json and turn it into LoraSettings."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise UserError(f"{folder} holds no {ADAPTER_CONFIG}: not a PEFT adapter folder")
    cfg = read_json(folder / ADAPTER_CONFIG)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{folder}: peft_type {cfg['peft_type']!r} is not supported (only LORA)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise UserError(f"{folder}: per-module {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise UserError(f"{folder}: bias {cfg['bias']!r} is not supported (only 'none')")
    # options that change what the adapter computes or carries, which we do not implement: refused, not ignored
    for key in ("fan_in_fan_out", "lora_bias", "layer_replication", "use_qalora"):
        if cfg.get(key):
            raise UserError(f"{folder}: {key}={cfg[key]!r} is not supported")
    targets = cfg.get("target_modules") or []
    experts = _expert_parameters(folder, cfg)
    if targets == "all-linear":
        targets = [LINEAR_NAMES[t] for t in BLOCK_LINEARS]
    if isinstance(targets, str):
        raise UserError(f"{folder}: target_modules given as a pattern ({targets!r}) is not supported; list the names")
    by_hf = {v: k for k, v in LINEAR_NAMES.items()}
    unknown = [t for t in targets if t not in by_hf]
    if unknown:
        raise UserError(f"{folder}: unknown target module {unknown[0]!r} (known: {', '.join(by_hf)})")
    layers, saved = cfg.get("layers_to_transform"), modules_to_save(folder, cfg.get("modules_to_save"))
    try:  # the settings' own rules (r > 0, ...), said with the folder they came from
        settings = lora_settings(
            r=cfg.get("r", 8),
            alpha=cfg.get("lora_alpha", 8),
            dropout=cfg.get("lora_dropout", 0.0),
            targets=[by_hf[t] for t in targets] + (["experts"] if experts else []),
            rslora=bool(cfg.get("use_rslora", False)),
            use_dora=bool(cfg.get("use_dora", False)),
            init_lora_weights=cfg.get("init_lora_weights", True),
            layers=[layers] if isinstance(layers, int) else layers,
            modules_to_save=saved,
            trainable_token_indices=cfg.get("trainable_token_indices"),
        )
    except UserError as e:
        raise UserError(f"{folder / ADAPTER_CONFIG}: {e}") from None
    return settings, cfg


def modules_to_save(folder: Path, names) -> list[str] | None:
    """peft's modules_to_save of an adapter, by the names this model has (peft matches a name's last part)."""
    known = {**{name: name for name in EMBEDDING_PATHS}, **{path: name for name, path in EMBEDDING_PATHS.items()}}
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise UserError(f"{folder}: modules_to_save {unknown[0]!r} is not supported (only embed_tokens and lm_head)")
    return [known[n] for n in names] if names else None


# a mixture's experts as peft's target_parameters names them; peft nests one wrapper per parameter around the
# experts module in the order the module holds its parameters (gate_up_proj, then down_proj: the last outermost,
# whatever order the config lists them in), so gate_up's tensors sit one `base_layer.` deeper
EXPERT_PARAMETERS = tuple(f"mlp.experts.{name}" for name in EXPERT_WEIGHTS)


def _expert_parameters(folder: Path, cfg: dict) -> list[str]:
    """An adapter's target_parameters: both expert weights of a mixture (in either order), or none."""
    listed = cfg.get("target_parameters") or []
    names = [p.rsplit(".", 1)[-1] for p in listed]
    if listed and (sorted(names) != sorted(EXPERT_WEIGHTS) or not all(".experts." in f".{p}" for p in listed)):
        raise UserError(
            f"{folder}: target_parameters {listed} is not supported (LoRA on a mixture's experts lists "
            f"{' and '.join(EXPERT_PARAMETERS)})"
        )
    return names


EXPERT_KEYS = {  # native infix -> peft's, of each expert weight's LoRA tensors
    f".experts.{name}.lora_": ".experts." + "base_layer." * (len(EXPERT_WEIGHTS) - 1 - i) + "lora_"
    for i, name in enumerate(EXPERT_WEIGHTS)
}


# native parameter names -> peft's file keys, for the tensors that are not LoRA's A and B
PEFT_NAMES = {".modules_to_save.weight": ".weight", ".trainable_tokens_delta": ".token_adapter.trainable_tokens_delta"}
WHOLE_MODULES = {name: f"{path}.weight" for name, path in EMBEDDING_PATHS.items()}  # peft's module name -> weight


def peft_name(native: str) -> str:
    for ours, theirs in PEFT_NAMES.items():
        if native.endswith(ours):
            return native.removesuffix(ours) + theirs
    for ours, theirs in EXPERT_KEYS.items():
        if ours in native:
            return native.replace(ours, theirs)
    return native


def native_name(peft: str) -> str:
    if peft in WHOLE_MODULES.values():
        return peft.removesuffix(".weight") + ".modules_to_save.weight"
    if ".experts." in peft:  # the deepest first: `.experts.lora_` is inside every deeper name too
        for ours, theirs in sorted(EXPERT_KEYS.items(), key=lambda kv: -len(kv[1])):
            if theirs in peft:
                return peft.replace(theirs, ours)
    return peft.replace(".token_adapter.trainable_tokens_delta", ".trainable_tokens_delta")


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
    for key, t in loaded.items():
        dims = 1 if key.endswith(".lora_magnitude_vector") else 2
        if not t.is_floating_point() or t.dim() != dims or not torch.isfinite(t).all():
            raise UserError(f"{path}: {key} is not a finite {dims}-D float tensor (NaN, inf or a wrong type)")
    # PEFT writes `...lora_A.weight`; some tools keep the adapter name: `...lora_A.default.weight`
    return {
        native_name(k.removeprefix(PEFT_PREFIX).replace(".default.weight", ".weight")): v for k, v in loaded.items()
    }


def load_adapter_weights(model, folder: str | os.PathLike) -> None:
    """Copy a PEFT adapter's tensors into the model's existing LoRA modules, checking every name and shape."""
    loaded = read_adapter_tensors(folder)
    path = Path(folder) / ADAPTER_WEIGHTS
    own = lora_state_dict(model)
    for key, tensor in loaded.items():
        if key not in own:
            raise UserError(f"adapter tensor {PEFT_PREFIX + peft_name(key)!r} has no place in the base model")
        if tensor.shape != own[key].shape:
            raise UserError(
                f"adapter tensor {PEFT_PREFIX + peft_name(key)!r} has shape {tuple(tensor.shape)}, "
                f"the base model needs {tuple(own[key].shape)}"
            )
    missing = sorted(set(own) - set(loaded))
    if missing:
        raise UserError(f"{path} lacks {len(missing)} tensors, first {PEFT_PREFIX + peft_name(missing[0])!r}")
    with torch.no_grad():
        for key, tensor in loaded.items():
            own[key].copy_(tensor)


def load_adapter(model, folder: str | os.PathLike) -> dict:
    """Apply a PEFT LoRA adapter to a native model; returns the parameter summary."""
    settings, _ = read_adapter_config(folder)
    ranks = {t.shape[0] for k, t in read_adapter_tensors(folder).items() if ".lora_A." in k and ".experts." not in k}
    if ranks - {settings.r}:  # checked before apply_lora allocates r x in for every layer
        raise UserError(
            f"{Path(folder) / ADAPTER_CONFIG} says r={settings.r}, its tensors have rank {sorted(ranks)[0]}"
        )
    summary = apply_lora(model, settings)
    load_adapter_weights(model, folder)
    return summary


def adapter_deltas(folder: str | os.PathLike, tensors: dict | None = None) -> tuple[dict, float, dict]:
    """({base weight name: (A, B, DoRA magnitude or None)}, scale, adapter_config) of a PEFT adapter, for merges.
    tensors: `read_adapter_tensors(folder)` when the caller has read them already."""
    settings, cfg = read_adapter_config(folder)
    pairs: dict[str, dict] = {}
    for key, t in (tensors if tensors is not None else read_adapter_tensors(folder)).items():
        if key.endswith(EMBEDDING_SUFFIXES):  # trained embedding rows or modules: `embedding_changes`
            continue
        module, _, kind = key.rpartition(".lora_")  # e.g. model.layers.0.self_attn.q_proj, A.weight / magnitude_vector
        pairs.setdefault(module + ".weight", {})[kind[0]] = t
    want = {"A", "B", "m"} if settings.use_dora else {"A", "B"}
    incomplete = [k for k, v in pairs.items() if set(v) != want]
    if incomplete:
        raise UserError(
            f"{Path(folder) / ADAPTER_WEIGHTS}: {incomplete[0]} lacks one of "
            f"{', '.join(sorted(want - set(pairs[incomplete[0]]))) or 'its tensors'}"
        )
    return {k: (v["A"], v["B"], v.get("m")) for k, v in pairs.items()}, settings.scale, cfg


def embedding_changes(folder: str | os.PathLike, tensors: dict | None = None) -> dict:
    """{base weight name: (row indices, their values)} of an adapter's modules_to_save (indices None: the whole
    matrix) and trainable_token_indices, for merges. A tied lm_head's rows are the embedding's."""
    settings, _ = read_adapter_config(folder)
    tensors = tensors if tensors is not None else read_adapter_tensors(folder)
    changes = {}
    for name in settings.modules_to_save or ():
        weight = WHOLE_MODULES[name]
        changes[weight] = (None, _needed(folder, tensors, native_name(weight)))
    for name, indices in settings.trainable_rows.items():
        weight = WHOLE_MODULES[name]
        values = _needed(folder, tensors, weight.removesuffix(".weight") + ".trainable_tokens_delta")
        if values.shape[0] != len(indices):
            raise UserError(f"{Path(folder) / ADAPTER_WEIGHTS}: {len(indices)} token ids, {values.shape[0]} rows")
        changes[weight] = (torch.tensor(indices), values)
    return changes


def _needed(folder, tensors: dict, key: str) -> torch.Tensor:
    if key not in tensors:
        raise UserError(f"{Path(folder) / ADAPTER_WEIGHTS} lacks {PEFT_PREFIX + peft_name(key)!r}")
    return tensors[key]
