"""A mixture of experts read from a GGUF file: what transformers' GGUF reading leaves out for the architectures it
reads (Qwen2-MoE as `qwen2moe`, Qwen3-MoE as `qwen3moe`). Its config mapping drops the experts' own feed-forward
sizes, which the file holds (`expert_feed_forward_length`, `expert_shared_feed_forward_length`), and whether the
chosen experts' weights are renormalised, which llama.cpp fixes per architecture (qwen3moe: yes, qwen2moe: no);
a tensor the file stores with its unit dimensions dropped (the shared expert's gate) is given the model's shape.
Mixtral's files (llama.cpp's `llama` with experts) are refused: transformers reads them as a dense Llama."""

from __future__ import annotations

from pathlib import Path

from lora_llama.errors import UserError

READ = ("qwen2moe", "qwen3moe")  # the mixture architectures read
RENORMALISES = {"qwen2moe": False, "qwen3moe": True, "llama": True}  # llama.cpp's top-k weights, per architecture
SIZES = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def gguf_fields(gguf: Path) -> dict | None:
    """A GGUF file's metadata, {key: value} (None for a file gguf cannot read: transformers' reading says why)."""
    try:
        from gguf import GGUFReader

        return {k: f.contents() for k, f in GGUFReader(gguf).fields.items() if not k.startswith("tokenizer.")}
    except Exception:
        return None


def mixture_architecture(fields: dict | None) -> str | None:
    """The file's llama.cpp architecture when its metadata gives it experts (`ARCH.expert_count` above 0)."""
    if not fields:
        return None
    arch = fields.get("general.architecture")
    return arch if int(fields.get(f"{arch}.expert_count") or 0) > 0 else None


def check_readable(gguf: Path, arch: str) -> None:
    if arch not in READ:
        raise UserError(
            f"{gguf} holds a mixture of experts in llama.cpp's {arch} architecture, which is not read from GGUF "
            f"(mixtures are read as {' and '.join(READ)}): train its HF checkpoint"
        )


def complete_config(config, fields: dict, arch: str) -> None:
    """The experts' sizes and the top-k renormalisation, set on transformers' config read from the file."""
    for key, name in SIZES.items():
        if f"{arch}.{key}" in fields:
            setattr(config, name, int(fields[f"{arch}.{key}"]))
    config.norm_topk_prob = RENORMALISES[arch]


def fit_shapes(tensors: dict, model) -> dict:
    """The tensors in the model's shapes where a file drops unit dimensions (same count of values)."""
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    return {
        k: v.reshape(shapes[k]) if k in shapes and v.shape != shapes[k] and v.numel() == shapes[k].numel() else v
        for k, v in tensors.items()
    }
