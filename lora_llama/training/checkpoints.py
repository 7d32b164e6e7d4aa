"""A run's training checkpoints, `checkpoints/step-N/`: the adapter, the optimizer, the schedule, the RNG, the
objective's state and the data position, written whole or not at all, and read back so that a resumed run
continues bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

from lora_llama.errors import UserError
from lora_llama.files.atomic import atomic_dir, write_text_atomic
from lora_llama.files.json_files import read_json, write_json
from lora_llama.loading.adapters import CHAT_TEMPLATE, save_adapter
from lora_llama.lora.adapted import lora_state_dict
from lora_llama.runtime.distributed import Ranks, full, full_optimizer_state, load_optimizer_state
from lora_llama.training.run_folder import (
    ADAPTER,
    LOSS_PLOT,
    METRICS,
    SAMPLES,
    TRAINER_STATE,
    checkpoint_dir,
    checkpoints,
    load_state,
    plot_losses,
    rng_state,
    save_state,
    set_rng_state,
    truncate_metrics,
)


def whole_adapter(model) -> dict:
    """The adapter's tensors under native names, shards gathered (a collective under fsdp)."""
    return {k: full(v) for k, v in lora_state_dict(model).items()}


class Checkpoints:
    """The checkpoints of one run folder, for a run with the recipe's `train` section on `ranks`."""

    def __init__(self, out: Path, train, ranks: Ranks, chat_template: str | None = None):
        self.out, self.train, self.ranks = Path(out), train, ranks
        self.chat_template = chat_template  # data.chat_template's text: the adapter keeps it, for generate and merge

    def save(self, step: int, total: int, model, optimizer, scheduler, objective) -> Path:
        """checkpoints/step-N, written by rank 0 (a kill mid-write leaves the previous one); the adapter and
        optimizer are the same on every rank, so the folder is what one process writes. Keeps train.keep_last."""
        folder, t = checkpoint_dir(self.out, step), self.train
        adapter, optimizer_state = whole_adapter(model), full_optimizer_state(optimizer)  # every rank: gathered
        if self.ranks.main:
            state = {"optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "rng": rng_state()}
            if objective_state := objective.state():
                state["objective"] = objective_state
            position = {
                "step": step,
                "micro_batches_done": step * t.grad_accum,
                "total_steps": total,
                "batch_size": t.batch_size,
                "grad_accum": t.grad_accum,
                "world_size": self.ranks.world,
            }
            with atomic_dir(folder, force=True) as tmp:
                save_adapter(model, tmp / ADAPTER, force=True, tensors=adapter, plain=False)  # to resume from
                save_state(tmp, state)
                write_json(tmp / TRAINER_STATE, position)
            for old in checkpoints(self.out)[: -t.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        self.ranks.barrier()
        return folder

    def finish(self, model, reporting) -> Path:
        """The run's final adapter, run/adapter, in the PEFT format, and the loss plot of the objective's figures
        (rank 0)."""
        adapter = whole_adapter(model)
        if self.ranks.main:
            save_adapter(model, self.out / ADAPTER, force=True, tensors=adapter)
            if self.chat_template:
                write_text_atomic(self.out / ADAPTER / CHAT_TEMPLATE, self.chat_template)
            plot_losses(self.out / METRICS, self.out / LOSS_PLOT, reporting)
        self.ranks.barrier()
        return self.out / ADAPTER

    def restore(self, folder: Path, total: int, optimizer, scheduler, objective, device) -> int:
        """The optimizer, schedule, RNG and objective state of a checkpoint, and its step (its adapter is loaded
        by the caller, before fsdp shards the model); metrics logged after that step are dropped."""
        state = load_state(folder)
        saved = read_json(folder / TRAINER_STATE)
        step = saved.get("step")
        check_global_batch(saved, self.train, self.ranks.world, folder)
        if not isinstance(step, int) or not 0 < step <= total:
            raise UserError(f"{folder / TRAINER_STATE}: step {step!r} does not fit this run of {total} steps")
        try:
            load_optimizer_state(optimizer, state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            objective.load_state(state.get("objective"), device)
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise UserError(f"{folder}: the trainer state does not fit this run ({type(e).__name__}: {e})") from None
        if self.ranks.main:
            truncate_metrics(self.out / METRICS, step)
            truncate_metrics(self.out / SAMPLES, step)
        return step


def check_global_batch(saved: dict, train, world: int, ckpt_dir) -> None:
    """A resume continues the same data order only with the same global micro-batch (batch_size x
    processes) and grad_accum; another number of processes is fine when batch_size makes up for it."""
    if "world_size" not in saved:  # a state without a process count comes from one process
        return
    before = saved["batch_size"] * saved["world_size"]
    if before == train.batch_size * world and saved["grad_accum"] == train.grad_accum:
        return
    hint = (
        f"resume with train.batch_size={before // world}"
        if before % world == 0
        else f"resume with a number of processes that divides {before}"
    )
    raise UserError(
        f"{ckpt_dir} was trained with global batch {saved['batch_size']} x {saved['world_size']} processes "
        f"x grad_accum {saved['grad_accum']}; this run would use {train.batch_size} x {world} x "
        f"{train.grad_accum}, which changes the data order: {hint} and train.grad_accum={saved['grad_accum']}"
    )
