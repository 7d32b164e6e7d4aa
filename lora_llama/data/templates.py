"""Chat templates a recipe chooses (`data.chat_template`: a file, or one shipped here by name) and what tool calling
asks of a template: whether it renders tools, calls and results at all, the tokens it writes after an assistant
turn for a tool's results (up to the next assistant turn), and the calls an assistant turn holds, read in the
template's own syntax: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Hermes, ChatML, Qwen) or the bare
`{"name": ..., "parameters": ...}` of Llama 3.1."""

from __future__ import annotations

import json
import re
from pathlib import Path

from lora_llama.data.chat import render_chat
from lora_llama.errors import UserError

TEMPLATES = Path(__file__).parent / "templates"
NAMED = {"chatml-tools": "chatml-tools.jinja"}  # ChatML with tools in the Hermes / Qwen2.5 form
TAGGED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def chat_template_text(spec: str) -> str:
    """The template data.chat_template names: a shipped one by name, else a Jinja file."""
    if spec in NAMED:
        return (TEMPLATES / NAMED[spec]).read_text()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(f"data.chat_template {spec!r}: no such file, and not a named template ({', '.join(NAMED)})")
    return path.read_text()


def use_chat_template(tokenizer, spec: str | None):
    """The tokenizer with data.chat_template in place of its own (unchanged without one)."""
    if spec:
        tokenizer.chat_template = chat_template_text(spec)
    return tokenizer


def renders_tools(tokenizer) -> bool:
    """Whether the chat template writes a whole tool exchange (a call's name and arguments, a tool's result), as
    trl's supports_tool_calling asks: templates that drop either side silently fail here."""
    name, key, value, result = "tool_name_a8f3", "tool_arg_b9d4", "tool_value_d6e7", "tool_result_c4f9"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [_call(name, {key: value})]},
        {"role": "tool", "name": name, "content": result},
    ]
    if not tokenizer.chat_template:
        return False
    try:
        text = render_chat(tokenizer, messages)
    except Exception:  # a template that refuses the roles (jinja's TemplateError and the like)
        return False
    return all(s in text for s in (name, key, value, result))


def tool_suffix_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The tokens the template writes after an assistant turn's end-of-turn token for these tool results, through
    the next assistant turn's opening: trl's _get_tool_suffix_ids, rendered after a stand-in call."""
    call = {"role": "assistant", "content": "", "tool_calls": [_call(tool_messages[0]["name"], {})]}
    before = [{"role": "user", "content": "dummy"}, call]
    prefix = tokenizer.apply_chat_template(before, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        before + tool_messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ends = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    prefix = prefix[: ends[-1] + 1] if ends else prefix
    if full[: len(prefix)] != prefix:
        raise UserError("the chat template renders a tool's result by changing the assistant turn before it")
    return full[len(prefix) :]


def tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """The calls an assistant turn's text holds, as {"name", "arguments"}, and a line for each call that cannot
    be read (not JSON, no name, arguments not an object)."""
    tagged = TAGGED_CALL.findall(text)
    if not tagged and text.lstrip().startswith('{"name"'):  # Llama 3.1: the whole turn is one call
        tagged = [text.strip()]
    calls, errors = [], []
    for raw in tagged:
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(f"the call {raw[:80]!r} is not JSON ({e.msg})")
            continue
        arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            errors.append(f"the call {raw[:80]!r} names no function")
        elif not isinstance(arguments, dict):
            errors.append(f"the call to {call['name']} has arguments that are not an object")
        else:
            calls.append({"name": call["name"], "arguments": arguments})
    return calls, errors


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}
