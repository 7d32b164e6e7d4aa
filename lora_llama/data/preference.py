"""Preference data: records with a `prompt`, a `chosen` and a `rejected` answer -> pairs of examples.

A pair is {"chosen": example, "rejected": example}; each example is the prompt and one answer rendered
through the tokenizer's chat template, with `prompt_len`, the number of tokens before the answer (the
tokens the prompt alone and prompt + answer share, as trl counts them). Answer tokens are the targets;
prompt tokens are too with `train_on_prompt` (ORPO's NLL term then covers them; DPO never does).
"""

from __future__ import annotations

from lora_llama.data.chat import close_with_eos, encode_rendered, normalise_messages, render_chat
from lora_llama.data.loading import load_splits
from lora_llama.data.records import Skipped, needs, rename_fields, row_of
from lora_llama.data.sft import EMPTY_EXAMPLE, Tokenize, collate, packed_sequences, tokenize_splits
from lora_llama.errors import BadRecord
from lora_llama.labels import IGNORE_INDEX

EMPTY_PAIR = {"chosen": {**EMPTY_EXAMPLE, "prompt_len": 0}, "rejected": {**EMPTY_EXAMPLE, "prompt_len": 0}}


def as_messages(value, role: str, field: str, index: int) -> list[dict]:
    """A string becomes one message of `role`; a list of {role, content} messages is taken as it is."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return normalise_messages(value)
    raise BadRecord(f"a {field!r} that is neither a string nor a list of chat messages")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tokenize_answers(tokenize: Tokenize, prompt: list[dict], answers: dict[str, list[dict]]) -> dict | str:
    """{name: example} for each answer to the same prompt, the prompt's tokens counted once for all (the tokens
    the prompt alone and prompt + each answer share, as trl counts them), or the reason they are skipped (an empty
    answer, a prompt that leaves no room for one)."""
    if any(not "".join(str(m["content"]) for m in a).strip() for a in answers.values()):
        return f"an empty {' or '.join(answers)} answer"
    tok = tokenize.tok
    prompt_ids, _ = encode_rendered(tok, render_chat(tok, prompt, add_generation_prompt=True))
    full = {k: encode_rendered(tok, render_chat(tok, prompt + a))[0] for k, a in answers.items()}
    start = min(_common_prefix(prompt_ids, ids) for ids in full.values())
    if start >= tokenize.max_len:
        return f"a prompt of data.max_seq_len ({tokenize.max_len}) tokens or more"
    examples = {}
    for k, ids in full.items():
        labels = (ids[:start] if tokenize.train_on_prompt else [IGNORE_INDEX] * start) + ids[start:]
        ids, labels = close_with_eos(ids, labels, tokenize.eos, tokenize.special_ids)
        examples[k] = {**tokenize.truncate(ids, labels), "prompt_len": start}
    return examples


def implicit_prompt(record: dict) -> dict:
    """A pair without a prompt column split as trl's `extract_prompt` splits it: the prompt is the longest start
    chosen and rejected share (messages, or characters less a trailing space), the answers what follows."""
    chosen, rejected = record["chosen"], record["rejected"]
    idx = 0
    while idx < min(len(chosen), len(rejected)) and chosen[idx] == rejected[idx]:
        idx += 1
    if isinstance(chosen, str) and idx and chosen[idx - 1] == " ":
        idx -= 1
    return {**record, "prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def tokenize_pair(tokenize: Tokenize, record: dict, index: int) -> dict | str:
    """A pair, or the reason it is skipped; without a prompt, the one chosen and rejected share."""
    if record.get("prompt") is None and record.get("chosen") is not None and record.get("rejected") is not None:
        record = implicit_prompt(record)
    prompt = as_messages(record["prompt"], "user", "prompt", index)
    answers = {k: as_messages(record[k], "assistant", k, index) for k in ("chosen", "rejected")}
    return tokenize_answers(tokenize, prompt, answers)


def tokenize_pairs(records, tokenizer, data, skipped: Skipped | None = None) -> tuple[list[dict], Skipped]:
    """Every record -> a pair, read as the `data` section says (max_seq_len, train_on_prompt, fields), and the rows
    skipped (a column missing, an empty answer, no room for one)."""
    tokenize = Tokenize(tokenizer, "chat", data.max_seq_len, data.train_on_prompt)
    pairs, skipped = [], skipped if skipped is not None else Skipped("the data")
    for i, record in enumerate(records):
        rec = rename_fields(record, data.fields)
        try:
            needs(rec, ("chosen", "rejected"))
            pair = tokenize_pair(tokenize, rec, i)
        except BadRecord as e:
            pair = str(e)
        if isinstance(pair, str):
            skipped.add(row_of(record, i), pair)
        else:
            pairs.append(pair)
    return pairs, skipped


def build_pairs(data, tokenizer, seed: int, log=print) -> tuple[list[dict], list[dict]]:
    """(train, val) pairs for a recipe's `data` section; skipped records are counted in one warning."""
    train_records, val_records = load_splits(data, seed)
    return tokenize_splits(
        train_records,
        val_records,
        lambda records, skipped: tokenize_pairs(records, tokenizer, data, skipped)[0],
        data.source,
        "preference pair",
        log,
        data.strict,
    )


def collate_pairs(pairs: list[dict], pad_id: int, row_length=None, pack_to: int | None = None) -> dict:
    """One batch of the B pairs' 2B answers, the B chosen first, then the B rejected (one forward pass for both):
    2B rows with `prompt_lens` (2B,); or, with pack_to, the 2B sequences packed into rows of at most pack_to tokens
    (`packed_sequences`)."""
    import torch

    sequences = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    if pack_to:  # packed, each answer summed apart (token_losses.answer_logps reads `sequence` and `answer`)
        return packed_sequences(sequences, pad_id, pack_to, row_length)
    batch = collate([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in sequences], pad_id, row_length)
    batch["prompt_lens"] = torch.tensor([r["prompt_len"] for r in sequences])
    return batch
