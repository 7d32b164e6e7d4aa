"""What a run's evals add to the held-out loss (`RunEvals`): lm-eval's tasks and sample answers."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from lora_llama.data.chat import stop_token_ids
from lora_llama.data.prompts import prompt_ids
from lora_llama.files.atomic import write_text_atomic
from lora_llama.harness.tasks import metrics, run_tasks, to_json
from lora_llama.lora.adapted import adapters_disabled
from lora_llama.model.generate import sample_completions


def benchmark_metrics(results: dict) -> dict[str, float]:
    """lm-eval's results as metric lines: {"lm_eval/arc_easy/acc": 0.41, ...} (a filter other than lm-eval's
    default `none` stays in the name: `lm_eval/gsm8k/exact_match/strict-match`)."""
    return {
        f"lm_eval/{task}/{name.removesuffix(',none').replace(',', '/')}": value
        for (task, name), value in metrics(results).items()
    }


class RunEvals:
    """What a run's evals add to the held-out loss (the recipe's `eval` section): lm-eval's tasks on the base before
    training, on the adapter at the last step and every `eval.every` steps, each result in its file; greedy answers
    to `eval.prompts` at every eval, in the samples file and on the console. Every rank runs the tasks (under fsdp
    a forward needs them all); rank 0 writes."""

    def __init__(self, settings, tokenizer, manager, result_file, samples: Path, main: bool, report):
        """manager: lm-eval's TaskManager for eval.tasks; result_file(step): where a step's lm-eval results go;
        samples: the answers' JSONL file."""
        self.s, self.tokenizer, self.manager, self.main, self.report = settings, tokenizer, manager, main, report
        self.result_file, self.samples_file = result_file, Path(samples)
        # the prompts' ids, through the chat template when the tokenizer has one
        self.prompts = [prompt_ids(tokenizer, p, i) for i, p in enumerate(settings.prompts)]

    def __call__(self, model, step: int, last: bool) -> dict:
        due = step == 0 or last or (self.s.every and step % self.s.every == 0)
        record = self.tasks(model, step) if self.s.tasks and due else {}
        if self.s.prompts:
            self.samples(model, step)
        return record

    def tasks(self, model, step: int) -> dict:
        s = self.s
        options = dict(limit=s.limit, num_fewshot=s.num_fewshot, chat=s.chat, batch_size=s.batch_size)
        training = model.training
        with adapters_disabled(model) if step == 0 else contextlib.nullcontext():  # step 0: the base model's
            results = run_tasks(model, self.tokenizer, list(s.tasks), self.manager, **options)
        model.train(training)
        if self.main:
            self.result_file(step).parent.mkdir(exist_ok=True)
            write_text_atomic(self.result_file(step), to_json(results) + "\n")
        return benchmark_metrics(results)

    def samples(self, model, step: int) -> None:
        tok = self.tokenizer
        stops = stop_token_ids(tok, model.args.eos_token_id, model.folder)
        answers = sample_completions(model, self.prompts, self.s.max_new_tokens, stops, tok.pad_token_id, 0.0)
        texts = [tok.decode(a, skip_special_tokens=True).strip() for a in answers]
        if self.main:
            with open(self.samples_file, "a") as f:
                f.write(json.dumps({"step": step, "samples": dict(zip(self.s.prompts, texts))}) + "\n")
            self.report(f"step {step}: {self.s.prompts[0]!r} -> {texts[0]!r}")
