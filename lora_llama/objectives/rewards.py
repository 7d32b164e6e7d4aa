"""Reward functions for GRPO: plain Python in trl's signature, `fn(prompts, completions, **columns) ->
list[float | None]` (None: the reward does not apply to that row), so a trl reward file works unchanged.

A recipe names each as `path/to/file.py:function`, `package.module:function` or a built-in:
    format          1 when the completion is `<think>...</think><answer>...</answer>` (whitespace around
                    allowed), else 0
    reasoning_gym   the reasoning-gym task's own scorer (0 to 1) on the text of the completion's last
                    `<answer>...</answer>`, or on the whole completion when it has none; needs the `entry`
                    column that `data.source: reasoning-gym:<task>` gives
The prompts and completions are as the data gives them: strings for string prompts; for chat prompts (lists of
messages) each completion is `[{"role": "assistant", "content": text}]`. The other keyword arguments are the
data's other columns and `completion_ids`, one value per completion.
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
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UserError(
            f"reward {spec!r}: use path/to/file.py:function, package.module:function or a built-in "
            f"({', '.join(BUILTIN)})"
        )
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserError(f"reward {spec!r}: no such file {path}")
        module_spec = importlib.util.spec_from_file_location(f"lora_llama_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise UserError(f"reward {spec!r}: importing {path} raised {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise UserError(f"reward {spec!r}: cannot import {where} ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"reward {spec!r}: {where} has no function {name!r}")
    return getattr(fn, "__name__", name), fn


def _checked(name: str, values, prompts: list, n: int) -> list[float]:
    """The values as floats (None and NaN: NaN), or one line naming the function and the first bad row."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(f"reward {name} returned {got} for {n} completions (it must return one number or None each)")
    out = []
    for i, v in enumerate(values):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
            raise UserError(
                f"reward {name} returned {v!r} ({type(v).__name__}) for row {i} "
                f"(prompt {_short(prompts[i])}): not a number or None"
            )
        out.append(math.nan if v is None else float(v))
    return out


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
    """(rows, functions) float32 rewards, NaN where a function returned None. A function that raises or
    returns something else stops the run with one line naming it and the row."""
    n, table = len(completions), []
    for name, fn in rewards.items():
        try:
            values = fn(prompts=prompts, completions=completions, **columns)
        except Exception as e:
            row = _first_failing_row(fn, prompts, completions, columns)
            where = f" on row {row} (prompt {_short(prompts[row])})" if row is not None else ""
            raise UserError(f"reward {name} raised {type(e).__name__}: {e}{where}") from None
        table.append(_checked(name, values, prompts, n))
    return torch.tensor(table, dtype=torch.float32).T.reshape(n, len(rewards))


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
