"""`LoraSettings`: which linears get y = W0·x + scale·B·A·x, their rank, scale and start; built from user input
with one-line errors."""

from __future__ import annotations

from pydantic import Field, ValidationError, field_validator, model_validator

from lora_llama.errors import UserError
from lora_llama.lora.init import check_init, moves_w0
from lora_llama.model.config import Target
from lora_llama.settings import Settings, describe


def lora_scale(r: int, alpha: float, rslora: bool = False) -> float:
    """alpha/r, or alpha/sqrt(r) with rsLoRA (Kalajdzievski 2023): the factor on B·A."""
    return alpha / (r**0.5 if rslora else r)


class LoraSettings(Settings):
    """The adapters: which linears get y = W0·x + scale·B·A·x, and their rank and scale."""

    r: int = Field(8, gt=0, description="rank of A (r x in) and B (out x r)")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is (alpha / r)·B·A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input, in training only")
    targets: list[Target] = Field(
        ["q", "k", "v", "o"], description="linears to adapt: q, k, v, o, gate, up, down, lm_head"
    )
    layers: list[int] | None = Field(None, description="decoder layers to adapt (0-based); null: every layer")
    rslora: bool = Field(False, description="rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r")
    use_dora: bool = Field(
        False, description="DoRA: a trained magnitude per output row, the direction W0 + scale·B·A (peft's use_dora)"
    )
    init_lora_weights: bool | str = Field(
        True,
        description="true (Kaiming A, zero B), false, gaussian, pissa, "
        "pissa_niter_N (randomized SVD), olora: peft's names (docs/adapters.md)",
    )

    @field_validator("init_lora_weights")
    @classmethod
    def _known_init(cls, v):
        check_init(v)
        return v

    @model_validator(mode="after")
    def _principal_init_fits(self):
        if moves_w0(self.init_lora_weights) and self.dropout:
            raise ValueError(
                f"lora.init_lora_weights {self.init_lora_weights} moves W0's principal part into A and B, "
                "which lora.dropout would drop in training: set lora.dropout 0"
            )
        if moves_w0(self.init_lora_weights) and self.use_dora:
            raise ValueError(f"lora.init_lora_weights {self.init_lora_weights} with lora.use_dora is not supported")
        return self

    @field_validator("targets")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("at least one target is needed")
        return list(dict.fromkeys(v))

    @property
    def scale(self) -> float:
        return lora_scale(self.r, self.alpha, self.rslora)


def lora_settings(**kwargs) -> LoraSettings:
    """Build LoraSettings, turning validation errors into one-line UserErrors."""
    try:
        return LoraSettings(**kwargs)
    except ValidationError as e:
        raise UserError(describe(e, LoraSettings).replace("recipe key", "LoRA setting")) from None
