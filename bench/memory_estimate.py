"""GPU memory of a LoRA training step, computed from a model's shapes (not measured): the frozen base in its
quantization, the adapter with its gradient and AdamW's two moments, and the activations a step keeps with
`train.gradient_checkpointing: true` in bf16-mixed precision. Prints the markdown table docs/gpu.md shows
(`python -m bench.memory_estimate`), or one GPU recipe's own step (`--recipe recipes/NAME.yaml`, as its comment
states it); the docs test checks that the page and the recipes hold these figures.

Activations with block checkpointing: each decoder block's bf16 input is kept (dim a token per layer); one block
is recomputed at a time in backward, keeping its norms' outputs, q, k, v, the attention output, and the MLP's
gate, up and their product (6·dim + 2·kv_dim + 3·intermediate a token); the input gradients in flight take
about three float32 hidden states a token. The loss is computed in chunks and adds little. CUDA's context and the
allocator's slack come on top (CONTEXT_GB)."""

from __future__ import annotations

import argparse

import yaml

from bench.common import LLAMA31_8B
from lora_llama.quant.handlers import quant_format

# the config.json shapes of the models the GPU recipes name (recipes/*.yaml)
SHAPES = {
    "meta-llama/Llama-3.1-8B-Instruct": LLAMA31_8B,
    "meta-llama/Llama-2-7b-hf": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    ),
    "mistralai/Mistral-7B-Instruct-v0.3": dict(
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-30B-A3B-Instruct-2507": dict(  # a mixture: 128 experts of 768, 8 a token, in all 48 layers
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        tie_word_embeddings=False,
    ),
    "google/gemma-3-1b-it": dict(  # 26 layers, 5 sliding to each global one; a 262k vocabulary, tied
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}

GPUS_GB = (16, 24, 48, 80)
CONTEXT_GB = 1.5  # the CUDA context, cuBLAS workspaces and the caching allocator's slack
HEADROOM = 0.9  # a GPU "fits" a step that needs at most 90% of its memory
GB = 1e9


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each decoder linear of one layer; a mixture's `experts`: every expert's gate, up and down
    as one (out, in) of the same number of weights and the same LoRA size (E·(2I + I) rows of H, rank r each)."""
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or dim // heads
    q, kv = heads * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q": (q, dim), "k": (kv, dim), "v": (kv, dim), "o": (dim, q)}
    if "num_experts" in cfg:
        return {**shapes, "experts": None}
    inter = cfg["intermediate_size"]
    return {**shapes, "gate": (inter, dim), "up": (inter, dim), "down": (dim, inter)}


def expert_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of every expert weight of one layer: gate, up and down of each expert."""
    inter, dim = cfg["moe_intermediate_size"], cfg["hidden_size"]
    return [(inter, dim), (inter, dim), (dim, inter)] * cfg["num_experts"]


def quantized_bytes(out: int, inp: int, quantize: str | None, double_quant: bool = False) -> float:
    """Bytes of one frozen (out, in) weight: bf16, or the tensors its quantized format holds it in."""
    fmt = quant_format(quantize, double_quant)
    return fmt.bytes(out, inp) if fmt is not None else 2 * out * inp


def base_bytes(cfg: dict, quantize: str | None, double_quant: bool = False) -> float:
    """The frozen base: decoder linears in their quantization, the embedding and lm_head in bf16."""
    shapes = [s for s in linear_shapes(cfg).values() if s] + (expert_shapes(cfg) if "num_experts" in cfg else [])
    router = 2 * cfg.get("num_experts", 0) * cfg["hidden_size"]  # bf16, never quantized
    layers = cfg["num_hidden_layers"] * (router + sum(quantized_bytes(o, i, quantize, double_quant) for o, i in shapes))
    embeddings = cfg["vocab_size"] * cfg["hidden_size"] * 2 * (1 if cfg["tie_word_embeddings"] else 2)
    return layers + embeddings


