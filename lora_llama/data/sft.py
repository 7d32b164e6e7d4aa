"""Data: sources (through `datasets`) -> examples -> token ids + labels, packing, collate.

An example is a dict with `input_ids` and `labels` (same length; -100 where no
loss is taken). Position t of the model predicts labels[t + 1]. Packed rows also
carry `position_ids` (restarting per example) and `segment_ids` (one id per
example), which the model turns into a block-diagonal causal mask.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator

from lora_llama.data.chat import (
    close_with_eos,
    encode_rendered,
    normalise_messages,
    render_chat,
    special_token_ids,
    tool_list,
)
from lora_llama.data.loading import load_splits
from lora_llama.data.records import Skipped, detect_format, row_of, sft_record
from lora_llama.errors import BadRecord, UserError
from lora_llama.labels import IGNORE_INDEX

# Stanford Alpaca's prompt, used for alpaca data when the tokenizer has no chat template
ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task{with_input}. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n"
)
# an example without targets: what a rank runs when a batch leaves it nothing (ranks must run the same steps)
EMPTY_EXAMPLE = {"input_ids": [0, 0], "labels": [IGNORE_INDEX, IGNORE_INDEX]}


# ---------------------------------------------------------------------------- formats

READS = ("text", "chat", "prompt-completion", "alpaca")  # the data formats Tokenize reads


class Tokenize:
    """Turns one raw record into a list of examples (`text` may give several windows)."""

    def __init__(
        self, tokenizer, fmt: str, max_seq_len: int, train_on_prompt: bool = False, prompt_template: str | None = None
    ):
        self.tok, self.fmt, self.max_len = tokenizer, fmt, max_seq_len
        self.train_on_prompt, self.prompt_template = train_on_prompt, prompt_template
        self.eos = tokenizer.eos_token_id
        self.special_ids = special_token_ids(tokenizer)

    def __call__(self, record: dict) -> list[dict]:
        if self.fmt == "text":
            if not isinstance(record["text"], str):
                raise BadRecord(f"{type(record['text']).__name__} text")
            return self.text(record["text"])
        if self.fmt == "chat":
            return [self.chat(normalise_messages(record["messages"]), tool_list(record.get("tools")))]
        if self.fmt == "prompt-completion":
            return [self.prompt_completion(record["prompt"], record["completion"])]
        return [self.alpaca(record)]

    def prompt_completion(self, prompt, completion) -> dict:
        """trl's prompt-completion: conversational (lists of messages) as a chat, standard (strings) as the plain
        prompt followed by the completion and EOS, the completion the target."""
        if isinstance(prompt, list) and isinstance(completion, list):
            return self.chat(normalise_messages(prompt) + normalise_messages(completion))
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise BadRecord("a prompt and completion that are neither both strings nor both messages")
        return self.plain(prompt, completion)

    def text(self, text: str) -> list[dict]:
        ids = self.tok(text)["input_ids"] + [self.eos]  # tokenizer defaults add BOS where the model wants it
        windows = [ids[i : i + self.max_len] for i in range(0, len(ids), self.max_len)]
        return [{"input_ids": w, "labels": list(w)} for w in windows if len(w) > 1]

    def chat(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        """Render with the chat template (listing `tools`, a record's tool schemas, where it has them); targets
        are the assistant turns with the token that ends them.

        An assistant turn spans from the end of the template's generation prompt to the end of the
        turn's rendering, so the system prompt and the generation prompt are never targets.
        """
        text = render_chat(self.tok, messages, tools=tools)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = render_chat(self.tok, messages[:i], add_generation_prompt=True, tools=tools)
            through = render_chat(self.tok, messages[: i + 1], tools=tools)
            if not (text.startswith(before) and text.startswith(through)):
                raise UserError(
                    "the chat template renders a conversation differently from its first turns, "
                    "so the assistant turns cannot be located; set data.format or use another template"
                )
            spans.append((len(before), len(through)))
        ids, offsets = encode_rendered(self.tok, text)
        in_target = [any(s <= a < e for s, e in spans) for a, _ in offsets]
        labels = [t if (keep or self.train_on_prompt) else IGNORE_INDEX for t, keep in zip(ids, in_target)]
        if messages[-1]["role"] == "assistant":
            ids, labels = close_with_eos(ids, labels, self.eos, self.special_ids)
        return self.truncate(ids, labels)

    def alpaca(self, record: dict) -> dict:
        instruction, inp, output = record["instruction"], record.get("input") or "", record["output"]
        if self.tok.chat_template and not self.prompt_template:
            user = f"{instruction}\n\n{inp}" if inp else instruction
            return self.chat([{"role": "user", "content": user}, {"role": "assistant", "content": output}])
        if self.prompt_template:
            prompt = self.prompt_template.format(instruction=instruction, input=inp)
        else:
            prompt = ALPACA_TEMPLATE.format(
                with_input=", paired with an input that provides further context" if inp else "",
                instruction=instruction,
                input_block=f"### Input:\n{inp}\n\n" if inp else "",
            )
        return self.plain(prompt, output)

    def plain(self, prompt: str, completion: str) -> dict:
        """The prompt's tokens (with the tokenizer's defaults: BOS where the model wants it), then the
        completion's and EOS, the completion the target."""
        p = self.tok(prompt)["input_ids"]
        c = self.tok(completion, add_special_tokens=False)["input_ids"] + [self.eos]
        labels = (p if self.train_on_prompt else [IGNORE_INDEX] * len(p)) + c
        return self.truncate(p + c, labels)

    def truncate(self, ids, labels) -> dict:
        return {"input_ids": ids[: self.max_len], "labels": labels[: self.max_len]}


