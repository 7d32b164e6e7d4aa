"""GRPO (group relative policy optimisation) on the adapter, with trl's GRPOTrainer's settings and maths.

A step: each prompt of the global batch gets group_size completions sampled from the model as it stands
(adapters active, KV cache, compute precision; objectives/grpo/rollout.py); the reward functions score them
(objectives/grpo/rewards.py);
each completion's advantage is its reward less its group's mean, over the group's standard deviation + 1e-4
(scale_rewards group; batch: the whole batch's; none: not divided). The loss per completion token is

    -min(ρ·A, clip(ρ, 1 - epsilon, 1 + epsilon_high)·A) + beta·ρ·KL,   ρ = exp(logπθ - logπold)

with πold the policy that sampled (the detached policy itself when num_iterations is 1), and KL trl's k3
estimate exp(ref - logπθ) - (ref - logπθ) - 1 against the base with the adapter switched off (no second
model; skipped at beta 0); ρ on the KL (use_bias_correction_kl, trl's default) makes its gradient the
unbiased reverse-KL one. Log-probabilities come from logits / temperature, a chunk of tokens at a time.
The loss types normalise as trl's do: dapo by the completion tokens of the global batch, bnpo by each
micro-batch's, grpo per completion then over completions, dr_grpo by completions x max_new_tokens.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

from lora_llama.data.prompts import build_prompts
from lora_llama.errors import UserError
from lora_llama.labels import target_mask
from lora_llama.lora.adapted import adapters_disabled
from lora_llama.objectives.base import Objective
from lora_llama.objectives.grpo.credit import set_turn_advantages, token_advantages
from lora_llama.objectives.grpo.losses import (
    CLIP_STATS,
    gamma_weights,
    high_entropy,
    log_importance_weights,
    per_token_loss,
    reduce_loss,
)
from lora_llama.objectives.grpo.rewards import (
    by_completion,
    reward_means,
    reward_moments,
    score_rollouts,
    weighted_rewards,
)
from lora_llama.objectives.grpo.rollout import Rollouts
from lora_llama.objectives.grpo.tools import listed_tools
from lora_llama.objectives.reporting import Measure, Reporting
from lora_llama.objectives.token_losses import token_logps
from lora_llama.runtime.distributed import sharded
from lora_llama.validation import Settings

# what a rollout batch keeps on the model's device (the rest, rewards and lengths, stays on the CPU)
ON_DEVICE = ("input_ids", "labels", "advantages", "completion", "turn", "position_ids", "segment_ids", "old_logps")


class GRPOSettings(Settings):
    """Group relative policy optimisation on prompts, scored by reward functions (trl's names and meanings)."""

    group_size: int = Field(8, ge=2, description="completions sampled per prompt (trl's num_generations)")
    max_new_tokens: int = Field(64, gt=0, description="most tokens a completion gets (trl's max_completion_length)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature; log-probabilities use the same")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens with this mass")
    beta: float = Field(0.0, ge=0, description="weight of the KL to the base (adapter off); 0: no reference pass")
    use_bias_correction_kl: bool = Field(
        True, description="multiply the KL term by the ratio: the unbiased reverse-KL gradient (trl's default)"
    )
    epsilon: float = Field(0.2, gt=0, description="clip the ratio below at 1 - epsilon (and above, by default)")
    epsilon_high: float | None = Field(None, gt=0, description="clip above at 1 + epsilon_high (DAPO); null: epsilon")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo",
        description="trl's: the clipped surrogate normalised by the completion tokens of the global batch (dapo), of "
        "the micro-batch (bnpo), per completion (grpo), by completions x max_new_tokens (dr_grpo), or summed per "
        "completion (luspo, with importance_sampling_level sequence); cispo: the clipped ratio as a detached weight "
        "of the log-probability (MiniMax-M1), normalised as dapo; sapo: a soft, sigmoid gate instead of the clip, "
        "normalised as grpo; vespo: a gamma weight of the completion's ratio on the log-probability, as dapo",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="the ratio per token, or one per completion: the mean of its tokens' log-ratios (GSPO)"
    )
    delta: float | None = Field(
        None, gt=1, description="two-sided clipping: the unclipped ratio capped at delta (trl's; null: off)"
    )
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo's gate temperature where the advantage is > 0")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo's gate temperature elsewhere")
    top_entropy_quantile: float = Field(
        1.0,
        gt=0,
        le=1,
        description="train on this share of completion tokens, those of highest entropy (the rest take no policy "
        "loss; 1: all)",
    )
    vespo_k_pos: float = Field(2.0, description="vespo's gamma shape k where the advantage is >= 0")
    vespo_lambda_pos: float = Field(3.0, description="vespo's gamma rate λ where the advantage is >= 0")
    vespo_k_neg: float = Field(3.0, description="vespo's gamma shape k elsewhere")
    vespo_lambda_neg: float = Field(2.0, description="vespo's gamma rate λ elsewhere")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the group's reward std, the batch's, or not at all"
    )
    credit: Literal["trajectory", "turn"] = Field(
        "trajectory",
        description="with tools: one advantage per completion, from its whole reward (trl's), or one per model "
        "turn, from the rewards of that turn on, normalised against the same turn of the group's completions",
    )
    num_iterations: int = Field(1, gt=0, description="optimiser steps on each generation (trl's mu)")
    mask_truncated: bool = Field(False, description="completions that hit max_new_tokens take no loss")
    rewards: list[str] = Field(
        ["reasoning_gym"],
        description="reward functions: path/to/file.py:function, package.module:function, or a built-in (format, "
        "reasoning_gym: reasoning-gym data's own scorer); none by default when an environment scores",
    )
    reward_weights: list[float] | None = Field(None, description="one weight per reward; null: all 1")
    tools: list[str] = Field(
        [],
        description="tool functions the model may call (path/to/file.py:function, typed and documented): each "
        "completion runs over several turns, the calls answered between them",
    )
    environment: str | None = Field(
        None,
        description="path/to/file.py:Class (trl's environment_factory): one per completion; reset(**row) "
        "starts it, its public methods are tools, get_reward() an extra reward",
    )
    max_tool_calling_iterations: int | None = Field(
        None, gt=0, description="rounds of tool calls answered per completion at most; null: until it stops calling"
    )
    tool_timeout_s: float = Field(30.0, gt=0, description="a tool call running longer is answered 'timed out'")

    @model_validator(mode="after")
    def _weights_fit(self):
        if self.environment and "rewards" not in self.model_fields_set:  # the environment scores (its get_reward)
            self.__dict__["rewards"] = []
        if self.credit == "turn" and not (self.tools or self.environment):
            raise ValueError(
                "train.grpo.credit turn needs tools or an environment: without them a completion is one turn"
            )
        if not self.rewards and not self.environment:
            raise ValueError("train.grpo.rewards needs at least one reward function")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(
                f"train.grpo.reward_weights has {len(self.reward_weights)} values for {len(self.rewards)} rewards"
            )
        return self


