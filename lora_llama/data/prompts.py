"""Prompt data for reinforcement learning (`data.format: prompt`).

Each record has a `prompt`: a string, rendered as one user turn with the chat template when the tokenizer has
one (else tokenized as it is), or a list of chat messages; `data.system_prompt` goes first in each prompt
that has no system turn. Its other columns reach the reward functions unchanged. `data.source: reasoning-gym:<task>`
generates records from a reasoning-gym task instead, seeded by
train.seed, `data.max_examples` of them (default 1000), with `data.task_args` as the task's settings: the
question is the prompt, and `answer` and `entry` (the task's whole record) are the columns.

A prompt example is {"prompt_ids": [...], "prompt": the record's prompt, "columns": {...}, "index": i}; the
index (its place in the split) seeds its completions' sampling.
"""

from __future__ import annotations

from lora_llama.data.chat import encode_rendered, normalise_messages, render_chat
from lora_llama.data.loading import load_splits, split
from lora_llama.data.records import ROW, Skipped, needs, rename_fields, row_of
from lora_llama.data.sft import tokenize_splits
from lora_llama.errors import BadRecord, UserError

REASONING_GYM = "reasoning-gym:"
DEFAULT_TASK_SIZE = 1000


def reasoning_gym_records(task: str, size: int, seed: int, task_args: dict) -> list[dict]:
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(
            "data.source reasoning-gym:... needs the reasoning-gym package (pip install 'lora-llama[rl]')"
        ) from None
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_args)
    except Exception as e:
        raise UserError(f"reasoning-gym task {task!r}: {type(e).__name__}: {e}") from None
    return [{"prompt": e["question"], "answer": str(e["answer"]), "entry": e} for e in dataset]


def prompt_ids(tokenizer, prompt, index: int, system_prompt: str | None = None, tools=None) -> list[int]:
    """A prompt's token ids, ending where the model's answer begins (after a system turn, when given and the
    prompt has none); tools: the JSON schemas the template lists."""
    if isinstance(prompt, str) and tokenizer.chat_template:
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, str):
        return tokenizer((system_prompt + "\n\n" if system_prompt else "") + prompt)["input_ids"]
    if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
        raise BadRecord(f"a 'prompt' that is neither a string nor a list of chat messages ({type(prompt).__name__})")
    messages = normalise_messages(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return encode_rendered(tokenizer, render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools))[0]


def prompt_examples(
    records, tokenizer, data, max_prompt_len: int, skipped: Skipped | None = None, tools=None
) -> tuple[list[dict], Skipped]:
    """Every record -> a prompt example, read as the `data` section says (fields, system_prompt), and the rows
    skipped (a prompt missing, empty or too long)."""
    examples, skipped = [], skipped if skipped is not None else Skipped("the data")
    for i, raw in enumerate(records):
        record = rename_fields(dict(raw), data.fields)
        try:
            needs(record, ("prompt",))
            ids = prompt_ids(tokenizer, record["prompt"], i, data.system_prompt, tools)
            if not ids or len(ids) > max_prompt_len:
                raise BadRecord("an empty prompt" if not ids else f"a prompt over {max_prompt_len} tokens")
        except BadRecord as e:
            skipped.add(row_of(raw, i), str(e))
            continue
        columns = {k: v for k, v in record.items() if k not in ("prompt", ROW)}
        examples.append({"prompt_ids": ids, "prompt": record["prompt"], "columns": columns, "index": len(examples)})
    return examples, skipped


def build_prompts(
    data, tokenizer, seed: int, max_prompt_len: int, log=print, tools=None
) -> tuple[list[dict], list[dict]]:
    """(train, val) prompt examples for a recipe's `data` section; a prompt keeps max_prompt_len tokens at most
    (the room its completion leaves in a row); tools: the JSON schemas each prompt lists."""
    if data.source.startswith(REASONING_GYM):
        records = reasoning_gym_records(
            data.source.removeprefix(REASONING_GYM), data.max_examples or DEFAULT_TASK_SIZE, seed, data.task_args
        )
        train_records, val_records = split(records, data.val_size, seed)
    else:
        train_records, val_records = load_splits(data, seed)
    return tokenize_splits(
        train_records,
        val_records,
        lambda records, skipped: prompt_examples(records, tokenizer, data, max_prompt_len, skipped, tools)[0],
        data.source,
        "prompt",
        log,
        data.strict,
    )
