"""GRPO (group relative policy optimisation) on the adapter, with trl's GRPOTrainer's settings and maths.

A step: each prompt of the global batch gets group_size completions sampled from the model as it stands
(adapters active, KV cache, compute precision; rollout.py); the reward functions score them (rewards.py);
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

import torch

from lora_llama.data.sft import collate, pack
from lora_llama.kernels.cross_entropy import IGNORE_INDEX, target_mask, token_logps
from lora_llama.lora.layer import adapters_disabled
from lora_llama.runtime.distributed import sharded
from lora_llama.training.rewards import load_reward, score
from lora_llama.training.rollout import sample_completions

# what a rollout batch keeps on the model's device (the rest, rewards and lengths, stays on the CPU)
ON_DEVICE = ("input_ids", "labels", "advantages", "completion", "position_ids", "segment_ids", "old_logps")
CLIP_STATS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation over the non-NaN values, with Bessel's correction (NaN for fewer than two), as trl's."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    count = (~x.isnan()).sum(dim)
    var = ((x - x.nanmean(dim, keepdim=True)) ** 2).nanmean(dim)
    return torch.where(count > 1, var * count / (count - 1), torch.nan).sqrt()


def weighted_rewards(table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(rows,) the weighted sum of each row's rewards (rows, functions), NaN where every function returned None."""
    total = (table * weights).nansum(1)
    return total.masked_fill(table.isnan().all(1), torch.nan)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str, batch_std: float | None = None
) -> torch.Tensor:
    """(rewards - group mean) / (std + 1e-4), the std of the group, of the batch, or none; NaN rewards
    (unscorable) stay out of the means and standard deviations and get advantage 0."""
    grouped = rewards.view(-1, group_size)
    advantages = rewards - grouped.nanmean(1).repeat_interleave(group_size)
    if scale == "group":
        advantages = advantages / (nanstd(grouped, 1).repeat_interleave(group_size) + 1e-4)
    elif scale == "batch":
        advantages = advantages / ((nanstd(rewards) if batch_std is None else batch_std) + 1e-4)
    return advantages.nan_to_num(0.0)


def _moments(x: torch.Tensor) -> list[float]:
    """[sum, sum of squares, count] of the non-NaN values: what ranks add up for a mean and a std."""
    kept = x[~x.isnan()].double()
    return [float(kept.sum()), float((kept**2).sum()), kept.numel()]


def _mean_std(s: float, s2: float, n: float) -> tuple[float, float]:
    mean = s / n if n else math.nan
    return mean, math.sqrt(max(s2 - s * s / n, 0.0) / (n - 1)) if n > 1 else math.nan


def per_token_loss(
    logps,
    old_logps,
    advantages,
    epsilon: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps=None,
    bias_correction: bool = True,
) -> tuple[torch.Tensor, dict]:
    """The clipped surrogate (+ beta·KL, times the ratio with bias_correction) per completion token (N,), and the
    tokens clipped below, above, either and the KL (trl's metrics), as sums over tokens."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    stats = dict(zip(CLIP_STATS, (float(low.sum()), float(high.sum()), float((low | high).sum()))))
    if beta:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        kl = kl * ratio if bias_correction else kl  # the unbiased reverse-KL gradient (trl's default)
        loss = loss + beta * kl
        stats["kl"] = float(kl.detach().sum())
    return loss, stats


def reduce_loss(
    loss: torch.Tensor, rows: torch.Tensor, n_rows: int, loss_type: str, max_new_tokens: int
) -> torch.Tensor:
    """A micro-batch's loss term before the division by its global count (see GRPO.counts)."""
    if loss_type == "grpo":  # per completion: the mean over its tokens
        per_row = loss.new_zeros(n_rows).index_add(0, rows, loss)
        tokens = loss.new_zeros(n_rows).index_add(0, rows, torch.ones_like(loss))
        return (per_row / tokens.clamp(min=1)).sum()
    if loss_type == "bnpo":
        return loss.sum() / max(loss.numel(), 1)
    if loss_type == "dr_grpo":
        return loss.sum() / max_new_tokens
    return loss.sum()  # dapo


def _seed(seed: int, generation: int, index: int, sample: int) -> int:
    """One sampling seed per completion: its prompt, its place in the group, the generation step."""
    return ((seed * 1_000_003 + generation) * 1_000_033 + index) * 1_009 + sample


