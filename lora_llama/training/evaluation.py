"""`lora-llama eval` on documents: the next-token loss per token and its perplexity."""

from __future__ import annotations

from lora_llama.runtime.distributed import Ranks
from lora_llama.training.objectives import SFT


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
