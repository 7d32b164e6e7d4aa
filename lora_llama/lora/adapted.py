"""A model's adapters as a whole: `apply_lora` wraps the targeted linears, which settings they carry, switched
off for a reference pass, their tensors under PEFT's names, merged into the base (`merge_lora`)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from lora_llama.errors import UserError
from lora_llama.files.shards import read_tensors
from lora_llama.lora.experts import LoRAExperts, expert_modules
from lora_llama.lora.layer import LoRALinear, fold, shared_input_projection
from lora_llama.lora.settings import LoraSettings
from lora_llama.lora.tokens import embedding_settings, embedding_wrappers, merge_embeddings, wrap_embeddings
from lora_llama.model.config import LINEARS
from lora_llama.model.linears import use_projection
from lora_llama.quant.linear import QuantizedLinear


def target_paths(model, settings: LoraSettings) -> list[str]:
    """Dotted module paths that the settings adapt, e.g. `model.layers.0.self_attn.q_proj`."""
    n_layers = model.args.n_layers
    layers = range(n_layers) if settings.layers is None else settings.layers
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise UserError(f"LoRA layer {bad[0]} does not exist (the model has layers 0..{n_layers - 1})")
    linears = [t for t in settings.targets if t not in ("lm_head", "experts")]
    paths = [f"model.layers.{i}.{LINEARS[t]}" for i in layers for t in linears]
    mixtures = [p for p in paths if not hasattr(model.get_submodule(p.rpartition(".")[0]), p.rpartition(".")[2])]
    if mixtures:
        _, _, i, name = mixtures[0].split(".", 3)
        raise UserError(
            f"layer {i} of this {model.args.model_type} model is a mixture of experts, with no {name}: its experts "
            "take lora.targets experts; gate, up, down adapt dense layers (pick those with lora.layers)"
        )
    return paths + (["lm_head"] if "lm_head" in settings.targets else [])


def expert_paths(model, settings: LoraSettings) -> list[str]:
    """`model.layers.N.mlp.experts` of every adapted layer whose MLP is a mixture, when the targets name experts."""
    if "experts" not in settings.targets:
        return []
    if model.args.moe is None:
        raise UserError(
            f"lora.targets experts: this {model.args.model_type} model has no mixture of experts "
            "(its MLP's linears are gate, up, down)"
        )
    layers = range(model.args.n_layers) if settings.layers is None else settings.layers
    return [f"model.layers.{i}.mlp.experts" for i in layers if i in model.args.moe.sparse_layers]


def lora_modules(model) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model, settings: LoraSettings) -> dict:
    """Wrap the targeted linears in LoRALinear, freeze everything else; return a parameter summary."""
    if lora_modules(model) or expert_modules(model):
        raise UserError("the model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    if "lm_head" in settings.targets:
        model.untie_weights()  # so that merging lm_head's adapter never changes the embedding
    for path in target_paths(model, settings):
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(
            parent,
            child,
            LoRALinear(
                getattr(parent, child),
                settings.r,
                settings.alpha,
                settings.dropout,
                settings.rslora,
                settings.use_dora,
                settings.init_lora_weights,
            ),
        )
    for path in expert_paths(model, settings):
        parent = model.get_submodule(path.rpartition(".")[0])
        parent.experts = LoRAExperts(
            parent.experts, settings.r, settings.alpha, settings.rslora, settings.init_lora_weights
        )
    wrap_embeddings(model, settings.modules_to_save, settings.trainable_rows)
    use_projection(model, shared_input_projection)  # LoRA layers sharing an input run as one autograd node
    return parameter_summary(model)


def adapter_settings(model) -> LoraSettings | None:
    """The settings the model's LoRA layers were made with, read off the layers (None: no adapter)."""
    modules = {**lora_modules(model), **expert_modules(model)}
    if not modules:
        return None
    by_path = {**{path: t for t, path in LINEARS.items()}, "mlp.experts": "experts"}
    targets, layers = set(), set()
    for name in modules:  # lm_head, or model.layers.{i}.self_attn.q_proj ..., model.layers.{i}.mlp.experts
        parts = name.split(".", 3)
        targets.add(by_path[parts[-1] if len(parts) == 4 else name])
        if len(parts) == 4:
            layers.add(int(parts[2]))
    m = next(iter(modules.values()))
    every_layer = layers in (set(), set(range(model.args.n_layers)))
    return LoraSettings(
        r=m.r,
        alpha=m.alpha,
        dropout=m.dropout,
        rslora=m.rslora,
        use_dora=m.use_dora,
        init_lora_weights=m.init,
        targets=[t for t in (*LINEARS, "experts") if t in targets],
        layers=None if every_layer else sorted(layers),
        **embedding_settings(model),
    )