def lora_parameters(cfg: dict, r: int, targets: list[str]) -> int:
    shapes = {**linear_shapes(cfg), **({"experts": (0, 0)} if "num_experts" in cfg else {})}
    per_layer = sum(r * (shapes[t][0] + shapes[t][1]) for t in targets if t != "experts")
    if "experts" in targets:  # lora_A (r·E, in) and lora_B (out, r·E) of gate_up and of down
        e, inter, dim = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
        per_layer += r * e * ((dim + 2 * inter) + (inter + dim))
    return cfg["num_hidden_layers"] * per_layer


def activation_bytes(cfg: dict, tokens: int) -> float:
    """A mixture's MLP keeps its gate, up and product for each of the k experts a token goes to."""
    dim = cfg["hidden_size"]
    inter = (
        cfg["num_experts_per_tok"] * cfg["moe_intermediate_size"] if "num_experts" in cfg else cfg["intermediate_size"]
    )
    kv = (cfg.get("head_dim") or dim // cfg["num_attention_heads"]) * cfg["num_key_value_heads"]
    kept_inputs = cfg["num_hidden_layers"] * dim * 2
    one_block = (6 * dim + 2 * kv + 3 * inter) * 2
    gradients = 3 * dim * 4
    return tokens * (kept_inputs + one_block + gradients)


def step_gb(
    cfg: dict, quantize: str | None, batch: int, length: int, r: int = 16, targets=None, context: float = CONTEXT_GB
) -> dict:
    targets = targets or list(linear_shapes(cfg))
    parts = {
        "base": base_bytes(cfg, quantize),
        "adapter": 16 * lora_parameters(cfg, r, targets),  # float32 A, B, their gradients, AdamW's two moments
        "activations": activation_bytes(cfg, batch * length),
    }
    parts = {k: v / GB for k, v in parts.items()}
    parts["total"] = sum(parts.values()) + context
    return parts


def table(cfg: dict = LLAMA31_8B, r: int = 16) -> str:
    rows = [
        "| base | batch x length | base weights | adapter + AdamW | activations | total | smallest GPU it fits |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for quantize in ("nf4", "int8", None):
        for batch, length in ((1, 2048), (4, 2048), (8, 2048), (2, 8192)):
            gb = step_gb(cfg, quantize, batch, length, r)
            fits = next((f"{g} GB" for g in GPUS_GB if gb["total"] <= HEADROOM * g), "none of these")
            rows.append(
                f"| {quantize or 'bf16'} | {batch} x {length} | {gb['base']:.1f} GB | {gb['adapter']:.1f} GB "
                f"| {gb['activations']:.1f} GB | {gb['total']:.1f} GB | {fits} |"
            )
    return "\n".join(rows) + "\n"


def recipe_gb(path) -> tuple[dict, int, int]:
    """(step_gb, batch, length) of a recipe: its model's shapes, quantization, batch, max_seq_len, rank and
    targets (a recipe whose model.device is cpu: no CUDA context)."""
    recipe = yaml.safe_load(open(path))
    model, lora, data, train = (recipe.get(k, {}) for k in ("model", "lora", "data", "train"))
    batch, length = train.get("batch_size", 8), data.get("max_seq_len", 256)
    context = 0.0 if model.get("device") == "cpu" else CONTEXT_GB
    shapes = SHAPES[model["source"]]
    gb = step_gb(shapes, model.get("quantize"), batch, length, lora.get("r", 8), lora.get("targets"), context)
    return gb, batch, length


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", help="a GPU recipe: its own step's memory instead of the table")
    args = parser.parse_args()
    if args.recipe:
        gb, batch, length = recipe_gb(args.recipe)
        print(f"{args.recipe}: about {gb['total']:.0f} GB a step at batch {batch} x {length}")
    else:
        print(table(), end="")


if __name__ == "__main__":
    main()
