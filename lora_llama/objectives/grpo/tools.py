"""A GRPO run's tools and how their calls are answered.

train.grpo.tools lists plain functions (`path/to/file.py:function`); train.grpo.environment names a class (trl's
environment_factory): one instance per rollout, `reset(**row)` (the prompt and the other columns) starts its
episode and may return text for the user's message, its public methods are that rollout's tools, and an optional
`get_reward()` scores the episode. Each tool is described to the model by the JSON schema transformers'
get_json_schema makes of its type hints and docstring, so a function without them is refused before the model
loads.

Nothing a tool does ends the run: an exception is answered with its message (`{'error': ...}`, as trl answers),
a call past train.grpo.tool_timeout_s with a timeout error (its thread is left to finish on its own: Python
cannot stop one), a call that cannot be read or names no tool with an error the model reads; each counts as a
failure. The calls of every row of a batch run at once, each in a thread of its own, so a slow tool keeps the
others waiting no longer than it takes.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Callable

from lora_llama.data.templates import renders_tools
from lora_llama.errors import UserError
from lora_llama.objectives.grpo.rewards import import_named


def tool_schema(fn: Callable, spec: str) -> dict:
    """The JSON schema the chat template lists for a tool, or one line when its hints or docstring are missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:
        raise UserError(
            f"tool {spec!r}: {e} (a tool needs a type hint on each argument and a docstring with an Args section, "
            "from which its JSON schema is made)"
        ) from None


def load_tools(specs: list[str]) -> list[Callable]:
    """The recipe's tool functions, each checked to have a schema."""
    tools = []
    for spec in specs:
        fn = import_named(spec, "tool")
        if not callable(fn):
            where, _, name = spec.rpartition(":")
            raise UserError(f"tool {spec!r}: {where} has no function {name!r}")
        tool_schema(fn, spec)
        tools.append(fn)
    return tools


def load_environment(spec: str | None) -> type | None:
    """The recipe's environment class: one with a `reset`, made without arguments, whose tools have schemas."""
    if not spec:
        return None
    cls = import_named(spec, "environment")
    if not inspect.isclass(cls):
        where, _, name = spec.rpartition(":")
        raise UserError(f"environment {spec!r}: {where} has no class {name!r}")
    if not callable(getattr(cls, "reset", None)):
        raise UserError(f"environment {spec!r}: the class has no reset method (trl's environment_factory needs one)")
    try:
        probe = cls()
    except Exception as e:
        raise UserError(f"environment {spec!r}: {cls.__name__}() raised {type(e).__name__}: {e}") from None
    for method in environment_tools(probe):
        tool_schema(method, f"{spec}.{method.__name__}")
    return cls


def listed_tools(settings, tokenizer) -> list[dict] | None:
    """The schemas a run's prompts list (None without tools), once the chat template is known to render tools."""
    if not (settings.tools or settings.environment):
        return None
    if not renders_tools(tokenizer):
        raise UserError(
            "train.grpo.tools / environment: this model's chat template cannot render tools, calls and their "
            "results; set data.chat_template to a template that can (a file, or chatml-tools: the Hermes / Qwen2.5 "
            "form)"
        )
    return tool_schemas(settings)


def tool_schemas(settings) -> list[dict]:
    """The schemas a run's prompts list: train.grpo.tools' functions, then its environment's methods."""
    functions, environment = load_tools(settings.tools), load_environment(settings.environment)
    return Toolbox(functions, environment() if environment is not None else None).schemas


def environment_tools(environment) -> list[Callable]:
    """An environment's public methods but reset and get_reward (trl's rule), bound to it, in name order."""
    names = [n for n, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)]
    return [getattr(environment, n) for n in names if not n.startswith("_") and n not in ("reset", "get_reward")]


def error_answer(message: str) -> str:
    """A tool result that reports a failure, written as trl writes one."""
    return str({"error": message})


class Toolbox:
    """The tools one rollout can call (the recipe's functions and its environment's methods), by name."""

    def __init__(self, functions: list[Callable], environment=None):
        self.listed = list(functions) + (environment_tools(environment) if environment is not None else [])
        self.tools = {fn.__name__: fn for fn in self.listed}

    @functools.cached_property
    def schemas(self) -> list[dict]:
        """The tools' JSON schemas, made when a prompt is rendered with them (not for every rollout's toolbox)."""
        return [tool_schema(fn, fn.__name__) for fn in self.listed]


class _Call(threading.Thread):
    """One tool call in a daemon thread: its result or its exception, once it has run."""

    def __init__(self, fn: Callable, arguments: dict):
        super().__init__(daemon=True)
        self.fn, self.arguments, self.answer, self.failed = fn, arguments, None, False

    def run(self):
        try:
            self.answer = str(self.fn(**self.arguments))
        except Exception as e:  # the model reads what went wrong
            self.answer, self.failed = error_answer(str(e)), True


def answer_calls(requests: list[tuple[Toolbox, list[dict], list[str]]], timeout_s: float) -> list[tuple[list, int]]:
    """For each rollout's (toolbox, calls, unreadable calls): its tool messages in the calls' order (the unreadable
    ones after) and how many failed. Every call of every rollout runs at once; each may take timeout_s."""
    started = []
    for toolbox, calls, _ in requests:
        threads = []
        for call in calls:
            fn = toolbox.tools.get(call["name"])
            thread = _Call(fn, call["arguments"]) if fn is not None else None
            if thread is not None:
                thread.start()
            threads.append(thread)
        started.append(threads)
    deadline = time.monotonic() + timeout_s
    answered = []
    for (toolbox, calls, unreadable), threads in zip(requests, started):
        messages, failures = [], 0
        for call, thread in zip(calls, threads):
            if thread is None:
                content, failed = error_answer(f"Tool {call['name']} not found."), True
            else:
                thread.join(max(0.0, deadline - time.monotonic()))
                timed_out = thread.is_alive()
                content = error_answer(f"timed out after {timeout_s:g} s") if timed_out else thread.answer
                failed = timed_out or thread.failed
            messages.append({"role": "tool", "name": call["name"], "content": content})
            failures += failed
        for line in unreadable:
            messages.append({"role": "tool", "name": "unknown", "content": error_answer(line)})
            failures += 1
        answered.append((messages, failures))
    return answered