def tokenize_records(records, tokenizer, data, skipped: Skipped | None = None) -> list[dict]:
    """Every record -> examples, read as a recipe's `data` section says (format, max_seq_len, train_on_prompt,
    prompt_template, fields). A row that cannot be read, or keeps no target within max_seq_len, is skipped and
    counted in `skipped` (with its `strict`, refused)."""
    skipped = skipped if skipped is not None else Skipped("the data")
    tokenize = record_tokenizer(records.column_names, tokenizer, data)
    return [e for i, rec in enumerate(records) for e in record_examples(tokenize, rec, i, data.fields, skipped)]


def record_tokenizer(columns, tokenizer, data) -> Tokenize:
    """The Tokenize for records with these columns as the `data` section reads them (`format: auto` detects
    theirs), or one line when the format is not one SFT reads."""
    fmt = detect_format([*columns, *data.fields]) if data.format == "auto" else data.format
    if fmt not in READS:
        raise UserError(
            f"the data's columns ({', '.join(columns)}) are data.format {fmt}: set train.objective to "
            f"one that reads {fmt} data, or map your columns with data.fields"
        )
    return Tokenize(tokenizer, fmt, data.max_seq_len, data.train_on_prompt, data.prompt_template)


def record_examples(tokenize: Tokenize, record: dict, index: int, fields: dict, skipped: Skipped) -> list[dict]:
    """One record's examples with a target token; none (the row counted in `skipped`) when it cannot be read or
    keeps no target within max_seq_len."""
    try:
        made = tokenize(sft_record(record, tokenize.fmt, fields))
    except BadRecord as e:
        skipped.add(row_of(record, index), str(e))
        return []
    kept = [e for e in made if any(t != IGNORE_INDEX for t in e["labels"][1:])]
    if not kept:
        skipped.add(row_of(record, index), f"no target token within data.max_seq_len ({tokenize.max_len})")
    return kept


# ---------------------------------------------------------------------------- packing and batches


def pack(examples: list[dict], max_seq_len: int) -> list[dict]:
    """Concatenate examples into rows of at most max_seq_len tokens, greedily in order (a row's examples are
    consecutive: GRPO's completions are found again by their order)."""
    return list(packed(iter(examples), max_seq_len))


def packed(examples: Iterator[dict], max_seq_len: int) -> Iterator[dict]:
    """`pack` as the examples come (a stream): each row is given once the next example would not fit in it."""
    members, used = [], 0
    for ex in examples:
        n = len(ex["input_ids"])
        if members and used + n > max_seq_len:
            yield glued(members)
            members, used = [], 0
        members.append(ex)
        used += n
    if members:
        yield glued(members)


def pack_best_fit(examples: list[dict], max_seq_len: int) -> list[dict]:
    """Examples glued into rows of at most max_seq_len tokens by best fit decreasing (`best_fit_rows`): fuller rows,
    so fewer of them and less padding in a batch than packing in order (the default recipe's chat pairs: 198 rows
    of 256 tokens filled to 0.95, where in order 219 are filled to 0.86)."""
    return [
        glued([examples[i] for i in row]) for row in best_fit_rows([len(e["input_ids"]) for e in examples], max_seq_len)
    ]


