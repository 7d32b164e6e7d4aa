"""`Trainer`: fits a LoRA adapter on examples — the optimiser step over accumulated micro-batches, and the loop
with its eval, metrics, checkpoints (`checkpoints.py`) and stop requests. It reports through a callback and
writes only into its run folder."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from lora_llama.data.chat import stop_token_ids
from lora_llama.errors import UserError
from lora_llama.model.moe import router_loss
from lora_llama.objectives.catalog import build_objective
from lora_llama.runtime.distributed import Ranks, clip_grad_norm, replicated, sharded, sum_shard_gradients
from lora_llama.training.batches import micro_batches
from lora_llama.training.checkpoints import Checkpoints
from lora_llama.training.run_folder import (
    CHECKPOINTS,
    METRICS,
    MetricsLog,
    checkpoints,
    eval_at_start,
    stop_requests,
)
from lora_llama.training.schedule import lr_lambda, total_steps


class Trainer:
    """Fits a LoRA adapter on a recipe's data; checkpoints so that a resumed run continues bit for bit."""

    def __init__(
        self,
        recipe,
        model,
        tokenizer,
        train,
        val: list[dict],
        out: Path,
        ranks: Ranks = Ranks(),
        report=None,
        evals=None,
    ):
        self.recipe, self.model, self.ranks, self.evals = recipe, model, ranks, evals  # evals: RunEvals or None
        self.report = report or (lambda message: None)  # one line per event (eval results, a stop)
        eos_ids = stop_token_ids(tokenizer, model.args.eos_token_id, model.folder)
        self.objective = build_objective(recipe, tokenizer, eos_ids)
        self.sharded = sharded(model)  # fsdp: blocks are shards
        self.val_examples, self.out = val, Path(out)
        t = recipe.train
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(model, t)
        self.pad_id = tokenizer.pad_token_id
        self.micro_batches = micro_batches(
            train, t.batch_size, t.seed, ranks, self.objective, self.pad_id, self.sharded
        )
        per_epoch = self.micro_batches.per_epoch
        self.total = total_steps(t, per_epoch * self.objective.repeats if per_epoch else None)
        self.checkpoints = Checkpoints(self.out, t, ranks, recipe.data.chat_template and tokenizer.chat_template)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.schedule, t.warmup_steps, self.total)
        )
        self.step = 0
        self.metrics: MetricsLog | None = None  # opened by fit, once the step it resumes from is known

    def train_step(self) -> tuple[float, int, dict]:
        """Forward/backward over grad_accum micro-batches, each loss term divided by its count (targets, pairs) on all
        ranks, gradients summed over ranks: one update on the global batch. (loss, tokens but padding, stats)"""
        t, obj = self.recipe.train, self.objective
        data_step, ga = self.step // obj.repeats, t.grad_accum  # GRPO trains num_iterations steps on each generation
        batches = [b for b in (self.micro_batches[data_step * ga + k] for k in range(ga)) if b is not None]
        batches = obj.prepare(self.model, batches, self.step, self.ranks)
        local_tokens = sum(int(b.get("tokens", b["input_ids"].numel())) for b in batches)  # padding is not counted
        counts = [obj.counts(b) for b in batches]  # before the batches move: counting on a GPU would wait for it
        *totals, tokens = self.ranks.sum([sum(c[i] for c in counts) for i in range(obj.n_counts)] + [local_tokens])
        losses, stats = [], dict.fromkeys(obj.stat_names, 0.0)
        for batch in batches:
            terms, batch_stats = obj.terms(self.model, _to(batch, self.device))
            balance = router_loss(self.model, len(batches) * self.ranks.world)  # a mixture's load balancing, or 0
            loss = sum((term / max(n, 1) for term, n in zip(terms, totals)), balance)
            loss.backward()
            losses.append(loss.detach())
            stats = {k: stats[k] + batch_stats[k] for k in stats}
        local_loss = float(torch.stack(losses).sum()) if losses else 0.0  # the step's one wait for the device
        bad = not math.isfinite(local_loss)
        if self.ranks.any(bad):  # every rank stops before the update, together
            raise UserError(
                f"non-finite loss ({local_loss if bad else 'on another rank'}) at step {self.step + 1}; "
                f"stopped before the update. The last good checkpoint is kept in {self.out / CHECKPOINTS}"
            )
        clipped = update(self.params, self.optimizer, self.scheduler, self.ranks, self.sharded, t.max_grad_norm)
        self.step += 1
        loss, *stat_sums = self.ranks.sum([local_loss, *stats.values()])
        return loss, int(tokens), {**obj.summarize(dict(zip(stats, stat_sums)), totals, self.ranks), **clipped}

    def save_checkpoint(self) -> Path:
        return self.checkpoints.save(self.step, self.total, self.model, self.optimizer, self.scheduler, self.objective)

    def resume(self, folder: Path) -> None:
        """Continue from a checkpoint (its adapter is loaded by the caller, before fsdp shards the model)."""
        self.step = self.checkpoints.restore(
            folder, self.total, self.optimizer, self.scheduler, self.objective, self.device
        )

    def run_eval(self) -> dict | None:
        """The held-out loss (or reward), and what the recipe's `eval` section adds; None when there is neither."""
        batch_size, val = self.recipe.train.batch_size, self.val_examples
        r = self.objective.evaluate(self.model, val, batch_size, self.pad_id, self.ranks) if val else {}
        record = {"step": self.step, **{f"eval_{k}": v for k, v in r.items() if k != self.objective.counted}}
        record.update(self.evals(self.model, self.step, self.step == self.total) if self.evals else {})
        if len(record) > 1:
            self.metrics.write(record)
        return record if len(record) > 1 else None

    def fit(self) -> dict:
        """Train to the end. SIGTERM (preemption) or Ctrl-C stop at the next step boundary with a
        checkpoint and raise KeyboardInterrupt; the same command then resumes. A second Ctrl-C stops at once."""
        from tqdm.auto import tqdm

        t = self.recipe.train
        self.model.train()
        self.metrics = MetricsLog(self.out, self.step, self.ranks.main, t.report_to, self.recipe)
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
            self.metrics.close()
        adapter = self.checkpoints.finish(self.model, self.objective.reporting)
        start = eval_at_start(self.out / METRICS, self.objective.reporting)  # the base model's, also after a resume
        return {"steps": self.step, "adapter": str(adapter), **(last_eval or {}), **start}

    def _one_step(self, bar, t) -> None:
        start = time.perf_counter()
        loss, tokens, stats = self.train_step()
        tps = tokens / (time.perf_counter() - start)
        lr = self.scheduler.get_last_lr()[0]
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}")
        if self.step % t.log_every == 0 or self.step == self.total:
            self.metrics.write({"step": self.step, "loss": loss, **stats, "lr": lr, "tokens_per_s": tps})

    def _after_step(self, bar, t) -> dict | None:
        if not (self.step % t.eval_every == 0 or self.step == self.total):
            return None
        record = self.run_eval()
        if record and self.ranks.main:
            self.report(f"step {self.step}: " + " ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
        return record


def update(params, optimizer, scheduler, ranks: Ranks, sharded: bool, max_grad_norm: float | None) -> dict:
    """The optimiser step on gradients summed over ranks (fsdp reduces its blocks' own), clipped when asked:
    {"grad_norm": their global norm before clipping} (a float, or a 0-d tensor left on the device until a metrics
    line reads it), {} without clipping."""
    ranks.sum_gradients(replicated(params) if sharded else params)
    if sharded:
        sum_shard_gradients(params, ranks)
    norm = None
    if max_grad_norm and sharded:
        norm = clip_grad_norm(params, max_grad_norm, ranks)
    elif max_grad_norm:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {} if norm is None else {"grad_norm": norm}


def make_optimizer(model, train) -> torch.optim.AdamW:
    # fused: one kernel for all adapter tensors (CPU: 2.0 vs 8.1 ms a step for the default recipe's 240 tensors)
    groups = param_groups(model, train.lr, train.loraplus_lr_ratio)
    return torch.optim.AdamW(groups, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, fused=True)


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
