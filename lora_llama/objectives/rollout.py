"""GRPO's rollouts: a group of completions per prompt, sampled through the model as it stands (model/generate.py),
scored by the reward functions, as rows for the loss (packed with data.packing)."""

from __future__ import annotations

import torch

from lora_llama.data.sft import collate, pack
from lora_llama.labels import IGNORE_INDEX
from lora_llama.model.generate import sample_completions
from lora_llama.objectives.rewards import load_reward, score


def completion_seed(seed: int, generation: int, index: int, sample: int) -> int:
    """One sampling seed per completion: its prompt, its place in the group, the generation step."""
    return ((seed * 1_000_003 + generation) * 1_000_033 + index) * 1_009 + sample


class Rollouts:
    """GRPO's batches: group_size completions of each prompt, sampled through the model as it stands and scored
    by the reward functions, as training rows (the completion's tokens are the targets; none of a truncated one
    with mask_truncated), one completion to a row or several packed to a row (data.packing)."""

    def __init__(self, settings, tokenizer, eos_ids: list[int], seed: int, packing: bool = False, max_seq_len: int = 0):
        self.settings, self.tokenizer, self.eos_ids, self.seed = settings, tokenizer, list(eos_ids), seed
        self.packing, self.max_seq_len = packing, max_seq_len
        self.reward_functions = dict(load_reward(spec) for spec in settings.rewards)
        self.any_rank = None  # under fsdp: Ranks.any, so that every rank decodes as many steps
        self.row_length = None  # the training rows' length rule (objectives/base.bucketed_length when compiled)

    def complete(self, model, prompts: list[dict], generation: int | None) -> tuple[list[list[int]], list[dict]]:
        """group_size sampled completions per prompt (greedy, one each, when generation is None: eval)."""
        s = self.settings
        group = 1 if generation is None else s.group_size
        rows = [p for p in prompts for _ in range(group)]
        seeds = None
        if generation is not None:
            seeds = [completion_seed(self.seed, generation, p["index"], j) for p in prompts for j in range(group)]
        temperature = 0.0 if generation is None else s.temperature
        prompt_ids = [r["prompt_ids"] for r in rows]
        pad_id = self.tokenizer.pad_token_id
        sampling = dict(temperature=temperature, top_p=s.top_p, seeds=seeds, group=group, any_rank=self.any_rank)
        return sample_completions(model, prompt_ids, s.max_new_tokens, self.eos_ids, pad_id, **sampling), rows

    def rewards(self, rows: list[dict], completions: list[list[int]]) -> torch.Tensor:
        """(rows, functions) rewards; completions reach the functions in the form of their prompt."""
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        prompts = [r["prompt"] for r in rows]
        shaped = [t if isinstance(p, str) else [{"role": "assistant", "content": t}] for t, p in zip(texts, prompts)]
        columns = {k: [r["columns"][k] for r in rows] for k in rows[0]["columns"]} if rows else {}
        return score(self.reward_functions, prompts, shaped, {**columns, "completion_ids": completions})

    def batch(self, model, prompts: list[dict], generation: int) -> dict:
        """One micro-batch's completions as training rows, with their rewards, lengths and truncation."""
        completions, rows = self.complete(model, prompts, generation)
        ends = set(self.eos_ids)
        truncated = [len(c) == self.settings.max_new_tokens and c[-1] not in ends for c in completions]
        examples = []
        for row, c, cut in zip(rows, completions, truncated):
            masked = cut and self.settings.mask_truncated
            labels = [IGNORE_INDEX] * len(row["prompt_ids"]) + ([IGNORE_INDEX] * len(c) if masked else c)
            examples.append({"input_ids": row["prompt_ids"] + c, "labels": labels})
        batch = self.rows(examples)
        batch["rewards"] = self.rewards(rows, completions)
        batch["lengths"] = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        batch["truncated"] = torch.tensor(truncated, dtype=torch.float32)
        return batch

    def rows(self, examples: list[dict]) -> dict:
        """The completions as a batch, one per row or packed several to a row, each attending only to itself;
        `completion` (B, T) says which completion each position belongs to."""
        if not self.packing:
            batch = collate(examples, self.tokenizer.pad_token_id, self.row_length)
            batch["completion"] = torch.arange(len(examples))[:, None].expand_as(batch["input_ids"]).clone()
        else:
            packed = pack(examples, self.max_seq_len)
            batch = collate(packed, self.tokenizer.pad_token_id, self.row_length)
            firsts = torch.tensor([0] + [r["segment_ids"][-1] + 1 for r in packed]).cumsum(0)[:-1]
            batch["completion"] = (firsts[:, None] + batch["segment_ids"]).clamp(0, len(examples) - 1)  # padding: any
        batch["completions"] = torch.tensor(len(examples))
        return batch
