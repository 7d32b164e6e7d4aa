"""`Trainer`: fits a LoRA adapter on examples — optimiser, schedule, accumulation, eval, checkpoint /
resume, metrics — so that a resumed run continues bit for bit. It reports through a callback and
writes only into its run folder."""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import torch

from lora_llama.data.chat import stop_token_ids
from lora_llama.errors import UserError
from lora_llama.files import atomic_dir, read_json, write_json
from lora_llama.loading.adapters import save_adapter
from lora_llama.lora.layer import lora_state_dict
from lora_llama.runtime.distributed import (
    Ranks,
    check_global_batch,
    clip_grad_norm,
    full,
    full_optimizer_state,
    load_optimizer_state,
    replicated,
    sharded,
    sum_shard_gradients,
)
from lora_llama.training.evaluation import evaluate
from lora_llama.training.objectives import make_objective
from lora_llama.training.run_folder import (
    ADAPTER,
    CHECKPOINTS,
    LOSS_PLOT,
    METRICS,
    TRAINER_STATE,
    checkpoints,
    load_state,
    plot_losses,
    read_metrics,
    rng_state,
    save_state,
    set_rng_state,
    stop_requests,
    tensorboard,
    truncate_metrics,
)
from lora_llama.training.schedule import lr_lambda, total_steps


