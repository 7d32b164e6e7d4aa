"""Typed settings: `ModelArgs` (from an HF config.json, per family), `LoraSettings`, `Recipe`.

Everything a user writes (a recipe, overrides, LoRA settings) is validated here
by pydantic, so a typo fails before any model is loaded and the error names the
key path.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import UserError


@dataclass(frozen=True)
class Family:
    """Where a model_type differs from Llama (read off transformers' modeling_<type>.py)."""
    architecture: str  # the transformers class: written as `architectures` in the configs we write
    qkv_bias: bool | None = None  # bias on q, k, v: fixed by the family, or None for config's attention_bias
    o_bias: bool | None = None  # bias on o: the same
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    sliding_window: bool = False  # every layer honours config's sliding_window (Mistral)


FAMILIES = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM", qkv_bias=False, o_bias=False, sliding_window=True),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, o_bias=False),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
}
# keys transformers adds when it loads or converts a model: local paths and names that mean nothing elsewhere
_LOAD_TIME_KEYS = ("_name_or_path", "_model_name_or_path", "_commit_hash", "_attn_implementation_autoset")
_DEFAULT_LABELS = {"0": "LABEL_0", "1": "LABEL_1"}
# dtype spellings users write -> torch attribute names (the canonical spellings are the values)
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}
DType = Literal[tuple(sorted(set(DTYPE_NAMES.values())))]
# LoRA target name -> module path inside a decoder block (lm_head lives at the top of the model)
TARGET_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj", "lm_head": "lm_head",
}
HF_NAME = {t: path.rsplit(".", 1)[-1] for t, path in TARGET_MODULES.items()}  # q -> q_proj: PEFT's target_modules
DECODER_TARGETS = tuple(t for t in TARGET_MODULES if t != "lm_head")  # the seven linears of a block ("all-linear")
Target = Literal[tuple(TARGET_MODULES)]
QUANTIZE_KINDS = ("int8", "nf4")  # frozen base weights through bitsandbytes (nf4: CUDA only)
PRECISIONS = ("fp32", "bf16-mixed", "auto")  # train.precision; what each means: precision.py


def torch_dtype(name: str):
    """The torch dtype for a spelling in DTYPE_NAMES (torch imported only here, when needed)."""
    import torch

    if name not in DTYPE_NAMES:
        raise UserError(f"unknown dtype {name!r} (use one of {', '.join(DTYPE_NAMES)})")
    return getattr(torch, DTYPE_NAMES[name])


def lora_scale(r: int, alpha: float, rslora: bool = False) -> float:
    """alpha/r, or alpha/sqrt(r) with rsLoRA (Kalajdzievski 2023): the factor on B·A."""
    return alpha / (r ** 0.5 if rslora else r)


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
    hf_config: dict = field(default_factory=dict, repr=False)  # the original, written back by merge

    def __post_init__(self):
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        self.head_dim = self.head_dim or self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"num_attention_heads={self.n_heads} is not a multiple of num_key_value_heads={self.n_kv_heads}")
        if self.rope_scaling:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise UserError(f"rope scaling type {kind!r} is not supported (supported: default, llama3)")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        family = family_of(cfg)
        attention_bias = cfg.get("attention_bias", False)
        # transformers >= 5 writes `rope_parameters`; Hub checkpoints carry `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or {})
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
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
            o_bias=attention_bias if family.o_bias is None else family.o_bias,
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=family.qk_norm,
            sliding_window=cfg.get("sliding_window") if family.sliding_window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            hf_config=dict(cfg),
        )


