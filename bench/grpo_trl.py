"""The peer of bench/grpo.py: trl's GRPOTrainer with peft on recipes/smollm2-grpo-cpu.yaml's model, prompts, reward
and settings (its batch counts completions: batch_size x group_size). Prints one JSON line: the seconds of each
step, the completions' mean length per step and the peak memory."""

import argparse
import json
import time

import torch

from bench.common import status_mb
from bench.grpo import RECIPE


def _prompt(r, prompt):
    """The prompt as build_prompts renders it: a system turn first when the recipe gives one (with tools, always
    as messages: trl's tools loop reads conversations)."""
    tools = r.train.grpo.tools
    if not r.data.system_prompt and not (tools and isinstance(prompt, str)):
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not r.data.system_prompt:
        return messages
    return [{"role": "system", "content": r.data.system_prompt}, *messages]


def _reward(fn, entries):
    """A reward that reads the `entry` column gets it by index: arrow would rewrite the entries' tuples."""

    def reward(prompts, completions, index, **kw):
        return fn(prompts, completions, **kw, **({"entry": [entries[i] for i in index]} if entries else {}))

    reward.__name__ = getattr(fn, "__name__", "reward")
    return reward


def _model_and_tokenizer(r):
    """transformers' model and tokenizer of the recipe's source (with data.chat_template), and its tool functions:
    with tools, the tokenizer reads calls through trl's response template for the chatml-tools (Qwen) form."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_llama.data.templates import use_chat_template
    from lora_llama.loading.models import resolve_source
    from lora_llama.objectives.grpo.tools import load_tools

    source = resolve_source(r.model.source)  # the installed SmolLM2 GGUF is read by transformers' own loader
    where = dict(gguf_file=source.name) if source.suffix == ".gguf" else {}
    folder = source.parent if source.suffix == ".gguf" else source
    tok = use_chat_template(AutoTokenizer.from_pretrained(folder, **where), r.data.chat_template)
    model = AutoModelForCausalLM.from_pretrained(folder, **where, dtype=torch.float32)
    tools = load_tools(r.train.grpo.tools)
    if tools:
        from trl.chat_template_utils import qwen3_template

        tok.response_template = qwen3_template
    return model, tok, tools


def trl_trainer(r, steps: int, precision: str, device: str, out: str):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from lora_llama.data.prompts import build_prompts
    from lora_llama.model.config import LINEAR_NAMES
    from lora_llama.objectives.grpo.rewards import load_reward
    from lora_llama.objectives.grpo.tools import listed_tools

    model, tok, tools = _model_and_tokenizer(r)
    train, _ = build_prompts(
        r.data,
        tok,
        r.train.seed,
        r.data.max_seq_len - r.train.grpo.max_new_tokens,
        log=lambda *_: None,
        tools=listed_tools(r.train.grpo, tok),
    )
    entries = [p["columns"].get("entry") for p in train] if "entry" in train[0]["columns"] else None
    rewards = [_reward(load_reward(spec)[1], entries) for spec in r.train.grpo.rewards]
    g, t = r.train.grpo, r.train
    cfg = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=t.batch_size * g.group_size,
        num_generations=g.group_size,
        max_completion_length=g.max_new_tokens,
        temperature=g.temperature,
        beta=g.beta,
        epsilon=g.epsilon,
        loss_type=g.loss_type,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        max_steps=steps,
        bf16=precision == "bf16-mixed",
        use_cpu=device == "cpu",
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=t.seed,
        max_tool_calling_iterations=g.max_tool_calling_iterations,
    )
    lora = LoraConfig(
        r=r.lora.r,
        lora_alpha=r.lora.alpha,
        lora_dropout=r.lora.dropout,
        target_modules=[LINEAR_NAMES[x] for x in r.lora.targets],
        task_type="CAUSAL_LM",
    )
    columns = lambda p: {k: v for k, v in p["columns"].items() if k != "entry"}  # noqa: E731
    rows = [{"prompt": _prompt(r, p["prompt"]), "index": i, **columns(p)} for i, p in enumerate(train)]
    return GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=cfg,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=lora,
        tools=tools or None,
    )


def main():
    from transformers import TrainerCallback

    from bench.common import scratch_dir
    from lora_llama.recipe.schema import load_recipe

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("overrides", nargs="*", help="recipe overrides (key.path=value)")
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(2)
    recipe = load_recipe(str(RECIPE), a.overrides)
    trainer = trl_trainer(recipe, a.steps, a.precision, a.device, str(scratch_dir("trl-grpo-")))
    times, lengths = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    trainer.add_callback(Timer())
    trainer.train()
    print(
        json.dumps(
            {
                "step_s": times,
                "mean_length": lengths,
                "peak_mb": status_mb("VmHWM"),
                "gpu_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0,
            }
        )
    )


if __name__ == "__main__":
    main()
