"""Kahneman-Tversky optimisation (trl's `KTOTrainer`, loss_type kto) on unpaired feedback: each example is one
completion of a prompt, labelled desirable (true) or undesirable (false); preference pairs are read as two
examples each, as trl reads them. The reference is the base with the adapter switched off.

Per example, with r = log π(y|x) - log ref(y|x) summed over the completion's tokens and z the KL estimate,

    desirable:   desirable_weight   · (1 - σ(β·(r - z)))
    undesirable: undesirable_weight · (1 - σ(β·(z - r)))

averaged over the examples. z is trl's: the mean of log π(y'|x) - log ref(y'|x) over mismatched pairs, clamped at
0, without gradient. The pairs are fixed with the data, as trl fixes them: each prompt with the completion of the
example before it (the first with the last); trl rotates within runs of its per-device batch and reads them in
order, lora-llama rotates over the whole split, so that the pairs do not depend on the number of processes. z is
taken over the step's global batch (trl takes it per micro-batch: the same with grad_accum 1), and on held-out
examples over all of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field

from lora_llama.data.loading import load_splits
from lora_llama.data.preference import as_messages, tokenize_answers
from lora_llama.data.records import Skipped, needs, rename_fields, row_of
from lora_llama.data.sft import EMPTY_EXAMPLE, Tokenize, collate, packed_sequences, tokenize_splits
from lora_llama.errors import BadRecord
from lora_llama.labels import IGNORE_INDEX
from lora_llama.lora.adapted import adapters_disabled
from lora_llama.objectives.base import Objective
from lora_llama.objectives.reporting import LOSS, Measure, Reporting
from lora_llama.objectives.token_losses import sequence_owner, sequence_targets, token_logps
from lora_llama.validation import Settings

UNPAIRED_FIELDS = ("prompt", "completion", "label")
# summed over examples; summarize turns them into trl's metrics
SUMS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "chosen", "rejected", "kl")


class KTOSettings(Settings):
    """Kahneman-Tversky optimisation on completions labelled desirable or undesirable (trl's names and defaults)."""

    beta: float = Field(0.1, gt=0, description="strength of the pull towards the reference")
    desirable_weight: float = Field(1.0, gt=0, description="weight of the desirable examples' losses")
    undesirable_weight: float = Field(1.0, gt=0, description="weight of the undesirable examples' losses")


def unpaired_records(rec: dict) -> list[dict]:
    """An unpaired record as it is; a preference pair as two, its chosen answer desirable and its rejected one
    not (trl's `unpair_preference_dataset`). BadRecord for anything else."""
    if rec.get("completion") is None and rec.get("chosen") is not None and rec.get("rejected") is not None:
        return [
            {**rec, "completion": rec["chosen"], "label": True},
            {**rec, "completion": rec["rejected"], "label": False},
        ]
    needs(rec, UNPAIRED_FIELDS)
    if not isinstance(rec["label"], bool):
        raise BadRecord(f"a 'label' that is not true or false ({rec['label']!r})")
    return [rec]


def tokenize_unpaired(records, tokenizer, max_seq_len: int, train_on_prompt=False, fields=None, skipped=None):
    """Every record -> examples with their `label`, and the rows skipped."""
    tokenize = Tokenize(tokenizer, "chat", max_seq_len, train_on_prompt)
    examples, skipped = [], skipped if skipped is not None else Skipped("the data")
    for i, record in enumerate(records):
        try:
            for rec in unpaired_records(rename_fields(record, fields or {})):
                prompt = as_messages(rec["prompt"], "user", "prompt", i)
                completion = as_messages(rec["completion"], "assistant", "completion", i)
                answer = tokenize_answers(tokenize, prompt, {"completion": completion})
                if isinstance(answer, str):
                    raise BadRecord(answer)
                examples.append({**answer["completion"], "label": rec["label"]})
        except BadRecord as e:
            skipped.add(row_of(record, i), str(e))
    return examples, skipped


def with_mismatched(examples: list[dict], run: int, max_len: int) -> list[dict]:
    """The examples, each with the row of its KL pair (`mismatched`): its prompt and the completion of the
    example before it in its run of `run` examples (the first with the last's)."""
    out = []
    for start in range(0, len(examples), max(run, 1)):
        chunk = examples[start : start + run]
        for ex, other in zip(chunk, chunk[-1:] + chunk[:-1]):
            prompt, completion = ex["input_ids"][: ex["prompt_len"]], other["input_ids"][other["prompt_len"] :]
            labels = [IGNORE_INDEX] * len(prompt) + completion
            out.append({**ex, "mismatched": {"input_ids": (prompt + completion)[:max_len], "labels": labels[:max_len]}})
    return out


class KTO(Objective):
    """A batch holds B examples, then their B mismatched rows for the KL estimate; with data.packing, the examples
    packed into rows and the mismatched ones into rows of their own (their keys prefixed `kl_`)."""

    name, about, settings = "kto", "KTO on unpaired feedback (completions labelled desirable or not)", KTOSettings
    data_formats = {"unpaired": "prompt/completion/label", "preference": "prompt/chosen/rejected"}
    empty = {**EMPTY_EXAMPLE, "prompt_len": 0, "label": False, "mismatched": EMPTY_EXAMPLE}
    stat_names, n_counts, counted, packs = SUMS, 1, "examples", True
    reporting = Reporting(
        (
            LOSS,
            Measure("eval_rewards/margins", "reward margin (desirable minus undesirable)", higher_is_better=True),
            Measure("eval_rewards/chosen", "desirable reward", higher_is_better=True),
            Measure("eval_rewards/rejected", "undesirable reward", higher_is_better=False),
            Measure("eval_kl", "KL to the reference", higher_is_better=False),
        ),
        "held-out answers judged one at a time",
        curves=("rewards/chosen", "rewards/rejected", "rewards/margins"),
        loss_unit="per answer",
    )

    def __init__(self, settings: KTOSettings = KTOSettings()):
        self.s = settings
        self.held_out_kl: float | None = None  # the estimate on held-out examples, while they are evaluated

    @classmethod
    def examples(cls, recipe, tokenizer, log) -> tuple[list[dict], list[dict]]:
        data = recipe.data
        train_records, val_records = load_splits(data, recipe.train.seed)
        kw = dict(tokenizer=tokenizer, max_seq_len=data.max_seq_len, train_on_prompt=data.train_on_prompt)

        def tokenize(records, skipped):
            examples, _ = tokenize_unpaired(records, fields=data.fields, skipped=skipped, **kw)
            return with_mismatched(examples, len(examples), data.max_seq_len)

        return tokenize_splits(train_records, val_records, tokenize, data.source, "unpaired example", log, data.strict)

    def collate(self, examples: list[dict], pad_id: int) -> dict:
        rows = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
        mismatched = [e["mismatched"] for e in examples]
        if self.pack_to:
            batch = packed_sequences(rows, pad_id, self.pack_to, self.row_length)
            kl_rows = packed_sequences(mismatched, pad_id, self.pack_to, self.row_length)
            batch.update({f"kl_{k}": v for k, v in kl_rows.items()})
        else:
            batch = collate(rows + mismatched, pad_id, self.row_length)
        batch["label"] = torch.tensor([e["label"] for e in examples])
        return batch

    def length(self, example: dict) -> int:
        return len(example["input_ids"])

    def counts(self, batch: dict) -> list[int]:
        return [int((sequence_targets(examples_part(batch)) > 0).sum())]

    def prepare(self, model, batches: list[dict], step: int, ranks) -> list[dict]:
        """The KL estimate over the step's global batch, the same on every rank."""
        kl = kl_estimate([kl_sum(model, mismatched_part(b)) for b in batches], ranks)
        return [{**b, "kl": torch.tensor(kl)} for b in batches]

    def evaluate(self, model, examples: list[dict], batch_size: int, pad_id: int, ranks) -> dict:
        """The held-out loss with one KL estimate over all held-out examples, whatever the number of ranks."""
        rows = [e["mismatched"] for e in examples][ranks.rank :: ranks.world]
        rows += [EMPTY_EXAMPLE] * (math.ceil(len(examples) / ranks.world) - len(rows))  # as many batches each
        was_training = model.training
        model.eval()
        sums = [kl_sum(model, collate(rows[i : i + batch_size], pad_id)) for i in range(0, len(rows), batch_size)]
        model.train(was_training)
        self.held_out_kl = kl_estimate(sums, ranks)
        try:
            return super().evaluate(model, examples, batch_size, pad_id, ranks)
        finally:
            self.held_out_kl = None

    def terms(self, model, batch: dict) -> tuple[list[torch.Tensor], dict]:
        s, label = self.s, batch["label"].to(torch.bool)
        kl = batch["kl"].to(torch.float32) if "kl" in batch else torch.tensor(self.held_out_kl)
        main = examples_part(batch)
        with torch.no_grad(), adapters_disabled(model):
            reference = completion_logps(model, main)[0]
        policy, n_tokens = completion_logps(model, main)
        valid = n_tokens > 0
        ratio = policy - reference
        losses = torch.where(
            label,
            s.desirable_weight * (1 - F.sigmoid(s.beta * (ratio - kl))),
            s.undesirable_weight * (1 - F.sigmoid(s.beta * (kl - ratio))),
        )
        rewards, chosen, rejected = s.beta * ratio.detach(), label & valid, ~label & valid
        stats = {
            "rewards/chosen": float(rewards[chosen].sum()),
            "rewards/rejected": float(rewards[rejected].sum()),
            "logps/chosen": float(policy.detach()[chosen].sum()),
            "logps/rejected": float(policy.detach()[rejected].sum()),
            "chosen": float(chosen.sum()),
            "rejected": float(rejected.sum()),
            "kl": float(kl) * float(valid.sum()),
        }
        return [torch.where(valid, losses, 0.0).sum()], stats

    def summarize(self, stat_sums: dict, totals: list[int], ranks) -> dict:
        """trl's metrics: rewards and log-probabilities averaged over the desirable, the undesirable examples."""
        chosen, rejected = max(stat_sums["chosen"], 1), max(stat_sums["rejected"], 1)
        out = {
            "rewards/chosen": stat_sums["rewards/chosen"] / chosen,
            "rewards/rejected": stat_sums["rewards/rejected"] / rejected,
            "logps/chosen": stat_sums["logps/chosen"] / chosen,
            "logps/rejected": stat_sums["logps/rejected"] / rejected,
            "kl": stat_sums["kl"] / max(totals[0], 1),
        }
        return {**out, "rewards/margins": out["rewards/chosen"] - out["rewards/rejected"]}


ROW_KEYS = ("input_ids", "labels", "position_ids", "segment_ids", "sequence", "sequences")


def examples_part(batch: dict) -> dict:
    """The examples' rows of a KTO batch: its first B rows, or its packed ones."""
    if "sequence" in batch:
        return {k: batch[k] for k in ROW_KEYS}
    return {k: batch[k][: len(batch["label"])] for k in ("input_ids", "labels")}


def mismatched_part(batch: dict) -> dict:
    """The mismatched rows of a KTO batch, for the KL estimate: its last B rows, or its packed `kl_` ones."""
    if "kl_sequence" in batch:
        return {k: batch[f"kl_{k}"] for k in ROW_KEYS}
    return {k: batch[k][len(batch["label"]) :] for k in ("input_ids", "labels")}


def completion_logps(model, rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion: the summed log-probability of its target tokens, and their number."""
    places = (rows.get("position_ids"), rows.get("segment_ids"))
    logps, keep = token_logps(model, rows["input_ids"], rows["labels"], 1.0, *places)
    owner, n = sequence_owner(rows, keep)
    count = torch.zeros(n, dtype=torch.long, device=owner.device).index_add(0, owner, torch.ones_like(owner))
    return logps.new_zeros(n).index_add(0, owner, logps), count


@torch.no_grad()
def kl_sum(model, rows: dict) -> tuple[float, int]:
    """(the sum over mismatched rows of log π(y'|x) - log ref(y'|x), their number)."""
    device = next(model.parameters()).device
    rows = {k: v.to(device) for k, v in rows.items()}
    policy, n = completion_logps(model, rows)
    with adapters_disabled(model):
        reference = completion_logps(model, rows)[0]
    valid = n > 0
    return float((policy - reference)[valid].sum()), int(valid.sum())


def kl_estimate(sums: list[tuple[float, int]], ranks) -> float:
    """The mean of `kl_sum`s over every rank, clamped at 0 (trl's)."""
    total, n = ranks.sum([sum(s for s, _ in sums), sum(n for _, n in sums)])
    return max(total / max(n, 1), 0.0)
