"""Credit per turn (train.grpo.credit: turn) for completions over several turns: each of the model's turns is
credited with its return, the weighted rewards from that turn on, against the returns of the same turn of the
other completions in its group (scale_rewards as for whole completions). A reward of a whole completion counts at
its last turn, so every turn's return includes it; a turn's own reward (a function's list, one value a turn)
counts for that turn and those before it, never for the later ones."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lora_llama.objectives.grpo.rewards import group_advantages, mean_std, moments


def turn_returns(table: torch.Tensor, weights: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """(rows, turns) each turn's return from `score_turns`' (rows, functions, turns) table and each completion's
    count of turns; NaN past a completion's last turn, and at every turn of a completion nothing scored."""
    per_turn = (table * weights[None, :, None]).nansum(1)
    returns = per_turn.flip(1).cumsum(1).flip(1)
    past_end = torch.arange(table.shape[2])[None, :] >= turns.clamp(min=1)[:, None]
    unscored = table.isnan().flatten(1).all(1)
    return returns.masked_fill(past_end | unscored[:, None], math.nan)


def set_turn_advantages(rolled: list[dict], ranks, weights: torch.Tensor, settings) -> None:
    """With credit: turn, each batch's advantages (rows, turns) in place of its completions' (rows,): each turn's
    return group-normalised per turn index. Nothing otherwise."""
    if settings.credit != "turn":
        return
    width = max((b["turn_rewards"].shape[2] for b in rolled), default=1)
    returns = [
        turn_returns(
            F.pad(b["turn_rewards"], (0, width - b["turn_rewards"].shape[2]), value=math.nan), weights, b["turns"]
        )
        for b in rolled
    ]
    std = None
    if settings.scale_rewards == "batch":  # over every turn of every completion of the global batch
        everything = torch.cat(returns) if returns else torch.zeros(0)
        std = mean_std(*ranks.sum_named({"returns": moments(everything)})["returns"])[1]
    for b, r in zip(rolled, returns):
        b["advantages"] = group_advantages(r, settings.group_size, settings.scale_rewards, std)


def token_advantages(batch: dict, owner: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each target token's advantage (`keep`: the target positions of the shifted rows, `owner`: their
    completions): its completion's, or with credit per turn its own turn's."""
    advantages = batch["advantages"]
    if advantages.dim() == 1:
        return advantages[owner]
    return advantages[owner, batch["turn"][:, 1:][keep]]