def best_fit_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """The indices of `lengths` grouped into rows holding at most `capacity` (a longer one alone) by best fit
    decreasing, as trl's `bfd` packing: longest first (ties in their order), each into the open row it leaves
    the least room in, else a new row. Rows in the order they are opened, each row's members longest first."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # (room left, row), sorted: the best fit is the first with room >= n
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        k = bisect.bisect_left(open_rows, (n, -1))
        if k < len(open_rows):
            room, row = open_rows.pop(k)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n > 0:
            bisect.insort(open_rows, (room - n, row))
    return rows


def glued(examples: list[dict]) -> dict:
    """One packed row: the examples' ids and labels end to end, each its own segment with positions from 0."""
    row = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
    for segment, ex in enumerate(examples):
        n = len(ex["input_ids"])
        row["input_ids"] += ex["input_ids"]
        row["labels"] += ex["labels"]
        row["position_ids"] += list(range(n))
        row["segment_ids"] += [segment] * n
    return row


def packed_sequences(sequences: list[dict], pad_id: int, pack_to: int, row_length=None) -> dict:
    """Sequences that are summed apart (a preference batch's answers, KTO's completions) packed into as few rows of
    at most pack_to tokens as best fit decreasing makes (`best_fit_rows`), each attending to itself only (positions
    restart, a segment each). With `sequence` (rows, T), the index in `sequences` of each token's sequence (-1:
    padding), `answer`, whether each label lies past its sequence's `prompt_len`, and `sequences`, their number."""
    import torch

    examples = []
    for members in best_fit_rows([len(s["input_ids"]) for s in sequences], pack_to):
        row = glued([sequences[i] for i in members])
        spans = [(i, len(sequences[i]["input_ids"]), sequences[i].get("prompt_len", 0)) for i in members]
        row["sequence"] = [i for i, n, _ in spans for _ in range(n)]
        row["answer"] = [j >= prompt for _, n, prompt in spans for j in range(n)]
        examples.append(row)
    batch = collate(examples, pad_id, row_length)
    width = batch["input_ids"].shape[1]
    for key, fill in (("sequence", -1), ("answer", False)):
        batch[key] = torch.tensor([e[key] + [fill] * (width - len(e[key])) for e in examples])
    batch["sequences"] = torch.tensor(len(sequences))
    return batch


def collate(examples: list[dict], pad_id: int, row_length=None):
    """Right-pad a list of examples into tensors; padding is never a target. row_length: the length rows of up to
    n tokens are padded to (None: n, the longest example's). `tokens`: how many are not padding (0-d)."""
    import torch

    T = max(len(e["input_ids"]) for e in examples)
    T = row_length(T) if row_length else T

    def pad(key, value):
        return torch.tensor([e[key] + [value] * (T - len(e[key])) for e in examples])

    batch = {"input_ids": pad("input_ids", pad_id), "labels": pad("labels", IGNORE_INDEX)}
    batch["tokens"] = torch.tensor(sum(len(e["input_ids"]) for e in examples))
    if "segment_ids" in examples[0]:
        batch["position_ids"] = pad("position_ids", 0)
        batch["segment_ids"] = pad("segment_ids", -1)
    return batch


def tokenize_splits(
    train_records, val_records, tokenize, source: str, what: str, log, strict: bool = False
) -> tuple[list, list]:
    """(train, val) through tokenize(records, skipped) -> items; the rows skipped are said in one line (with
    `strict`, the first stops the run), and a training split left empty is one error."""
    skipped = Skipped(source, strict)
    train = tokenize(train_records, skipped)
    val = tokenize(val_records, skipped) if len(val_records) else []
    skipped.report(len(train_records) + len(val_records), log)
    if not train:
        raise UserError(f"data source {source!r} gives no usable {what}")
    return train, val


def build_examples(data, tokenizer, seed: int, log=print) -> tuple[list[dict], list[dict]]:
    """(train, val) examples for a recipe's `data` section; packing applies to train only; the rows skipped are
    said in one line."""
    train_records, val_records = load_splits(data, seed)
    skipped = Skipped(data.source, data.strict)
    train = tokenize_records(train_records, tokenizer, data, skipped)
    val = tokenize_records(val_records, tokenizer, data, skipped) if len(val_records) else []
    skipped.report(len(train_records) + len(val_records), log)
    if not train:
        raise UserError(f"data source {data.source!r} gives no training example with a target token")
    if data.packing:
        random.Random(seed).shuffle(train)  # examples of one length (taken in order) mix sources in their rows
        train = pack_best_fit(train, data.max_seq_len)
    return train, val
