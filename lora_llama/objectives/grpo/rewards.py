"""Reward functions for GRPO: plain Python in trl's signature, `fn(prompts, completions, **columns) ->
list[float | None]` (None: the reward does not apply to that row), so a trl reward file works unchanged; over
several turns (tools) a row's value may be a list, one per model turn (objectives/grpo/credit.py).

A recipe names each as `path/to/file.py:function`, `package.module:function` or a built-in:
    format          1 when the completion is `<think>...</think><answer>...</answer>` (whitespace around
                    allowed), else 0
    reasoning_gym   the reasoning-gym task's own scorer (0 to 1) on the text of the completion's last
                    `<answer>...</answer>`, or on the whole completion when it has none; needs the `entry`
                    column that `data.source: reasoning-gym:<task>` gives
The prompts and completions are as the data gives them: strings for string prompts; for chat prompts (lists of
messages) each completion is `[{"role": "assistant", "content": text}]` (with tools, all its turns and the tools'
answers). The other keyword arguments are the data's other columns and `completion_ids`, one value per completion
(with an environment, `environments` too).

From the rewards come each completion's advantage against its group and the rollout metrics (score_rollouts).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
from pathlib import Path
from typing import Callable

import torch

from lora_llama.errors import UserError
from lora_llama.labels import target_mask

FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def completion_text(completion) -> str:
    """A completion's text, from a string or from trl's conversational form."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def format_reward(prompts, completions, **_) -> list[float]:
    return [1.0 if FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def extract_answer(text: str) -> str:
    """The last `<answer>...</answer>`'s text, or the whole text when there is none; stripped."""
    found = ANSWER.findall(text)
    return (found[-1] if found else text).strip()


def reasoning_gym_reward(prompts, completions, entry=None, **_) -> list[float]:
    if entry is None:
        raise ValueError("no 'entry' column: use data.source reasoning-gym:<task>")
    import reasoning_gym

    return [
        float(
            reasoning_gym.get_score_answer_fn(e["metadata"]["source_dataset"])(
                answer=extract_answer(completion_text(c)), entry=e
            )
        )
        for c, e in zip(completions, entry)
    ]


BUILTIN: dict[str, Callable] = {"format": format_reward, "reasoning_gym": reasoning_gym_reward}


def load_reward(spec: str) -> tuple[str, Callable]:
    """(name, function) for a recipe's reward entry; the name is the function's (trl's metric names)."""
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    fn = import_named(
        spec, "reward", f"path/to/file.py:function, package.module:function or a built-in ({', '.join(BUILTIN)})"
    )
    if not callable(fn):
        raise UserError(f"reward {spec!r}: {spec.rpartition(':')[0]} has no function {spec.rpartition(':')[2]!r}")
    return getattr(fn, "__name__", spec.rpartition(":")[2]), fn


def import_named(spec: str, what: str, forms: str = "path/to/file.py:name or package.module:name"):
    """What `path/to/file.py:name` or `package.module:name` names (None when the module has no such name); a file
    that does not import, or a module that cannot be found, is one line naming the recipe's `what`."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UserError(f"{what} {spec!r}: use {forms}")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserError(f"{what} {spec!r}: no such file {path}")
        module_spec = importlib.util.spec_from_file_location(f"lora_llama_{what}_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise UserError(f"{what} {spec!r}: importing {path} raised {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise UserError(f"{what} {spec!r}: cannot import {where} ({type(e).__name__}: {e})") from None
    return getattr(module, name, None)


def _checked(name: str, values, prompts: list, n: int, turns: list[int]) -> list[list[float]]:
    """Each completion's rewards by turn (NaN: none): a number (None and NaN: NaN) at its last turn, a list of them
    at its first turns; or one line naming the function and the first bad row."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(f"reward {name} returned {got} for {n} completions (it must return one number or None each)")
    out = []
    for i, v in enumerate(values):
        by_turn = [math.nan] * turns[i]
        if isinstance(v, (list, tuple)):  # one reward per turn, in order
            if len(v) > turns[i]:
                raise UserError(
                    f"reward {name} returned {len(v)} values for row {i} (prompt {_short(prompts[i])}), which has "
                    f"{turns[i]} turns (a list scores the model's turns in order, at most one value each)"
                )
            by_turn[: len(v)] = [_number(name, x, prompts, i) for x in v]
        else:
            by_turn[-1] = _number(name, v, prompts, i)
        out.append(by_turn)
    return out


def _number(name: str, v, prompts: list, i: int) -> float:
    if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
        raise UserError(
            f"reward {name} returned {v!r} ({type(v).__name__}) for row {i} "
            f"(prompt {_short(prompts[i])}): not a number or None"
        )
    return math.nan if v is None else float(v)


def _short(prompt) -> str:
    text = prompt if isinstance(prompt, str) else completion_text(prompt)
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


def _first_failing_row(fn, prompts, completions, columns) -> int | None:
    for i in range(len(completions)):
        try:
            fn(
                prompts=prompts[i : i + 1],
                completions=completions[i : i + 1],
                **{k: v[i : i + 1] for k, v in columns.items()},
            )
        except Exception:
            return i
    return None


def score(rewards: dict[str, Callable], prompts: list, completions: list, columns: dict[str, list]) -> torch.Tensor:
    """(rows, functions) float32 rewards of whole completions, NaN where a function returned None."""
    return by_completion(score_turns(rewards, prompts, completions, columns))


def score_turns(
    rewards: dict[str, Callable], prompts: list, completions: list, columns: dict[str, list], turns=None
) -> torch.Tensor:
    """(rows, functions, turns) float32 rewards by the model's turns (`turns`: each completion's count, None: one
    each): a function's number for a completion at its last turn, a list of numbers at its first turns, NaN where
    it scored nothing. A function that raises or returns something else stops the run with one line naming it and
    the row."""
    n, table = len(completions), []
    turns = [max(int(t), 1) for t in turns] if turns is not None else [1] * n
    width = max(turns, default=1)
    for name, fn in rewards.items():
        try:
            values = fn(prompts=prompts, completions=completions, **columns)
        except Exception as e:
            row = _first_failing_row(fn, prompts, completions, columns)
            where = f" on row {row} (prompt {_short(prompts[row])})" if row is not None else ""
            raise UserError(f"reward {name} raised {type(e).__name__}: {e}{where}") from None
        table.append([t + [math.nan] * (width - len(t)) for t in _checked(name, values, prompts, n, turns)])
    return torch.tensor(table, dtype=torch.float32).permute(1, 0, 2).reshape(n, len(rewards), width)


def by_completion(table: torch.Tensor) -> torch.Tensor:
    """(rows, functions) from `score_turns`' (rows, functions, turns): each function's turns summed, NaN where it
    scored none of them."""
    return table.nansum(2).masked_fill(table.isnan().all(2), torch.nan)


def moments(x: torch.Tensor) -> list[float]:
    """[sum, sum of squares, count] of the non-NaN values: what ranks add up for a mean and a std."""
    kept = x[~x.isnan()].double()
    return [float(kept.sum()), float((kept**2).sum()), kept.numel()]


def mean_std(s: float, s2: float, n: float) -> tuple[float, float]:
    """The mean and the standard deviation (Bessel's) from `moments` added up over ranks."""
    mean = s / n if n else math.nan
    return mean, math.sqrt(max(s2 - s * s / n, 0.0) / (n - 1)) if n > 1 else math.nan


def reward_moments(table: torch.Tensor, total: torch.Tensor, names) -> dict[str, list[float]]:
    """The moments of the weighted reward `total` ("reward") and of each function's column of `table` (by its
    name), to sum over ranks."""
    per_function = {f"rewards/{name}": moments(table[:, j]) for j, name in enumerate(names)}
    return {"reward": moments(total), **per_function}


def reward_means(sums: dict[str, list[float]], names) -> dict:
    """trl's reward metrics from summed `reward_moments`: the weighted reward's mean, each function's mean."""
    return {
        "reward": mean_std(*sums["reward"])[0],
        **{f"rewards/{n}/mean": mean_std(*sums[f"rewards/{n}"])[0] for n in names},
    }


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
    (unscorable) stay out of the means and standard deviations and get advantage 0. Rewards (rows, turns) are
    normalised within each turn's column of the group."""
    grouped = rewards.view(-1, group_size, *rewards.shape[1:])
    advantages = grouped - grouped.nanmean(1, keepdim=True)
    if scale == "group":
        advantages = advantages / (nanstd(grouped, 1).unsqueeze(1) + 1e-4)
    elif scale == "batch":
        advantages = advantages / ((nanstd(rewards) if batch_std is None else batch_std) + 1e-4)
    return advantages.reshape(rewards.shape).nan_to_num(0.0)


def score_rollouts(rolled: list[dict], ranks, weights, names: list[str], settings) -> tuple[int, dict]:
    """Sets each batch's advantages per completion (objectives/grpo/credit.py sets them per turn); returns the
    completion tokens of the global batch and the rollout metrics over it (every rank's groups)."""
    table = torch.cat([b["rewards"] for b in rolled]) if rolled else torch.zeros(0, len(names))
    total, g = weighted_rewards(table, weights), settings.group_size
    zero_std = torch.isclose(nanstd(total.view(-1, g), 1), torch.zeros(())).sum() * g if rolled else 0
    lengths, truncated = (
        torch.cat([b[k] for b in rolled]) if rolled else torch.zeros(0) for k in ("lengths", "truncated")
    )
    counts = [total.numel(), float(zero_std), float(lengths.sum()), float(truncated.sum())]
    tokens = [sum(int(target_mask(b["labels"], b.get("segment_ids")).sum()) for b in rolled)]
    tools = (
        [float(v) for v in torch.cat([b["tools"] for b in rolled]).sum(0)] if rolled and "tools" in rolled[0] else []
    )
    named = {**reward_moments(table, total, names), "counts": counts, "tokens": tokens}
    sums = ranks.sum_named({**named, "tools": tools} if settings.tools or settings.environment else named)
    mean, std = mean_std(*sums["reward"])
    completions, zero_std_sum, length_sum, truncated_sum = sums["counts"]
    n = max(completions, 1)
    start = 0
    for b in rolled:
        rows = b["rewards"].shape[0]
        b["advantages"] = group_advantages(total[start : start + rows], g, settings.scale_rewards, std)
        start += rows
    per_function = {name: mean_std(*sums[f"rewards/{name}"]) for name in names}
    zero = (std < 1e-8) if settings.scale_rewards == "batch" else zero_std_sum / n
    tool_stats = {}
    if "tools" in sums:  # trl's tools/ metrics, and the model's turns per completion
        calls, failures, turns = sums["tools"] or [0.0, 0.0, 0.0]
        tool_stats = {
            "tools/call_frequency": calls / n,
            "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/turns": turns / n,
        }
    return int(sums["tokens"][0]), {
        **tool_stats,
        "reward": mean,
        "reward_std": std,
        "frac_reward_zero_std": float(zero),
        **{f"rewards/{name}/mean": m for name, (m, _) in per_function.items()},
        **{f"rewards/{name}/std": sd for name, (_, sd) in per_function.items()},
        "completions/mean_length": length_sum / n,
        "completions/clipped_ratio": truncated_sum / n,
    }
