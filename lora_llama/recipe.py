"""The recipe schema: `LoraSettings` and the five sections of a `Recipe`, validated by pydantic.

Everything a user writes (a recipe, overrides, LoRA settings) is validated here, so a typo
fails before any model is loaded and the one-line error names the key path.
"""
from __future__ import annotations

import difflib
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .config import PRECISIONS, QUANTIZE_KINDS, DType, Target
from .errors import UserError


def lora_scale(r: int, alpha: float, rslora: bool = False) -> float:
    """alpha/r, or alpha/sqrt(r) with rsLoRA (Kalajdzievski 2023): the factor on B·A."""
    return alpha / (r ** 0.5 if rslora else r)



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
