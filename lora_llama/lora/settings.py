"""`LoraSettings`: which linears get y = W0·x + scale·B·A·x, their rank, scale and start; built from user input
with one-line errors."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from lora_llama.errors import UserError
from lora_llama.lora.init import check_init, moves_w0
from lora_llama.model.config import LINEARS
from lora_llama.validation import Settings, describe


def lora_scale(r: int, alpha: float, rslora: bool = False) -> float:
    """alpha/r, or alpha/sqrt(r) with rsLoRA (Kalajdzievski 2023): the factor on B·A."""
    return alpha / (r**0.5 if rslora else r)


Target = Literal[(*LINEARS, "experts")]  # the linears users may adapt, by short name, and a mixture's experts


class LoraSettings(Settings):
    """The adapters: which linears get y = W0·x + scale·B·A·x, and their rank and scale."""

    r: int = Field(8, gt=0, description="rank of A (r x in) and B (out x r)")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is (alpha / r)·B·A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input, in training only")
    targets: list[Target] = Field(
        ["q", "k", "v", "o"],
        description="linears to adapt: q, k, v, o, gate, up, down, lm_head; experts: a mixture's experts "
        "(gate_up and down of each, written as peft's target_parameters)",
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

    modules_to_save: list[Literal["embed_tokens", "lm_head"]] | None = Field(
        None,
        description="embed_tokens and / or lm_head trained whole beside the adapters and saved in the adapter "
        "(peft's modules_to_save): new chat tokens, an untrained end-of-turn token",
    )
    trainable_token_indices: list[int] | dict[Literal["embed_tokens", "lm_head"], list[int]] | None = Field(
        None,
        description="token ids whose embedding rows are trained (and a tied lm_head's), or {embed_tokens: [...], "
        "lm_head: [...]}: peft's trainable_token_indices, a few rows instead of modules_to_save's whole matrices",
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

    @model_validator(mode="after")
    def _experts_as_peft_adapts_them(self):
        if "experts" in self.targets and (self.dropout or self.use_dora):
            what = "lora.dropout" if self.dropout else "DoRA (lora.use_dora)"
            raise ValueError(f"lora.targets experts does not work with {what}, as in peft")
        return self

    @model_validator(mode="after")
    def _embeddings_trained_once(self):
        rows = self.trainable_rows
        if any(not ids or min(ids) < 0 or len(set(ids)) != len(ids) for ids in rows.values()):
            raise ValueError("lora.trainable_token_indices takes distinct token ids >= 0, at least one")
        both = sorted(set(self.modules_to_save or ()) & set(rows))
        if both:
            raise ValueError(f"{both[0]} is in lora.modules_to_save and lora.trainable_token_indices: pick one")
        if "lm_head" in self.targets and "lm_head" in {*(self.modules_to_save or ()), *rows}:
            raise ValueError("lm_head is in lora.targets and trained whole or by rows too: pick one")
        return self

    @field_validator("modules_to_save")
    @classmethod
    def _once_each(cls, v):
        return list(dict.fromkeys(v)) if v else None

    @field_validator("targets")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("at least one target is needed")
        return list(dict.fromkeys(v))

    @property
    def trainable_rows(self) -> dict[str, list[int]]:
        """trainable_token_indices by module: a plain list is embed_tokens' rows (peft's reading); {} when unset."""
        rows = self.trainable_token_indices
        return {"embed_tokens": rows} if isinstance(rows, list) else dict(rows or {})

    @property
    def scale(self) -> float:
        return lora_scale(self.r, self.alpha, self.rslora)


def lora_settings(**kwargs) -> LoraSettings:
    """Build LoraSettings, turning validation errors into one-line UserErrors."""
    try:
        return LoraSettings(**kwargs)
    except ValidationError as e:
        raise UserError(describe(e, LoraSettings).replace("recipe key", "LoRA setting")) from None