class Trainer:
    """Fits a LoRA adapter on a recipe's data; checkpoints so that a resumed run continues bit for bit."""

    def __init__(
        self,
        recipe,
        model,
        tokenizer,
        train: list[dict],
        val: list[dict],
        out: Path,
        ranks: Ranks = Ranks(),
        report=None,
    ):
        self.recipe, self.model, self.ranks = recipe, model, ranks
        self.report = report or (lambda message: None)  # one line per event (eval results, a stop)
        self.objective = make_objective(
            recipe.train, tokenizer, stop_token_ids(tokenizer, model.args.eos_token_id, model.folder), recipe.data
        )
        self.sharded = sharded(model)  # fsdp: blocks are shards
        self.train_examples, self.val_examples, self.out = train, val, Path(out)
        t = recipe.train
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel for all adapter tensors (CPU: 2.0 vs 8.1 ms a step for the default recipe's 240 tensors)
        self.optimizer = torch.optim.AdamW(
            param_groups(model, t.lr, t.loraplus_lr_ratio),
            lr=t.lr,
            betas=tuple(t.betas),
            weight_decay=t.weight_decay,
            fused=True,
        )
        # a micro-batch is global: batch_size examples on each rank
        self.batches_per_epoch = math.ceil(len(train) / (t.batch_size * ranks.world))
        self.total = total_steps(t, self.batches_per_epoch * self.objective.repeats)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.schedule, t.warmup_steps, self.total)
        )
        self.step = 0
        self.pad_id = tokenizer.pad_token_id
        self.tb = None  # opened by fit, once the step it resumes from is known

    # ---------------------------------------------------------------- data order

    def micro_batch(self, index: int) -> dict | None:
        """This rank's share of the index-th global micro-batch, on the host: a fresh seeded shuffle each epoch, so
        a position is all resume needs, and the order is the one-process order whatever the number of ranks.
        None when the last micro-batch of an epoch leaves this rank nothing."""
        bs = self.recipe.train.batch_size
        glob = bs * self.ranks.world
        epoch, i = divmod(index, self.batches_per_epoch)
        order = torch.randperm(
            len(self.train_examples), generator=torch.Generator().manual_seed(self.recipe.train.seed + epoch)
        )
        chosen = [self.train_examples[j] for j in self.ranks.share(order[i * glob : (i + 1) * glob].tolist(), bs)]
        if not chosen and self.sharded:  # fsdp's gathers are collectives: every rank runs every micro-batch
            chosen = [self.objective.empty]
        return self.objective.collate(chosen, self.pad_id) if chosen else None  # on the host: counted there

    # ---------------------------------------------------------------- one optimiser step

    def train_step(self) -> tuple[float, int, dict]:
        """Forward/backward over grad_accum micro-batches; each loss term is divided by its count (targets,
        pairs) over all of them on all ranks, and the gradients summed over ranks: one process's update on the
        global batch. Returns the loss, the tokens seen and the objective's statistics (preference: per pair)."""
        ga, obj = self.recipe.train.grad_accum, self.objective
        data_step = self.step // obj.repeats  # GRPO trains num_iterations steps on each generation
        batches = [b for b in (self.micro_batch(data_step * ga + k) for k in range(ga)) if b is not None]
        batches = obj.prepare(self.model, batches, self.step, self.ranks)
        local_tokens = sum(int(b["input_ids"].numel()) for b in batches)
        counts = [obj.counts(b) for b in batches]  # before the batches move: counting on a GPU would wait for it
        *totals, tokens = self.ranks.sum([sum(c[i] for c in counts) for i in range(obj.n_counts)] + [local_tokens])
        losses, stats = [], dict.fromkeys(obj.stat_names, 0.0)
        for batch in batches:
            terms, batch_stats = obj.terms(self.model, _to(batch, self.device))
            loss = sum(t / max(n, 1) for t, n in zip(terms, totals))
            loss.backward()
            losses.append(loss.detach())
            stats = {k: stats[k] + batch_stats[k] for k in stats}
        local_loss = float(torch.stack(losses).sum()) if losses else 0.0  # the step's one wait for the device
        bad = not math.isfinite(local_loss)
        if self.ranks.any(bad):  # every rank stops before the update, together
            raise UserError(
                f"non-finite loss ({local_loss if bad else 'on another rank'}) at step {self.step + 1}; "
                f"stopped before the update. The last good checkpoint is kept in {self.out / 'checkpoints'}"
            )
        self.ranks.sum_gradients(replicated(self.params) if self.sharded else self.params)  # fsdp reduces its own
        if self.sharded:
            sum_shard_gradients(self.params, self.ranks)
        if self.recipe.train.max_grad_norm and self.sharded:
            clip_grad_norm(self.params, self.recipe.train.max_grad_norm, self.ranks)
        elif self.recipe.train.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.recipe.train.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        loss, *stat_sums = self.ranks.sum([local_loss, *stats.values()])
        return loss, int(tokens), obj.summarize(dict(zip(stats, stat_sums)), totals, self.ranks)

    # ---------------------------------------------------------------- checkpoints

    def save_checkpoint(self) -> Path:
        """checkpoints/step-N, written whole or not at all (a kill mid-write leaves the previous one), by rank 0;
        the adapter and optimizer are the same on every rank, so the folder is what one process writes."""
        ckpt_dir = self.out / CHECKPOINTS / f"step-{self.step}"
        t = self.recipe.train
        adapter, optimizer = self.whole_adapter(), full_optimizer_state(self.optimizer)  # every rank: shards gathered
        if self.ranks.main:
            with atomic_dir(ckpt_dir, force=True) as tmp:
                save_adapter(self.model, tmp / ADAPTER, force=True, tensors=adapter, plain=False)  # to resume from
                save_state(
                    tmp,
                    {
                        "optimizer": optimizer,
                        "scheduler": self.scheduler.state_dict(),
                        "rng": rng_state(),
                        **({"objective": obj} if (obj := self.objective.state()) else {}),
                    },
                )
                write_json(
                    tmp / TRAINER_STATE,
                    {
                        "step": self.step,
                        "micro_batches_done": self.step * t.grad_accum,
                        "total_steps": self.total,
                        "batch_size": t.batch_size,
                        "grad_accum": t.grad_accum,
                        "world_size": self.ranks.world,
                    },
                )
            for old in checkpoints(self.out)[: -t.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        self.ranks.barrier()
        return ckpt_dir

    def whole_adapter(self) -> dict:
        """The adapter's tensors under native names, shards gathered (a collective under fsdp)."""
        return {k: full(v) for k, v in lora_state_dict(self.model).items()}

    def resume(self, ckpt_dir: Path) -> None:
        """The optimizer, schedule, RNG and data position of a checkpoint (its adapter is loaded by the caller,
        before fsdp shards the model)."""
        state = load_state(ckpt_dir)
        saved = read_json(ckpt_dir / TRAINER_STATE)
        step = saved.get("step")
        check_global_batch(saved, self.recipe.train, self.ranks.world, ckpt_dir)
        if not isinstance(step, int) or not 0 < step <= self.total:
            raise UserError(f"{ckpt_dir / TRAINER_STATE}: step {step!r} does not fit this run of {self.total} steps")
        try:
            load_optimizer_state(self.optimizer, state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            self.objective.load_state(state.get("objective"), self.device)
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise UserError(f"{ckpt_dir}: the trainer state does not fit this run ({type(e).__name__}: {e})") from None
        self.step = step
        if self.ranks.main:
            truncate_metrics(self.out / METRICS, self.step)

    # ---------------------------------------------------------------- the loop

    def log(self, record: dict) -> None:
        if not self.ranks.main:
            return
        with open(self.out / METRICS, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb:
            for k, v in record.items():
                if k != "step":
                    self.tb.add_scalar(k, v, record["step"])

    def run_eval(self) -> dict | None:
        if not self.val_examples:
            return None
        if hasattr(self.objective, "evaluate"):  # GRPO: the reward of greedy completions
            r = self.objective.evaluate(self.model, self.val_examples, self.recipe.train.batch_size, self.ranks)
        else:
            r = evaluate(
                self.model, self.val_examples, self.recipe.train.batch_size, self.pad_id, self.ranks, self.objective
            )
        record = {"step": self.step, **{f"eval_{k}": v for k, v in r.items() if k not in ("tokens", "pairs")}}
        self.log(record)
        return record

    def fit(self) -> dict:
        """Train to the end. SIGTERM (preemption) or Ctrl-C stop at the next step boundary with a
        checkpoint and raise KeyboardInterrupt; the same command then resumes. A second Ctrl-C stops at once."""
        from tqdm.auto import tqdm

        t = self.recipe.train
        self.model.train()
        self.tb = tensorboard(self.out, self.step) if self.ranks.main else None
        last_eval = None
        if self.step == 0:
            last_eval = self.run_eval()  # the starting point of the eval curve
        bar = tqdm(
            total=self.total,
            initial=self.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not self.ranks.main,
        )
        saved_at = self.step
        try:
            with stop_requests() as stop:
                while self.step < self.total:
                    if self.ranks.any(bool(stop)):  # every rank stops at the same step
                        raise KeyboardInterrupt(stop[0] if stop else "a stop on another rank")
                    self._one_step(bar, t)
                    last_eval = self._after_step(bar, t) or last_eval
                    if self.step % t.save_every == 0 or self.step == self.total:
                        self.save_checkpoint()
                        saved_at = self.step
        except KeyboardInterrupt as e:
            bar.close()
            why = f"stopped by {e.args[0]}" if e.args else "interrupted"
            path = self.save_checkpoint() if self.step > saved_at else (checkpoints(self.out) or [None])[-1]
            self.report(
                f"{why} at step {self.step}: "
                + (f"saved {path}; run the same command again to resume" if path else "no checkpoint yet")
            )
            raise
        finally:
            bar.close()
            if self.tb:
                self.tb.close()
        adapter = self.whole_adapter()
        if self.ranks.main:
            save_adapter(self.model, self.out / ADAPTER, force=True, tensors=adapter)
            plot_losses(self.out / METRICS, self.out / LOSS_PLOT)
        self.ranks.barrier()
        result = {"steps": self.step, "adapter": str(self.out / ADAPTER), **(last_eval or {})}
        for key in ("eval_loss", "eval_reward"):  # the base model's, also after a resume
            start = [r[key] for r in read_metrics(self.out / METRICS) if r["step"] == 0 and key in r]
            if start:
                result[f"{key}_start"] = start[0]
        return result

    def _one_step(self, bar, t) -> None:
        start = time.perf_counter()
        loss, tokens, stats = self.train_step()
        tps = tokens / (time.perf_counter() - start)
        lr = self.scheduler.get_last_lr()[0]
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
        if self.step % t.log_every == 0 or self.step == self.total:
            self.log({"step": self.step, "loss": loss, **stats, "lr": lr, "tokens_per_s": tps})

    def _after_step(self, bar, t) -> dict | None:
        if not (self.step % t.eval_every == 0 or self.step == self.total):
            return None
        record = self.run_eval()
        if record and self.ranks.main:
            self.report(f"step {self.step}: " + " ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
        return record


def param_groups(model, lr: float, loraplus_lr_ratio: float | None) -> list[dict]:
    """The trained tensors as AdamW's groups: one, or with LoRA+ two, B and every 1-D tensor (DoRA's magnitudes)
    at loraplus_lr_ratio x lr, as peft's create_loraplus_optimizer groups them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not loraplus_lr_ratio:
        return [{"params": [p for _, p in named]}]
    fast = {n for n, p in named if "lora_B" in n or p.dim() == 1}
    return [
        {"params": [p for n, p in named if n not in fast]},
        {"params": [p for n, p in named if n in fast], "lr": lr * loraplus_lr_ratio},
    ]


def _to(batch: dict, device) -> dict:
    """The batch on `device`; from the host to a GPU through pinned memory, asynchronously (a copy from pageable
    memory would first wait for the GPU's queue: a host sync per micro-batch)."""
    cuda = torch.device(device).type == "cuda"

    def move(t):
        return t.pin_memory().to(device, non_blocking=True) if cuda and t.device.type == "cpu" else t.to(device)

    return {k: move(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
