"""Raw records before tokenizing: the shape they come in (detected from the columns under `data.format: auto`),
the user's column names (`data.fields`), and the rows that cannot be read, skipped and counted (`Skipped`), or,
with `data.strict`, refused at the first."""

from __future__ import annotations

from lora_llama.errors import BadRecord, UserError

# Each data format and the shapes it reads, as the columns of each, in the order `format: auto` tries them: the first
# shape whose columns a record has wins. A format's first shape holds the columns it reads once data.fields and
# ShareGPT's conversations are renamed: a record without one of them is a bad row.
FORMATS = {
    "preference": (("prompt", "chosen", "rejected"), ("chosen", "rejected")),  # trl's explicit and implicit prompt
    "unpaired": (("prompt", "completion", "label"),),  # trl's unpaired preference (KTO)
    "chat": (("messages",), ("conversations",)),  # OpenAI / transformers messages, ShareGPT
    "prompt-completion": (("prompt", "completion"),),  # trl's, standard or conversational
    "alpaca": (("instruction", "output"),),
    "text": (("text",),),
}
SHOWN_ROWS = 5  # row numbers a summary line names per reason
ROW = "__row__"  # the column load_splits adds: each record's row in its source, counted from 1


def detect_format(columns: list[str]) -> str:
    """The data format the columns fit (FORMATS' order), or one line naming the columns seen."""
    for fmt, shapes in FORMATS.items():
        if any(set(shape) <= set(columns) for shape in shapes):
            return fmt
    raise UserError(
        f"cannot tell the data's shape from its columns ({', '.join(columns) or 'none'}): it is none of messages, "
        "conversations (ShareGPT), prompt/completion, instruction/output (Alpaca), text, prompt/chosen/rejected, "
        "prompt/completion/label; set data.fields to map your columns, or data.format"
    )


def rename_fields(record: dict, fields: dict[str, str]) -> dict:
    """The record with `data.fields`' columns also under their standard names, and ShareGPT's conversations as
    messages."""
    record = {k: v for k, v in record.items() if k != ROW}
    record = {**record, **{std: record[col] for std, col in fields.items() if col in record}}
    if "conversations" in record and "messages" not in record:
        record["messages"] = record["conversations"]
    return record


def sft_record(record: dict, fmt: str, fields: dict[str, str]) -> dict:
    """The record with the columns its format reads, or BadRecord (a column missing or null)."""
    record = rename_fields(record, fields)
    needs(record, FORMATS[fmt][0])
    return record


def needs(record: dict, columns) -> None:
    """BadRecord when the record lacks one of the columns, or has it null."""
    for column in columns:
        if record.get(column) is None:
            raise BadRecord(f"no {column!r}" if column not in record else f"a null {column!r}")


def row_of(record: dict, index: int) -> int:
    """The record's row in its source (ROW, counted from 1), else its place in the split."""
    return record.get(ROW, index + 1)


class Skipped:
    """The rows of one source that could not be read, by reason, with their numbers; `strict` refuses the first."""

    def __init__(self, source: str, strict: bool = False):
        self.source, self.strict, self.rows = source, strict, {}

    def add(self, index: int, reason: str) -> None:
        if self.strict:
            raise UserError(f"data {self.source}: row {index}: {reason} (data.strict: true stops at a bad row)")
        self.rows.setdefault(reason, []).append(index)

    def __len__(self) -> int:
        return sum(len(rows) for rows in self.rows.values())

    def report(self, total: int, log) -> None:
        """One warning line, when rows were skipped: how many, and for each reason how many and which (the first
        few)."""
        if not self.rows:
            return
        parts = []
        for reason, rows in self.rows.items():
            shown = ", ".join(map(str, rows[:SHOWN_ROWS])) + (", ..." if len(rows) > SHOWN_ROWS else "")
            parts.append(f"{len(rows)} with {reason} (row{'s' if len(rows) > 1 else ''} {shown})")
        log(f"warning: skipped {len(self)} of {total} rows of {self.source}: " + "; ".join(parts))
