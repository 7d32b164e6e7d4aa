"""The trl side of bench/train_step.py: trl's SFTTrainer on the same rows, its own loop, collator and metrics
included, with a callback that times each step and reads the process's memory."""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import reset_peak, scratch_dir, status_mb
from bench.train_step import hf_targets


def step_meter():
    """A TrainerCallback that times each optimiser step and takes the resident memory before training."""
    from transformers import TrainerCallback

    class Meter(TrainerCallback):
        def __init__(self):
            self.times, self.before, self.t = [], 0.0, 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.before = status_mb("VmRSS")
            reset_peak()

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)

    return Meter()


def sft_config(data: list, opts):
    from trl import SFTConfig

    return SFTConfig(
        output_dir=str(scratch_dir("lora-llama-trl-")),
        max_steps=len(data),
        per_device_train_batch_size=data[0][0].shape[0],
        learning_rate=1e-4,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        max_length=data[0][0].shape[1],
        dataset_kwargs={"skip_prepare_dataset": True},
        use_cpu=True,
        remove_unused_columns=False,
        gradient_checkpointing=opts.checkpointing,
        disable_tqdm=True,
    )


def trl_worker(ckpt: str, data: list, opts) -> dict:
    """trl's SFTTrainer on the same rows (its own loop, collator and metrics included)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import LlamaForCausalLM
    from trl import SFTTrainer

    from lora_llama import load_tokenizer

    rows = [{"input_ids": r.tolist(), "labels": lab.tolist()} for ids, labels in data for r, lab in zip(ids, labels)]
    meter = step_meter()
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    trainer = SFTTrainer(
        model=model,
        args=sft_config(data, opts),
        train_dataset=Dataset.from_list(rows),
        processing_class=load_tokenizer("smollm2-135m-instruct"),  # vocabulary 49152, as the model
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=hf_targets(opts)),
        callbacks=[meter],
    )
    trainer.train()
    median = statistics.median(meter.times[2:])
    peak = status_mb("VmHWM")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "kind": "trl SFTTrainer",
        "median_step_s": median,
        "step_times": meter.times[2:],
        "first_step_s": meter.times[0],
        "tokens_per_s": data[0][0].numel() / median,
        "first_loss": losses[0],
        "peak_rss_mb": peak,
        "step_memory_mb": peak - meter.before,
    }
