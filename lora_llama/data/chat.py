"""Tokenizer helpers shared by SFT data, preference pairs, generation and training: the chat
template's rendering, BOS once, the tokenizer's special tokens, and the rule that every answer
ends on a trained stop token."""

from __future__ import annotations

import json

from lora_llama.errors import BadRecord
from lora_llama.files.json_files import read_json

# ChatML, for chat data on base models whose tokenizer has no template of its own
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# roles as OpenAI / transformers messages and ShareGPT conversations name them -> the chat template's
_ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",  # ShareGPT's tool result
    "function_call": "assistant",  # ShareGPT's tool call: its value is the call's JSON
}


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools=None) -> str:
    """The conversation as text through the tokenizer's chat template (ChatML when it has none); tools: their
    JSON schemas (or functions), which a tool-capable template lists for the model."""
    return tokenizer.apply_chat_template(
        messages,
        chat_template=tokenizer.chat_template or CHATML_TEMPLATE,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        tools=tools or None,
    )


def encode_rendered(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of a chat-template rendering: BOS where the tokenizer
    adds one, but never twice when the template wrote one too."""
    enc = tokenizer(text, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:2] == [bos, bos]:
        ids, offsets = ids[1:], offsets[1:]
    return ids, offsets


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens, those it declares and those added as special (<|eot_id|>)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def close_with_eos(ids: list[int], labels: list[int], eos: int | None, special_ids: set[int]):
    """(ids, labels) of an answer that ends on a stop token the model is trained to emit: templates that
    close a turn with a special token (<|im_end|>, <|eot_id|>, </s>) have one; the others get EOS as a target."""
    if eos is not None and not special_ids & set(labels[-3:]):
        return ids + [eos], labels + [eos]
    return ids, labels


def end_of_turn_id(tokenizer) -> int | None:
    """The token that ends an assistant turn in the tokenizer's chat template (EOS without a template)."""
    if not tokenizer.chat_template:
        return tokenizer.eos_token_id
    user = [{"role": "user", "content": "Hi"}]
    before = render_chat(tokenizer, user, add_generation_prompt=True)
    ids, offsets = encode_rendered(
        tokenizer, render_chat(tokenizer, [*user, {"role": "assistant", "content": "Hello"}])
    )
    answer = [t for t, (start, _) in zip(ids, offsets) if start >= len(before)]
    special = special_token_ids(tokenizer)
    return next((t for t in reversed(answer) if t in special), tokenizer.eos_token_id)


def normalise_messages(msgs) -> list[dict]:
    """Messages as the chat template takes them, from OpenAI / transformers messages ({role, content}, an
    assistant's `tool_calls`, `tool` turns) and ShareGPT conversations ({from, value}: human, gpt, system,
    function_call, observation); a file mixing both reads back with the other style's keys null. Content is a
    string, or a list of text parts (joined). Anything else is a BadRecord."""
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs)):
        raise BadRecord("empty messages" if msgs == [] else f"messages that are not a list of objects ({msgs!r:.40})")
    return [_message(m) for m in msgs]


def tool_list(tools) -> list[dict] | None:
    """A record's `tools` column (OpenAI's list of function schemas, or that list as a JSON string) as the chat
    template takes it; None when the record has none."""
    if tools is None or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise BadRecord("a 'tools' column that is not JSON") from None
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRecord("a 'tools' column that is not a list of function schemas")
    return tools


def _call_arguments(call: dict) -> dict:
    """A tool call with its arguments as an object: OpenAI writes them as a JSON string, templates render objects."""
    if not isinstance(call, dict):
        raise BadRecord("a tool call that is not an object")
    function = call.get("function", call)
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            raise BadRecord("a tool call whose arguments are not JSON") from None
        function = {**function, "arguments": parsed}
        return {**call, "function": function} if "function" in call else function
    return call


def _message(m: dict) -> dict:
    role = m.get("role") if m.get("role") is not None else m.get("from")
    if role not in _ROLES:
        raise BadRecord(f"unknown role {role!r}")
    content = m.get("content") if m.get("content") is not None else m.get("value")
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)  # OpenAI's text parts
    calls = m.get("tool_calls")
    if role == "function_call":  # ShareGPT: the value is {"name": ..., "arguments": ...}
        try:
            call = json.loads(content) if isinstance(content, str) else None
        except json.JSONDecodeError:
            call = None
        if not isinstance(call, dict) or "name" not in call:
            raise BadRecord("a function_call turn whose value is not a call's JSON")
        content, calls = "", [{"type": "function", "function": call}]
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise BadRecord(
            f"{type(content).__name__} content" if content is not None else f"a {role} turn without content"
        )
    out = {"role": _ROLES[role], "content": content}
    if calls:
        out["tool_calls"] = [_call_arguments(c) for c in calls]
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None and out["role"] == "tool":
            out[key] = m[key]
    return out


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a generation (see `stop_token_ids`)."""
    return stop_token_ids(tokenizer, model.args.eos_token_id, model.folder)


def stop_token_ids(tokenizer, config_eos, folder) -> list[int]:
    """The tokenizer's EOS, the token that ends an assistant turn in its chat template, and the EOS of
    config.json and of the folder's generation_config.json (Llama 3 and Qwen list several)."""
    ids = {tokenizer.eos_token_id, end_of_turn_id(tokenizer)}
    listed = [config_eos]
    if folder is not None and (folder / "generation_config.json").is_file():
        listed.append(read_json(folder / "generation_config.json").get("eos_token_id"))
    for eos in listed:
        ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)
