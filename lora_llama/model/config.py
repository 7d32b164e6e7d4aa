"""The model's configuration: `ModelArgs` from an HF config.json, per family, and the
vocabularies every other module shares (dtypes, LoRA targets, quantize kinds, precisions).

What a family sets that the native model does not implement is refused here, never ignored.
The recipe schema users write lives in recipe/schema.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from lora_llama.errors import UserError


@dataclass(frozen=True)
class Family:
    """Where a model_type differs from Llama (read off transformers' modeling_<type>.py)."""

    architecture: str  # the transformers class: written as `architectures` in the configs we write
    qkv_bias: bool | None = None  # bias on q, k, v: fixed by the family, or None for config's attention_bias
    o_bias: bool | None = None  # bias on o: the same
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    sliding_window: bool = False  # every layer honours config's sliding_window (Mistral)
    experts: bool = False  # a mixture of experts in the MLP of every sparse layer (MoeArgs)
    gemma: bool = False  # Gemma 3: 1 + w norms in a sandwich, scaled embeddings, gelu-tanh, sliding and global layers


FAMILIES = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM", qkv_bias=False, o_bias=False, sliding_window=True),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, o_bias=False),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "mixtral": Family("MixtralForCausalLM", qkv_bias=False, o_bias=False, sliding_window=True, experts=True),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", qkv_bias=True, o_bias=False, experts=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qk_norm=True, experts=True),
    "gemma3_text": Family("Gemma3ForCausalLM", qk_norm=True, gemma=True),
}
# keys transformers adds when it loads or converts a model: local paths and names that mean nothing elsewhere
_LOAD_TIME_KEYS = ("_name_or_path", "_model_name_or_path", "_commit_hash", "_attn_implementation_autoset")
_DEFAULT_LABELS = {"0": "LABEL_0", "1": "LABEL_1"}
# dtype spellings users write -> torch attribute names (the canonical spellings are the values)
DTYPE_NAMES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
DType = Literal[tuple(sorted(set(DTYPE_NAMES.values())))]
# the model's linear layers by short name -> module path inside a decoder block (lm_head lives at the top of the
# model); the short names are what users write (LoRA's targets)
LINEARS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "lm_head": "lm_head",
}
LINEAR_NAMES = {
    t: path.rsplit(".", 1)[-1] for t, path in LINEARS.items()
}  # q -> q_proj (what PEFT's target_modules lists)
BLOCK_LINEARS = tuple(t for t in LINEARS if t != "lm_head")  # the seven linears of a block ("all-linear")
DEVICE = r"auto|cpu|cuda(:\d+)?"  # model.device and --device, as a regular expression; what auto picks: runtime/auto.py
PRECISIONS = ("fp32", "bf16-mixed", "auto")  # train.precision; what each means: runtime/auto.py


def torch_dtype(name: str):
    """The torch dtype for a spelling in DTYPE_NAMES (torch imported only here, when needed)."""
    import torch

    if name not in DTYPE_NAMES:
        raise UserError(f"unknown dtype {name!r} (use one of {', '.join(DTYPE_NAMES)})")
    return getattr(torch, DTYPE_NAMES[name])


@dataclass(frozen=True)
class MoeArgs:
    """A mixture of experts in place of a layer's MLP (read off transformers' modeling_mixtral.py,
    modeling_qwen2_moe.py, modeling_qwen3_moe.py)."""

    num_experts: int
    top_k: int  # experts per token
    expert_dim: int  # each expert's intermediate size
    norm_topk_prob: bool  # the top-k probabilities renormalised to sum to 1 (Mixtral always)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the mixture; the others keep a dense MLP
    shared_expert_dim: int = 0  # Qwen2-MoE: an expert every token passes through, scaled by a sigmoid gate
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight in the training loss
    output_router_logits: bool = False  # the config asks for the load-balancing loss in training

    @classmethod
    def from_hf_config(cls, cfg: dict, mixtral: bool) -> "MoeArgs":
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        every, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        if cfg.get("router_jitter_noise"):
            raise UserError("router_jitter_noise (noise on the router's input in training) is not supported")
        return cls(
            num_experts=experts,
            top_k=cfg["num_experts_per_tok"],
            expert_dim=cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"],
            norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
            sparse_layers=tuple(
                i for i in range(cfg["num_hidden_layers"]) if experts and i not in dense and (i + 1) % every == 0
            ),
            shared_expert_dim=cfg.get("shared_expert_intermediate_size") or 0,
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
            output_router_logits=bool(cfg.get("output_router_logits", False)),
        )


