"""Supervised fine-tuning: cross-entropy per target token on text, instruction or chat data; and the same loss on
plain documents (`lora-llama eval`)."""

from __future__ import annotations

import torch

from lora_llama.data.sft import EMPTY_EXAMPLE, build_examples, collate
from lora_llama.labels import where_targets
from lora_llama.objectives.base import Objective
from lora_llama.objectives.token_losses import target_loss
from lora_llama.runtime.distributed import Ranks


class SFT(Objective):
    """Cross-entropy per target token."""

    name, about = "sft", "supervised fine-tuning (loss on the answers)"
    data_formats = {
        "text": "a `text` column",
        "alpaca": "instruction/input/output",
        "chat": "messages, or ShareGPT's conversations",
        "prompt-completion": "prompt/completion, strings or messages",
    }
    packs, streams, empty, stat_names, n_counts = True, True, EMPTY_EXAMPLE, (), 1

    @classmethod
    def examples(cls, recipe, tokenizer, log) -> tuple[list[dict], list[dict]]:
        return build_examples(recipe.data, tokenizer, recipe.train.seed, log)

    def collate(self, examples: list[dict], pad_id: int) -> dict:
        batch = collate(examples, pad_id, self.row_length)
        return {**batch, **where_targets(batch["labels"], batch.get("segment_ids"))}

    def length(self, example: dict) -> int:
        return len(example["input_ids"])

    def counts(self, batch: dict) -> list[int]:
        return [batch["targets"].numel()]

    def terms(self, model, batch: dict) -> tuple[list[torch.Tensor], dict]:
        places = batch.get("position_ids"), batch.get("segment_ids"), batch["targets"], batch["predicting"]
        return [target_loss(model, batch["input_ids"], batch["labels"], *places)[0]], {}


def evaluate_documents(model, tokenizer, docs: list[str], batch_size: int = 8) -> dict:
    """`lora-llama eval`: each document tokenised with the tokenizer's defaults, no EOS added.

    Documents longer than the model's context are cut into independent windows.
    """
    window = model.args.max_seq_len
    examples = []
    for doc in docs:
        ids = tokenizer(doc)["input_ids"]
        examples += [
            {"input_ids": ids[i : i + window], "labels": ids[i : i + window]} for i in range(0, len(ids), window)
        ]
    return SFT().evaluate(model, examples, batch_size, tokenizer.pad_token_id, Ranks())
