"""Direct preference optimisation (trl's `DPOTrainer`, losses sigmoid and ipo) against the base with the adapter
switched off: no second model."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from lora_llama.lora.adapted import adapters_disabled
from lora_llama.objectives.pairs import PairObjective, pair_stats, valid_pairs
from lora_llama.objectives.token_losses import answer_logps
from lora_llama.validation import Settings


class DPOSettings(Settings):
    """Direct preference optimisation; the reference is the base with the adapter switched off."""

    beta: float = Field(0.1, gt=0, description="strength of the pull towards the reference")
    loss: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="sigmoid (DPO) or ipo (IPO's squared loss, per-token average)"
    )


class DPO(PairObjective):
    """sigmoid: -log σ(β·((π_c - ref_c) - (π_r - ref_r))) on summed log-probs (trl's `sigmoid`);
    ipo: ((π_c - ref_c)/n_c - (π_r - ref_r)/n_r - 1/(2β))² on per-token averages (trl's `ipo`)."""

    name, about, settings = "dpo", "DPO on preference pairs", DPOSettings

    def __init__(self, settings: DPOSettings = DPOSettings()):
        self.beta, self.loss = settings.beta, settings.loss

    def terms(self, model, batch: dict) -> tuple[list[torch.Tensor], dict]:
        with torch.no_grad(), adapters_disabled(model):  # the reference: no graph, no gradient buffers
            reference = answer_logps(model, batch)[0]
        policy, n, _ = answer_logps(model, batch)
        valid = valid_pairs(n)
        chosen, rejected = (policy - reference).chunk(2)
        if self.loss == "ipo":
            n_c, n_r = n.clamp(min=1).chunk(2)
            per_pair = (chosen / n_c - rejected / n_r - 1 / (2 * self.beta)) ** 2
        else:
            per_pair = -F.logsigmoid(self.beta * (chosen - rejected))
        stats = pair_stats(self.beta * chosen, self.beta * rejected, *policy.chunk(2), valid)
        return [torch.where(valid, per_pair, 0.0).sum()], stats