REPORTING = Reporting(
    (Measure("eval_reward", "held-out reward", higher_is_better=True),),
    "greedy completions of held-out prompts",
    curves=("reward",),
    loss_unit="",  # as train.grpo.loss_type normalises it
)


def prompt_room(max_seq_len: int, max_new_tokens: int) -> int:
    """The tokens a prompt may take: a row's, less the completion's."""
    if max_seq_len - max_new_tokens < 1:
        raise UserError(
            f"data.max_seq_len ({max_seq_len}) leaves no room for a prompt before "
            f"train.grpo.max_new_tokens ({max_new_tokens}) completion tokens"
        )
    return max_seq_len - max_new_tokens


def check_rewards_fit(settings, prompts: list[dict]) -> None:
    """The built-in reasoning_gym reward (the default) scores reasoning-gym data only: one line on other data."""
    if "reasoning_gym" in settings.rewards and prompts and "entry" not in prompts[0]["columns"]:
        raise UserError(
            "train.grpo.rewards: reasoning_gym scores reasoning-gym data (its 'entry' column), which this "
            "data.source has not: set train.grpo.rewards to reward functions of your own (path/to/file.py:function)"
        )


class GRPO(Objective):
    """The objective of train.objective grpo: its batches are rollouts it samples (`prepare`), its eval the reward
    of greedy completions of held-out prompts."""

    name, about, settings = "grpo", "GRPO on prompts with reward functions", GRPOSettings
    data_formats = {"prompt": "a prompt and any columns the rewards read"}
    packs, empty, n_counts = True, None, 1
    reporting = REPORTING
    cached = False  # prompts carry the data's own columns, of any type; reading them is quick

    def __init__(
        self,
        settings,
        tokenizer,
        eos_ids: list[int],
        seed: int,
        packing: bool = False,
        max_seq_len: int = 0,
        system_prompt: str | None = None,
    ):
        self.settings = settings  # this run's train.grpo (the class's `settings` is its schema)
        self.rollouts = Rollouts(settings, tokenizer, eos_ids, seed, packing, max_seq_len, system_prompt)
        self.reward_names = list(self.rollouts.reward_functions)
        # null reward_weights: 1 each, an environment's get_reward (joining the rewards) too, as trl's
        self.reward_weights = torch.tensor(settings.reward_weights or [1.0] * len(self.reward_names))
        self.repeats = settings.num_iterations  # optimiser steps per generation (trl's μ)
        self.stat_names = CLIP_STATS + (("kl",) if settings.beta else ())
        self.kept: tuple[int, list[dict]] | None = None  # (generation, its rollouts), for num_iterations > 1
        self.rollout_stats: dict = {}
        self.completion_tokens = 0  # of the generation's global batch: the clip and KL metrics' divisor

    @classmethod
    def build(cls, recipe, tokenizer, eos_ids: list[int]) -> GRPO:
        data = recipe.data
        return cls(
            recipe.train.grpo,
            tokenizer,
            list(eos_ids),
            recipe.train.seed,
            data.packing,
            data.max_seq_len,
            data.system_prompt,
        )

    @classmethod
    def examples(cls, recipe, tokenizer, log) -> tuple[list[dict], list[dict]]:
        room = prompt_room(recipe.data.max_seq_len, recipe.train.grpo.max_new_tokens)
        schemas = listed_tools(recipe.train.grpo, tokenizer)
        train, val = build_prompts(recipe.data, tokenizer, recipe.train.seed, room, log, schemas)
        check_rewards_fit(recipe.train.grpo, train)
        return train, val

    def collate(self, prompts: list[dict], pad_id: int) -> dict:
        return {"prompts": prompts}

    def length(self, prompt: dict) -> int:
        return len(prompt["prompt_ids"])

    def counts(self, batch: dict) -> list[int]:
        if self.settings.loss_type in ("dapo", "cispo", "vespo"):
            return [int(_targets(batch).sum())]
        return [1 if self.settings.loss_type == "bnpo" else int(batch["completions"])]

    def prepare(self, model, batches: list[dict], step: int, ranks) -> list[dict]:
        """The step's rollouts with their advantages (computed once per num_iterations steps and kept)."""
        generation = step // self.repeats
        if self.kept is not None and self.kept[0] == generation:
            return self.kept[1]
        self.rollouts.any_rank = ranks.any if sharded(model) else None
        self.rollouts.row_length = self.row_length
        device = next(model.parameters()).device
        rolled = [self.rollouts.batch(model, b["prompts"], generation) for b in batches]
        scored = score_rollouts(rolled, ranks, self.reward_weights, self.reward_names, self.settings)
        self.completion_tokens, self.rollout_stats = scored
        set_turn_advantages(rolled, ranks, self.reward_weights, self.settings)  # with credit: turn
        for b in rolled:
            for k in ON_DEVICE:
                if k in b:
                    b[k] = b[k].to(device)
            if self.repeats > 1:  # the policy that sampled, for the ratio of the later iterations
                with torch.no_grad():
                    b["old_logps"] = self._logps(model, b)[0].detach()
        self.kept = (generation, rolled)
        return rolled

    def _logps(self, model, batch: dict, with_entropy: bool = False) -> tuple:
        places = (batch.get("position_ids"), batch.get("segment_ids"))
        return token_logps(model, batch["input_ids"], batch["labels"], self.settings.temperature, *places, with_entropy)

    def terms(self, model, batch: dict) -> tuple[list[torch.Tensor], dict]:
        s = self.settings
        selects = s.top_entropy_quantile < 1  # only the tokens of highest entropy take the policy loss
        logps, keep, *token_entropies = self._logps(model, batch, selects)
        owner = batch["completion"][:, 1:][keep]  # the completion of each target token
        advantages = token_advantages(batch, owner, keep)
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        ref = None
        if s.beta:
            with torch.no_grad(), adapters_disabled(model):
                ref = self._logps(model, batch)[0]
        rows = int(batch["completions"])
        log_weights = log_importance_weights(logps, old, owner, rows, s.importance_sampling_level)
        gamma = gamma_weights(s, logps, old, advantages, owner, rows) if s.loss_type == "vespo" else None
        selected = high_entropy(token_entropies[0], s.top_entropy_quantile) if selects else None
        loss, stats = per_token_loss(s, logps, log_weights, advantages, ref, gamma, selected)
        return [reduce_loss(loss, owner, rows, s.loss_type, s.max_new_tokens)], stats

    def summarize(self, stat_sums: dict, totals: list[int], ranks) -> dict:
        """Token means of the clip and KL sums, with the rollout metrics."""
        return {**self.rollout_stats, **{k: v / max(self.completion_tokens, 1) for k, v in stat_sums.items()}}

    def evaluate(self, model, prompts: list[dict], batch_size: int, pad_id: int, ranks) -> dict:
        """The mean weighted reward of greedy completions of held-out prompts, each function's mean and, with tools,
        the share that call one; as many prompts decode together as a training step samples completions."""
        mine, rows_per_batch = prompts[ranks.rank :: ranks.world], batch_size * self.settings.group_size
        self.rollouts.any_rank = ranks.any if sharded(model) else None
        # under fsdp every rank decodes as many batches as the one with most (a spare one is thrown away)
        count = math.ceil(len(prompts) / ranks.world) if self.rollouts.any_rank else len(mine)
        tables, calling = [], [0.0, 0.0]
        for i in range(0, count, rows_per_batch):
            batch = mine[i : i + rows_per_batch]
            sampled = self.rollouts.complete(model, batch or prompts[:1], None)
            if batch:
                tables.append(by_completion(self.rollouts.rewards(sampled)))
                calling = [calling[0] + sum(n > 0 for n in sampled.calls), calling[1] + len(sampled.ids)]
        table = torch.cat(tables) if tables else torch.zeros(0, len(self.reward_names))
        total = weighted_rewards(table, self.reward_weights)
        sums = ranks.sum_named({**reward_moments(table, total, self.reward_names), "calling": calling})
        shown = reward_means(sums, self.reward_names)
        if self.rollouts.episodes is not None:
            shown["tools/calling"] = sums["calling"][0] / max(sums["calling"][1], 1)
        return shown

    def state(self) -> dict | None:
        """The kept rollouts (num_iterations > 1), so that a resume between generations continues exactly."""
        if self.kept is None or self.repeats == 1:
            return None
        generation, batches = self.kept
        return {
            "generation": generation,
            "batches": batches,
            "stats": self.rollout_stats,
            "tokens": self.completion_tokens,
        }

    def load_state(self, state: dict | None, device) -> None:
        if state:
            self.rollout_stats, self.completion_tokens = state["stats"], state["tokens"]
            batches = [{k: v.to(device) if k in ON_DEVICE else v for k, v in b.items()} for b in state["batches"]]
            self.kept = (state["generation"], batches)


def _targets(batch: dict) -> torch.Tensor:
    return target_mask(batch["labels"], batch.get("segment_ids"))