class GRPO:
    """The objective the trainer runs for train.objective grpo (the interface of objectives.Objective)."""

    name, n_counts = "grpo", 1

    def __init__(self, settings, tokenizer, eos_ids: list[int], seed: int, packing: bool = False, max_seq_len: int = 0):
        self.s, self.tok, self.eos, self.seed = settings, tokenizer, list(eos_ids), seed
        self.packing, self.max_seq_len = packing, max_seq_len  # data.packing: completions packed into rows
        self.rewards = dict(load_reward(spec) for spec in settings.rewards)
        self.weights = torch.tensor(settings.reward_weights or [1.0] * len(self.rewards))
        self.repeats = settings.num_iterations  # optimiser steps per generation (trl's μ)
        self.stat_names = CLIP_STATS + (("kl",) if settings.beta else ())
        self.cache: tuple[int, list[dict]] | None = None
        self.rollout_stats: dict = {}
        self.tokens = 0  # completion tokens of the generation's global batch: the clip and KL metrics' divisor
        self.any_rank = None  # under fsdp: Ranks.any, so that every rank decodes as many steps

    # ------------------------------------------------------------------ batches

    def collate(self, prompts: list[dict], pad_id: int) -> dict:
        return {"prompts": prompts}

    def length(self, prompt: dict) -> int:
        return len(prompt["prompt_ids"])

    def counts(self, batch: dict) -> list[int]:
        if self.s.loss_type == "dapo":
            return [int(self._targets(batch).sum())]
        return [1 if self.s.loss_type == "bnpo" else int(batch["completions"])]

    def complete(self, model, prompts: list[dict], generation: int | None) -> tuple[list[list[int]], list[dict]]:
        """group_size sampled completions per prompt (greedy, one each, when generation is None: eval)."""
        group = 1 if generation is None else self.s.group_size
        rows = [p for p in prompts for _ in range(group)]
        seeds = (
            None
            if generation is None
            else [_seed(self.seed, generation, p["index"], j) for p in prompts for j in range(group)]
        )
        completions = sample_completions(
            model,
            [r["prompt_ids"] for r in rows],
            self.s.max_new_tokens,
            self.eos,
            self.tok.pad_token_id,
            0.0 if generation is None else self.s.temperature,
            self.s.top_p,
            seeds,
            group,
            self.any_rank,
        )
        return completions, rows

    def rewards_of(self, rows: list[dict], completions: list[list[int]]) -> torch.Tensor:
        """(rows, functions) rewards; completions reach the functions in the form of their prompt."""
        texts = self.tok.batch_decode(completions, skip_special_tokens=True)
        prompts = [r["prompt"] for r in rows]
        shaped = [t if isinstance(p, str) else [{"role": "assistant", "content": t}] for t, p in zip(texts, prompts)]
        columns = {k: [r["columns"][k] for r in rows] for k in rows[0]["columns"]} if rows else {}
        return score(self.rewards, prompts, shaped, {**columns, "completion_ids": completions})

    def rollout(self, model, prompts: list[dict], generation: int) -> dict:
        """One micro-batch's completions as training rows (prompt + completion; the completion's tokens are the
        targets, none of a truncated one with mask_truncated), with their rewards."""
        completions, rows = self.complete(model, prompts, generation)
        truncated = [len(c) == self.s.max_new_tokens and c[-1] not in self.eos for c in completions]
        examples = []
        for row, c, cut in zip(rows, completions, truncated):
            masked = cut and self.s.mask_truncated
            ids = row["prompt_ids"] + c
            examples.append(
                {
                    "input_ids": ids,
                    "labels": [IGNORE_INDEX] * len(row["prompt_ids"]) + ([IGNORE_INDEX] * len(c) if masked else c),
                }
            )
        batch = self._rows(examples)
        batch["rewards"] = self.rewards_of(rows, completions)
        batch["lengths"] = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        batch["truncated"] = torch.tensor(truncated, dtype=torch.float32)
        return batch

    def _rows(self, examples: list[dict]) -> dict:
        """The completions as a batch, one per row or packed (data.packing) several to a row, each attending
        only to itself; `completion` (B, T) says which completion each position belongs to."""
        if not self.packing:
            batch = collate(examples, self.tok.pad_token_id)
            batch["completion"] = torch.arange(len(examples))[:, None].expand_as(batch["input_ids"]).clone()
        else:
            packed = pack(examples, self.max_seq_len)
            batch = collate(packed, self.tok.pad_token_id)
            firsts = torch.tensor([0] + [r["segment_ids"][-1] + 1 for r in packed]).cumsum(0)[:-1]
            batch["completion"] = (firsts[:, None] + batch["segment_ids"]).clamp(0, len(examples) - 1)  # padding: any
        batch["completions"] = torch.tensor(len(examples))
        return batch

    def _logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logps(
            model,
            batch["input_ids"],
            batch["labels"],
            self.s.temperature,
            batch.get("position_ids"),
            batch.get("segment_ids"),
        )

    def _targets(self, batch: dict) -> torch.Tensor:
        return target_mask(batch["labels"], batch.get("segment_ids"))

    # ------------------------------------------------------------------ a step

    def prepare(self, model, batches: list[dict], step: int, ranks) -> list[dict]:
        """The step's rollouts with their advantages (computed once per num_iterations steps and kept)."""
        generation = step // self.repeats
        if self.cache is not None and self.cache[0] == generation:
            return self.cache[1]
        self.any_rank = ranks.any if sharded(model) else None
        device = next(model.parameters()).device
        rolled = [self.rollout(model, b["prompts"], generation) for b in batches]
        self._advantages(rolled, ranks)
        for b in rolled:
            for k in ON_DEVICE:
                if k in b:
                    b[k] = b[k].to(device)
            if self.repeats > 1:  # the policy that sampled, for the ratio of the later iterations
                with torch.no_grad():
                    b["old_logps"] = self._logps(model, b)[0].detach()
        self.cache = (generation, rolled)
        return rolled

    def _advantages(self, rolled: list[dict], ranks) -> None:
        """Advantages per completion, and the rollout metrics over the global batch (every rank's groups)."""
        table = torch.cat([b["rewards"] for b in rolled]) if rolled else torch.zeros(0, len(self.rewards))
        total = weighted_rewards(table, self.weights)
        g = self.s.group_size
        zero_std = torch.isclose(nanstd(total.view(-1, g), 1), torch.zeros(())).sum() * g if rolled else 0
        lengths, truncated = (
            torch.cat([b[k] for b in rolled]) if rolled else torch.zeros(0) for k in ("lengths", "truncated")
        )
        tokens = sum(int(self._targets(b).sum()) for b in rolled)
        sums = ranks.sum(
            [
                *_moments(total),
                total.numel(),
                float(zero_std),
                float(lengths.sum()),
                float(truncated.sum()),
                *[v for j in range(table.shape[1]) for v in _moments(table[:, j])],
                tokens,
            ]
        )
        self.tokens = int(sums[-1])
        mean, std = _mean_std(*sums[:3])
        n = max(sums[3], 1)  # completions in the global batch
        start = 0
        for b in rolled:
            rows = b["rewards"].shape[0]
            b["advantages"] = group_advantages(total[start : start + rows], g, self.s.scale_rewards, std)
            start += rows
        per_fn = [_mean_std(*sums[7 + 3 * j : 10 + 3 * j]) for j in range(table.shape[1])]
        zero = (std < 1e-8) if self.s.scale_rewards == "batch" else sums[4] / n
        self.rollout_stats = {
            "reward": mean,
            "reward_std": std,
            "frac_reward_zero_std": float(zero),
            **{f"rewards/{name}/mean": m for name, (m, _) in zip(self.rewards, per_fn)},
            **{f"rewards/{name}/std": sd for name, (_, sd) in zip(self.rewards, per_fn)},
            "completions/mean_length": sums[5] / n,
            "completions/clipped_ratio": sums[6] / n,
        }

    def terms(self, model, batch: dict) -> tuple[list[torch.Tensor], dict]:
        s = self.s
        logps, keep = self._logps(model, batch)
        owner = batch["completion"][:, 1:][keep]  # the completion of each target token
        advantages = batch["advantages"][owner]
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()
        ref = None
        if s.beta:
            with torch.no_grad(), adapters_disabled(model):
                ref = self._logps(model, batch)[0]
        loss, stats = per_token_loss(
            logps, old, advantages, s.epsilon, s.epsilon_high or s.epsilon, s.beta, ref, s.use_bias_correction_kl
        )
        return [reduce_loss(loss, owner, int(batch["completions"]), s.loss_type, s.max_new_tokens)], stats

    def summarize(self, stat_sums: dict, totals: list[int], ranks) -> dict:
        """Token means of the clip and KL sums, with the rollout metrics."""
        return {**self.rollout_stats, **{k: v / max(self.tokens, 1) for k, v in stat_sums.items()}}

    # ------------------------------------------------------------------ eval and resume

    def evaluate(self, model, prompts: list[dict], batch_size: int, ranks) -> dict:
        """The mean weighted reward of greedy completions of held-out prompts, and each function's mean; as many
        prompts decode together as a training step samples completions."""
        mine, rows_per_batch = prompts[ranks.rank :: ranks.world], batch_size * self.s.group_size
        self.any_rank = ranks.any if sharded(model) else None
        # under fsdp every rank decodes as many batches as the one with most (a spare one is thrown away)
        count = math.ceil(len(prompts) / ranks.world) if self.any_rank else len(mine)
        tables = []
        for i in range(0, count, rows_per_batch):
            batch = mine[i : i + rows_per_batch]
            completions, rows = self.complete(model, batch or prompts[:1], None)
            if batch:
                tables.append(self.rewards_of(rows, completions))
        table = torch.cat(tables) if tables else torch.zeros(0, len(self.rewards))
        sums = ranks.sum(
            [
                *_moments(weighted_rewards(table, self.weights)),
                *[v for j in range(table.shape[1]) for v in _moments(table[:, j])],
            ]
        )
        return {
            "reward": _mean_std(*sums[:3])[0],
            **{
                f"rewards/{name}/mean": _mean_std(*sums[3 + 3 * j : 6 + 3 * j])[0]
                for j, name in enumerate(self.rewards)
            },
        }

    def state(self) -> dict | None:
        """The kept rollouts (num_iterations > 1), so that a resume between generations continues exactly."""
        if self.cache is None or self.repeats == 1:
            return None
        return {
            "generation": self.cache[0],
            "batches": self.cache[1],
            "stats": self.rollout_stats,
            "tokens": self.tokens,
        }

    def load_state(self, state: dict | None, device) -> None:
        if state:
            self.rollout_stats, self.tokens = state["stats"], state["tokens"]
            self.cache = (
                state["generation"],
                [{k: v.to(device) if k in ON_DEVICE else v for k, v in b.items()} for b in state["batches"]],
            )