def family_of(cfg: dict) -> Family:
    """The family of an HF config; what it sets that we do not implement is refused, never ignored."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise UserError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    family = FAMILIES[model_type]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{model_type} with hidden_act {act!r} is not supported (only silu)")
    # Mistral's window covers every layer (ModelArgs.sliding_window); Qwen's per-layer windows are not implemented
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or []):
        raise UserError(f"{model_type} with sliding-window layers (use_sliding_window / layer_types) is not supported")
    return family


def portable_hf_config(cfg: dict) -> dict:
    """config.json as we write it, for any tool to read: `architectures` names the family's class; no
    local path, no load-time key, no default label maps; `rope_theta` (and a non-default `rope_scaling`)
    also at the top level, where transformers < 5 and llama.cpp's converter read them."""
    out = {k: v for k, v in cfg.items() if k not in _LOAD_TIME_KEYS and not (v is None and k in ("dtype", "torch_dtype"))}
    out["architectures"] = [family_of(cfg).architecture]
    if {str(k): v for k, v in (out.get("id2label") or {}).items()} == _DEFAULT_LABELS:
        out.pop("id2label"), out.pop("label2id", None)
    rope = dict(out.get("rope_parameters") or {})
    if "rope_theta" in rope:
        out.setdefault("rope_theta", rope.pop("rope_theta"))
    if rope.get("rope_type", "default") != "default":
        out.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    return out


# ---------------------------------------------------------------------------- LoRA


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSettings(Settings):
    r: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    targets: list[Target] = ["q", "k", "v", "o"]
    layers: list[int] | None = None  # None: every decoder layer
    rslora: bool = False  # scale alpha/sqrt(r) instead of alpha/r

    @field_validator("targets")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("at least one target is needed")
        return list(dict.fromkeys(v))

    @property
    def scale(self) -> float:
        return lora_scale(self.r, self.alpha, self.rslora)


# ---------------------------------------------------------------------------- recipe


class ModelSection(Settings):
    source: str = "smollm2-135m-instruct"  # HF folder, .gguf, Hub id or registered name
    dtype: DType = "float32"
    quantize: Literal[QUANTIZE_KINDS] | None = None
    int8_threshold: float = Field(6.0, ge=0.0)  # LLM.int8() outlier threshold
    device: str = "auto"  # auto: cuda when available, else cpu


class DataSection(Settings):
    source: str = "chatterbot-corpus"  # file, folder, Hub dataset id or registered name
    # preference: prompt / chosen / rejected columns, for train.objective dpo or orpo
    format: Literal["text", "alpaca", "chat", "preference", "auto"] = "chat"
    max_seq_len: int = Field(256, gt=1)
    val_size: float = Field(0.1, ge=0.0, lt=1.0)
    val_source: str | None = None  # a separate validation source instead of a split
    packing: bool = False
    train_on_prompt: bool = False
    # column names for sources whose columns differ, e.g. {"instruction": "question", "output": "answer"}
    fields: dict[str, str] = {}
    prompt_template: str | None = None  # for alpaca data on base models without a chat template
    max_examples: int | None = Field(None, gt=0)


class DPOSettings(Settings):
    beta: float = Field(0.1, gt=0)  # strength of the pull towards the reference (the base, adapter off)
    loss: Literal["sigmoid", "ipo"] = "sigmoid"  # DPO's logistic loss, or IPO's squared one (per-token average)


class ORPOSettings(Settings):
    beta: float = Field(0.1, gt=0)  # weight of the odds-ratio term against the NLL (the paper's lambda; trl's beta)