@contextlib.contextmanager
def adapters_disabled(model):
    """Inside the block the model gives its base outputs (every LoRA layer skips B·A): the base
    model without a second copy of it."""
    modules = [*lora_modules(model).values(), *expert_modules(model).values()]
    if any(m.merged for m in modules):
        raise UserError("cannot disable a merged adapter; unmerge it first")
    modules += embedding_wrappers(model).values()
    for m in modules:
        m.disabled = True
    try:
        yield model
    finally:
        for m in modules:
            m.disabled = False


def parameter_summary(model) -> dict:
    """Trainable and total parameters; a quantized linear's weight counts as its out x in parameters, as peft
    counts a 4-bit weight, so a quantized base reports the model's size."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters()) + sum(
        m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantizedLinear)
    )
    return {"trainable": trainable, "total": total, "percent": round(100 * trainable / total, 4)}


EMBEDDING_SUFFIXES = (".modules_to_save.weight", ".trainable_tokens_delta")  # lora/tokens.py's trained tensors
ADAPTER_SUFFIXES = (".lora_magnitude_vector", *EMBEDDING_SUFFIXES)


def lora_state_dict(model) -> dict[str, torch.Tensor]:
    """Native names of the adapter tensors, e.g. `model.layers.0.self_attn.q_proj.lora_A.weight` (and DoRA's
    `...q_proj.lora_magnitude_vector`, modules_to_save's `model.embed_tokens.modules_to_save.weight`, trained rows'
    `model.embed_tokens.trainable_tokens_delta`)."""
    return {
        k: v
        for k, v in model.state_dict().items()
        if ".lora_A." in k or ".lora_B." in k or k.endswith(ADAPTER_SUFFIXES)
    }


def merge_lora(model) -> None:
    """Fold every adapter into its base weight and unwrap it, leaving a plain Llama.

    A quantised base layer is never merged into: its ORIGINAL full-precision weight is
    read again from the checkpoint, ΔW added, and a plain nn.Linear takes its place.
    """
    modules = lora_modules(model)
    quantized = [p for p, m in modules.items() if not m.base_layer.weight.is_floating_point()]
    if quantized and model.folder is None:
        raise UserError("merging into a quantised base needs its original weights: load the model with load_model")
    originals = read_tensors(model.folder, [f"{p}.weight" for p in quantized]) if quantized else {}
    dtype = model.model.embed_tokens.weight.dtype
    for path, m in modules.items():
        if path in quantized:
            base = m.base_layer
            merged = nn.Linear(
                m.in_features, m.out_features, bias=base.bias is not None, device=m.lora_A.weight.device, dtype=dtype
            )
            with torch.no_grad():
                w0 = originals[f"{path}.weight"].to(merged.weight.device)
                merged.weight.copy_(
                    fold(
                        w0,
                        m.lora_A.weight,
                        m.lora_B.weight,
                        m.scale,
                        magnitude=m.lora_magnitude_vector if m.use_dora else None,
                    )
                )
                if base.bias is not None:
                    merged.bias.copy_(base.bias)
            merged.requires_grad_(False)
        else:
            m.merge()
            merged = m.base_layer
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, merged)
    for path, m in expert_modules(model).items():
        m.merge()
        model.get_submodule(path.rpartition(".")[0]).experts = m.base_layer
    merge_embeddings(model)
