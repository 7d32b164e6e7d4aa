"""GRPO's rollouts: a group of completions per prompt, sampled through the model as it stands (model/generate.py),
scored by the reward functions, as rows for the loss (packed with data.packing).

With tools (train.grpo.tools, train.grpo.environment) a completion runs over several turns, as trl's tool loop
does: the model's turn, its calls answered (objectives/grpo/tools.py) and the answers added as `tool` messages in the
chat template's form, the model's next turn, until a turn calls nothing or max_tool_calling_iterations rounds of
calls are answered. The tools' tokens are context, not output: no loss and no KL on them (trl's tool_mask), and a
completion's length counts the model's tokens alone. The rewards get the completion as messages (trl's
conversational form) and, with an environment, `environments=`, one per completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lora_llama.data.prompts import prompt_ids
from lora_llama.data.sft import collate, pack
from lora_llama.data.templates import TAGGED_CALL, tool_calls, tool_suffix_ids
from lora_llama.errors import UserError
from lora_llama.labels import IGNORE_INDEX
from lora_llama.model.generate import sample_completions, sample_turns
from lora_llama.objectives.grpo.rewards import by_completion, load_reward, score_turns
from lora_llama.objectives.grpo.tools import Toolbox, answer_calls, load_environment, load_tools


def completion_seed(seed: int, generation: int, index: int, sample: int) -> int:
    """One sampling seed per completion: its prompt, its place in the group, the generation step."""
    return ((seed * 1_000_003 + generation) * 1_000_033 + index) * 1_009 + sample


@dataclass
class Sampled:
    """A batch's completions: token ids, the prompt rows they continue and, over several turns, which tokens are
    the model's (1) and which a tool's (0), the model's turn each token is of or follows, the messages, the
    environments and the tool counts."""

    ids: list[list[int]]
    rows: list[dict]
    mask: list[list[int]] | None = None
    turn_of: list[list[int]] | None = None
    messages: list[list[dict]] | None = None
    environments: list | None = None
    calls: list[int] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)


class Rollouts:
    """GRPO's batches: group_size completions of each prompt, sampled through the model as it stands and scored
    by the reward functions, as training rows (the completion's tokens are the targets; none of a truncated one
    with mask_truncated, none of a tool's), one completion to a row or several packed to a row (data.packing)."""

    def __init__(
        self,
        settings,
        tokenizer,
        eos_ids: list[int],
        seed: int,
        packing: bool = False,
        max_seq_len: int = 0,
        system_prompt: str | None = None,
    ):
        self.settings, self.tokenizer, self.eos_ids, self.seed = settings, tokenizer, list(eos_ids), seed
        self.packing, self.max_seq_len = packing, max_seq_len
        self.reward_functions = dict(load_reward(spec) for spec in settings.rewards)
        self.episodes = None  # with tools: the completions run over several turns
        if settings.tools or settings.environment:
            self.episodes = ToolEpisodes(settings, tokenizer, eos_ids, system_prompt)
            environment = self.episodes.environment
            if environment is not None and callable(getattr(environment, "get_reward", None)):
                self.reward_functions[environment.__name__] = environment_reward
        self.any_rank = None  # under fsdp: Ranks.any, so that every rank decodes as many steps
        self.row_length = None  # the training rows' length rule (objectives/base.bucketed_length when compiled)

    def complete(self, model, prompts: list[dict], generation: int | None) -> Sampled:
        """group_size sampled completions per prompt (greedy, one each, when generation is None: eval)."""
        s = self.settings
        group = 1 if generation is None else s.group_size
        rows = [p for p in prompts for _ in range(group)]
        seeds = None
        if generation is not None:
            seeds = [completion_seed(self.seed, generation, p["index"], j) for p in prompts for j in range(group)]
        temperature = 0.0 if generation is None else s.temperature
        pad_id = self.tokenizer.pad_token_id
        if self.episodes is not None:
            if self.any_rank is not None:  # fsdp: every rank would have to run as many turns and prefills
                raise UserError("train.grpo.tools / environment run on one process or under ddp, not fsdp")
            return self.episodes.run(model, rows, seeds, temperature, group)
        sampling = dict(temperature=temperature, top_p=s.top_p, seeds=seeds, group=group, any_rank=self.any_rank)
        ids = [r["prompt_ids"] for r in rows]
        return Sampled(sample_completions(model, ids, s.max_new_tokens, self.eos_ids, pad_id, **sampling), rows)

    def rewards(self, sampled: Sampled) -> torch.Tensor:
        """(rows, functions, turns) rewards (score_turns); completions reach the functions in the form of their
        prompt (as messages over several turns)."""
        rows, completions = sampled.rows, sampled.ids
        prompts = [r["prompt"] for r in rows]
        if sampled.messages is not None:
            shaped = sampled.messages
        else:
            texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
            shaped = [
                t if isinstance(p, str) else [{"role": "assistant", "content": t}] for t, p in zip(texts, prompts)
            ]
        columns = {k: [r["columns"][k] for r in rows] for k in rows[0]["columns"]} if rows else {}
        if sampled.environments is not None:
            columns["environments"] = sampled.environments
        columns["completion_ids"] = completions
        return score_turns(self.reward_functions, prompts, shaped, columns, sampled.turns or None)

    def batch(self, model, prompts: list[dict], generation: int) -> dict:
        """One micro-batch's completions as training rows, with their rewards, lengths, truncation and tool counts."""
        sampled = self.complete(model, prompts, generation)
        ends, n = set(self.eos_ids), self.settings.max_new_tokens
        completions, rows = sampled.ids, sampled.rows
        masks = sampled.mask or [[1] * len(c) for c in completions]
        truncated = [len(c) == n and c[-1] not in ends for c in completions]
        by_turn = self.settings.credit == "turn"
        examples = []
        for i, (row, c, mask, cut) in enumerate(zip(rows, completions, masks, truncated)):
            masked = cut and self.settings.mask_truncated
            targets = [IGNORE_INDEX if masked or not mine else t for t, mine in zip(c, mask)]
            prompt = len(row["prompt_ids"])
            examples.append({"input_ids": row["prompt_ids"] + c, "labels": [IGNORE_INDEX] * prompt + targets})
            if by_turn:
                examples[-1]["turn"] = [0] * prompt + sampled.turn_of[i]
        batch = self.rows(examples)
        table = self.rewards(sampled)
        batch["rewards"] = by_completion(table)
        if by_turn:  # for objectives/grpo/credit.py
            batch["turn_rewards"], batch["turns"] = table, torch.tensor(sampled.turns)
        batch["lengths"] = torch.tensor([sum(m) for m in masks], dtype=torch.float32)
        batch["truncated"] = torch.tensor(truncated, dtype=torch.float32)
        if self.episodes is not None:
            batch["tools"] = torch.tensor([sampled.calls, sampled.failures, sampled.turns], dtype=torch.float32).T
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
        if "turn" in examples[0]:  # each position's turn, laid out as the rows lay out the examples
            lengths = [len(r["input_ids"]) for r in (packed if self.packing else examples)]
            flat = torch.tensor([t for e in examples for t in e["turn"]])
            batch["turn"] = torch.zeros_like(batch["input_ids"])
            for r, piece in enumerate(flat.split(lengths)):
                batch["turn"][r, : len(piece)] = piece
        return batch


class ToolEpisodes:
    """Completions over several turns, the tools answering between them (see the module's docstring)."""

    def __init__(self, settings, tokenizer, eos_ids: list[int], system_prompt: str | None = None):
        self.settings, self.tokenizer, self.eos_ids, self.system_prompt = settings, tokenizer, eos_ids, system_prompt
        self.functions, self.environment = load_tools(settings.tools), load_environment(settings.environment)

    def run(self, model, rows: list[dict], seeds, temperature: float, group: int) -> Sampled:
        """Completions over several turns, the tools answering between them (see the module's docstring)."""
        s, tok = self.settings, self.tokenizer
        environments = [self.environment() for _ in rows] if self.environment is not None else None
        toolboxes = [Toolbox(self.functions, env) for env in environments or [None] * len(rows)]
        prompts = [r["prompt_ids"] for r in rows]
        if environments is not None:  # reset(**row) starts each episode; its text joins the user's message
            told = [env.reset(prompt=r["prompt"], **r["columns"]) for env, r in zip(environments, rows)]
            prompts = [
                p if t is None else self._prompt_ids(r, t, b.schemas)
                for p, r, t, b in zip(prompts, rows, told, toolboxes)
            ]
            group = group if all(t is None for t in told) else 1
        messages = [[] for _ in rows]
        counts = {"calls": [0] * len(rows), "failures": [0] * len(rows), "rounds": [0] * len(rows)}
        limit = s.max_tool_calling_iterations

        def respond(indices: list[int], turns: list[list[int]]) -> list[list[int] | None]:
            asked = []
            for i, turn in zip(indices, turns):
                text = tok.decode(turn, skip_special_tokens=True)
                calls, unreadable = tool_calls(text)
                messages[i].append(assistant_message(text, calls))
                if (calls or unreadable) and (limit is None or counts["rounds"][i] < limit):
                    asked.append((i, calls, unreadable))
            answered = answer_calls([(toolboxes[i], c, u) for i, c, u in asked], s.tool_timeout_s)
            added = dict.fromkeys(indices)
            for (i, calls, unreadable), (tool_messages, failures) in zip(asked, answered):
                counts["calls"][i] += len(calls) + len(unreadable)
                counts["failures"][i] += failures
                counts["rounds"][i] += 1
                messages[i].append(tool_messages)  # kept aside until known to fit (below)
                added[i] = tool_suffix_ids(tok, tool_messages)
            return [added[i] for i in indices]

        sampling = dict(temperature=temperature, top_p=s.top_p, seeds=seeds, group=group)
        pieces = sample_turns(model, prompts, s.max_new_tokens, self.eos_ids, tok.pad_token_id, respond, **sampling)
        for row, said in zip(pieces, messages):  # a last turn cut by max_new_tokens was never handed to respond
            turns = [piece for piece, mine in row if mine]
            if len(turns) > sum(isinstance(m, dict) for m in said) and turns[-1]:
                text = tok.decode(turns[-1], skip_special_tokens=True)
                said.append(assistant_message(text, tool_calls(text)[0]))
        ids = [[t for piece, _ in row for t in piece] for row in pieces]
        mask = [[int(mine) for piece, mine in row for _ in piece] for row in pieces]
        return Sampled(
            ids,
            [{**r, "prompt_ids": p} for r, p in zip(rows, prompts)],
            mask,
            [turn_indices(row) for row in pieces],
            [conversation(m, sum(not mine for _, mine in row)) for m, row in zip(messages, pieces)],
            environments,
            counts["calls"],
            counts["failures"],
            [sum(mine for _, mine in row) for row in pieces],
        )

    def _prompt_ids(self, row: dict, told: str | None, schemas: list[dict]) -> list[int]:
        """A row's prompt rendered with its tools, with the environment's text after the user's last message."""
        prompt = row["prompt"]
        if told is not None:
            prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
            prompt[-1]["content"] += told
        return prompt_ids(self.tokenizer, prompt, row["index"], self.system_prompt, schemas)


def turn_indices(pieces: list[tuple[list[int], bool]]) -> list[int]:
    """Each token's model turn (0 first): a turn's own tokens, and a tool's answer the turn before it."""
    out, turn = [], -1
    for piece, mine in pieces:
        turn += mine
        out += [max(turn, 0)] * len(piece)
    return out


def assistant_message(text: str, calls: list[dict]) -> dict:
    """An assistant turn as trl's conversational form has it: its text without the calls, and the calls."""
    message = {"role": "assistant", "content": TAGGED_CALL.sub("", text).strip() if calls else text}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": c} for c in calls]
    return message


def conversation(entries: list, added: int) -> list[dict]:
    """A completion's messages: its assistant turns with the tool answers that made it into the completion (the
    first `added` rounds; a round that would not fit was never added)."""
    messages, rounds = [], 0
    for entry in entries:
        if isinstance(entry, list):  # one round of tool messages
            rounds += 1
            if rounds <= added:
                messages += entry
        else:
            messages.append(entry)
    return messages


def environment_reward(environments, **_) -> list[float | None]:
    """An environment's own score of its episode (its get_reward), as trl adds it to the rewards."""
    return [e.get_reward() for e in environments]