class TrainSection(Settings):
    batch_size: int = Field(4, gt=0)
    grad_accum: int = Field(1, gt=0)
    lr: float = Field(3.0e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_steps: int | None = Field(300, gt=0)
    epochs: float | None = Field(None, gt=0)
    warmup_steps: int = Field(10, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float | None = Field(1.0, gt=0)
    eval_every: int = Field(50, gt=0)
    save_every: int = Field(100, gt=0)
    keep_last: int = Field(2, gt=0)
    log_every: int = Field(1, gt=0)
    seed: int = 0
    # true / block: keep only each block's input, recompute the block in backward; selective: also keep attention's output
    gradient_checkpointing: Literal[False, True, "block", "selective"] = False
    offload_activations: bool = False  # CUDA: what backward keeps waits in pinned host memory (no-op on CPU)
    compile: bool = False
    # several processes (torchrun): ddp replicates the frozen base, fsdp shards it; auto: ddp
    distributed: Literal["auto", "ddp", "fsdp"] = "auto"
    collective_timeout_s: float = Field(600.0, gt=0)  # a rank that waits longer on the others raises
    precision: Literal[PRECISIONS] = "auto"  # auto: bf16-mixed on a GPU with bf16, a CPU with AVX512_BF16 / AMX
    objective: Literal["sft", "dpo", "orpo"] = "sft"  # dpo / orpo: preference pairs (data.format preference)
    dpo: DPOSettings = DPOSettings()
    orpo: ORPOSettings = ORPOSettings()

    @model_validator(mode="after")
    def _one_length(self):
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set train.max_steps or train.epochs")
        return self


class OutputSection(Settings):
    dir: str = "runs/smollm2-chat"
    push_to_hub: str | None = None  # USER/NAME: push the final adapter at the end of a successful run


class Recipe(Settings):
    model: ModelSection = ModelSection()
    lora: LoraSettings = LoraSettings()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    output: OutputSection = OutputSection()

    @model_validator(mode="after")
    def _objective_fits_data(self):
        preference = self.train.objective != "sft"
        if preference and self.data.format not in ("preference", "auto"):
            raise ValueError(f"train.objective {self.train.objective} needs data.format preference "
                             f"(prompt, chosen, rejected), not {self.data.format}")
        if not preference and self.data.format == "preference":
            raise ValueError("data.format preference needs train.objective dpo or orpo")
        if preference and self.data.packing:
            raise ValueError(f"data.packing is not supported with train.objective {self.train.objective}: "
                             "a pair's chosen and rejected answers each need a row of their own")
        return self


def _describe(err: ValidationError, model: type[BaseModel]) -> str:
    """One line naming the key path; for an unknown key, the closest valid name."""
    e = err.errors()[0]
    path = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        cls = model
        for p in e["loc"][:-1]:
            cls = cls.model_fields[p].annotation
        near = difflib.get_close_matches(str(e["loc"][-1]), list(cls.model_fields), n=1)
        hint = f" (did you mean {'.'.join([*map(str, e['loc'][:-1]), near[0]])!r}?)" if near else ""
        return f"unknown recipe key {path!r}{hint}"
    if e["type"] == "value_error":  # a rule across keys: its message names them
        return "recipe: " + e["msg"].removeprefix("Value error, ")
    return f"recipe key {path!r}: {e['msg']} (got {e.get('input')!r})"


def _set_path(tree: dict, path: str, value: Any) -> None:
    keys = path.split(".")
    for k in keys[:-1]:
        node = tree.setdefault(k, {})
        if not isinstance(node, dict):
            raise UserError(f"override {path!r}: {k!r} is not a section")
        tree = node
    tree[keys[-1]] = value


def load_recipe(path: str | None, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe, apply `key.path=value` overrides (values parsed as YAML), validate."""
    tree: dict = {}
    if path is not None:
        try:
            with open(path) as f:
                tree = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise UserError(f"recipe file not found: {path}") from None
        except yaml.YAMLError as e:
            raise UserError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(tree, dict):
            raise UserError(f"recipe {path} must be a mapping of sections (model, lora, data, train, output)")
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} must look like key.path=value")
        key, value = item.split("=", 1)
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise UserError(f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None
        _set_path(tree, key.strip(), parsed)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        raise UserError(_describe(e, Recipe)) from None


def lora_settings(**kwargs) -> LoraSettings:
    """Build LoraSettings, turning validation errors into one-line UserErrors."""
    try:
        return LoraSettings(**kwargs)
    except ValidationError as e:
        raise UserError(_describe(e, LoraSettings).replace("recipe key", "LoRA setting")) from None