@dataclass
class ModelArgs:
    model_type: str = "llama"  # a key of FAMILIES
    vocab_size: int = 32000
    dim: int = 4096  # hidden_size
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: multi-head attention (kv heads = heads)
    head_dim: int | None = None  # None: dim // n_heads; Gemma-style configs give it explicitly
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": 8.0, ...}
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: q and k normalised per head before RoPE
    sliding_window: int | None = None  # Mistral: a position attends to itself and the window - 1 before it
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    moe: MoeArgs | None = None  # a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE)
    gemma: bool = False  # Gemma 3's norms, embedding scale and sandwich blocks (model/gemma.py)
    hidden_act: str = "silu"  # silu (SwiGLU) or gelu_pytorch_tanh (Gemma's GeGLU)
    query_scale: float | None = None  # Gemma: attention scores scaled by query_scale^-1/2 instead of head_dim^-1/2
    local_layers: tuple[int, ...] = ()  # Gemma: the sliding-window layers, with their own window and RoPE base
    local_window: int | None = None
    local_rope_theta: float | None = None
    hf_config: dict = field(default_factory=dict, repr=False)  # the original, written back by merge

    def __post_init__(self):
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        self.head_dim = self.head_dim or self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise UserError(
                f"num_attention_heads={self.n_heads} is not a multiple of num_key_value_heads={self.n_kv_heads}"
            )
        if self.rope_scaling:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise UserError(f"rope scaling type {kind!r} is not supported (supported: default, llama3, linear)")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        family = family_of(cfg)
        attention_bias = cfg.get("attention_bias", False)
        # transformers >= 5 writes `rope_parameters` (Gemma: one per layer type); Hub checkpoints carry `rope_theta`
        # + `rope_scaling` (Gemma: and `rope_local_base_freq`)
        rope = dict(cfg.get("rope_parameters") or {})
        local_rope = rope.pop("sliding_attention", None) or {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        rope = dict(rope.pop("full_attention", rope))
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
        return cls(
            model_type=cfg.get("model_type", "llama"),
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads"),
            head_dim=cfg.get("head_dim"),
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None,
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", family.gemma),  # Gemma ties them by default
            qkv_bias=cfg.get("qkv_bias", attention_bias if family.qkv_bias is None else family.qkv_bias),
            o_bias=attention_bias if family.o_bias is None else family.o_bias,
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=family.qk_norm,
            sliding_window=cfg.get("sliding_window") if family.sliding_window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            moe=MoeArgs.from_hf_config(cfg, model_type_of(cfg) == "mixtral") if family.experts else None,
            **(gemma_args(cfg, local_rope) if family.gemma else {}),
            hf_config=dict(cfg),
        )


def layer_types(cfg: dict) -> list[str]:
    """Each layer's attention: config's `layer_types`, or Gemma 3's pattern (each `sliding_window_pattern`-th
    layer global)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(cfg["num_hidden_layers"])]


def gemma_args(cfg: dict, local_rope: dict) -> dict:
    if local_rope.get("rope_type", "default") != "default":
        raise UserError(
            f"gemma3_text with rope type {local_rope['rope_type']!r} on its sliding layers is not supported"
        )
    return dict(
        gemma=True,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act"),
        query_scale=float(cfg["query_pre_attn_scalar"]),
        local_layers=tuple(i for i, t in enumerate(layer_types(cfg)) if t == "sliding_attention"),
        local_window=cfg["sliding_window"],
        local_rope_theta=float(local_rope["rope_theta"]),
    )


def model_type_of(cfg: dict) -> str:
    return cfg.get("model_type", "llama")


def family_of(cfg: dict) -> Family:
    """The family of an HF config; what it sets that we do not implement is refused, never ignored."""
    model_type = model_type_of(cfg)
    if model_type not in FAMILIES:
        raise UserError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    family = FAMILIES[model_type]
    act = (
        (cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"))
        if family.gemma
        else cfg.get("hidden_act", "silu")
    )
    wanted = "gelu_pytorch_tanh" if family.gemma else "silu"
    if act != wanted:
        raise UserError(f"{model_type} with hidden_act {act!r} is not supported (only {wanted})")
    if family.gemma:
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
            if cfg.get(key):
                raise UserError(f"{model_type} with {key} {cfg[key]!r} is not supported")
        return family
    # Mistral's window covers every layer (ModelArgs.sliding_window); Qwen's per-layer windows are not implemented
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or []):
        raise UserError(f"{model_type} with sliding-window layers (use_sliding_window / layer_types) is not supported")
    return family


def portable_hf_config(cfg: dict) -> dict:
    """config.json as we write it, for any tool to read: `architectures` names the family's class; no
    local path, no load-time key, no default label maps; `rope_theta` (and a non-default `rope_scaling`)
    also at the top level, where transformers < 5 and llama.cpp's converter read them."""
    out = {
        k: v for k, v in cfg.items() if k not in _LOAD_TIME_KEYS and not (v is None and k in ("dtype", "torch_dtype"))
    }
    out["architectures"] = [family_of(cfg).architecture]
    if {str(k): v for k, v in (out.get("id2label") or {}).items()} == _DEFAULT_LABELS:
        out.pop("id2label"), out.pop("label2id", None)
    rope = dict(out.get("rope_parameters") or {})
    if "rope_theta" in rope:
        out.setdefault("rope_theta", rope.pop("rope_theta"))
    if rope.get("rope_type", "default") != "default":
        out.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    return out


def rope_inv_freq(args: ModelArgs, dtype=None):
    """RoPE's inverse frequencies (head_dim // 2,), with Llama 3.1 frequency scaling when configured:
    long wavelengths are stretched by `factor`, short ones kept, the band between interpolated."""
    import torch

    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype or torch.float32) / d))
    s = args.rope_scaling
    if s and s.get("rope_type", s.get("type")) == "linear":  # positions divided by the factor
        return inv_freq / s["factor"]
    if not s or s.get("rope_type", s.get("type")) != "llama3":
        return inv_freq
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)
