"""`train_from_recipe`: what `lora-llama train` runs — check the inputs and the run folder, load the
tokenizer, data and adapted model, hand them to the `Trainer`."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import sys
from functools import partial
from pathlib import Path

import torch

from lora_llama.data.cache import cached_examples, examples_key
from lora_llama.data.chat import end_of_turn_id
from lora_llama.data.sources import mix, mixture_line, source_sections
from lora_llama.data.streaming import StreamedExamples, streamed_val
from lora_llama.data.templates import use_chat_template
from lora_llama.errors import UserError
from lora_llama.files.json_files import read_config
from lora_llama.files.shards import shard_files
from lora_llama.harness.tasks import check_tasks, task_manager
from lora_llama.kernels import fused
from lora_llama.loading.adapted import adapted_model, loads_by_rows
from lora_llama.loading.models import ModelSource, load_tokenizer, model_source
from lora_llama.lora.init import moves_w0
from lora_llama.model.config import family_of, torch_dtype
from lora_llama.objectives.base import bucket_lengths
from lora_llama.objectives.catalog import objective_named
from lora_llama.quant.handlers import chosen_format
from lora_llama.quant.linear import base_weight_bytes
from lora_llama.runtime.allocator import keep_freed_memory, return_freed_memory
from lora_llama.runtime.auto import base_dtype, compile_options, resolve_compile, resolve_precision, resolve_quantize
from lora_llama.runtime.distributed import Ranks, choose_strategy, local_bytes, setup, shard_model, teardown
from lora_llama.training.run_evals import RunEvals
from lora_llama.training.run_folder import (
    ADAPTER,
    METRICS,
    SAMPLES,
    benchmark_file,
    checkpoints,
    remove_leftovers,
    run_lock,
    write_run_recipe,
)
from lora_llama.training.trackers import check_trackers
from lora_llama.training.trainer import Trainer


def train_from_recipe(recipe, resume: bool = False, force: bool = False, log=None) -> dict:
    """Everything `lora-llama train` does, in one process or in each of torchrun's (rank 0 holds the
    run folder's lock and writes; the others only compute). `log` receives one line per message."""
    out = Path(recipe.output.dir)
    ranks, device = setup(recipe.model.device, recipe.train.collective_timeout_s)
    say = (log or _say) if ranks.main else (lambda *_: None)
    try:
        with run_lock(out) if ranks.main else contextlib.nullcontext():
            return _train(recipe, out, resume, force, say, ranks, device)
    finally:
        teardown()


def _train(recipe, out: Path, resume: bool, force: bool, log, ranks: Ranks, device: str) -> dict:
    """Inputs are all checked before the run folder is touched."""
    check_trackers(recipe.train.report_to)
    tasks = task_manager(recipe.eval.include_path) if recipe.eval.tasks else None  # lm-eval's index, read once
    if tasks:  # an unknown task stops the run before the model loads
        check_tasks(tasks, recipe.eval.tasks)
    found = _check_run_folder(recipe, out, resume, force)
    # resolved once for the run and passed to every loader; a GGUF source is converted into its cached folder by
    # rank 0 while the others wait, then found there
    source = model_source(recipe.model.source) if ranks.main else None
    ranks.barrier()
    source = source or model_source(recipe.model.source)
    precision, why = resolve_precision(recipe.train.precision, device)
    recipe, quantize_why = _quantize_resolved(recipe, precision, device, source)
    strategy = _choose_strategy(recipe, ranks, device, source)
    sharded = ranks.world > 1 and strategy == "fsdp"
    recipe, compile_why = _compile_resolved(recipe, device, sharded)
    torch.manual_seed(recipe.train.seed)
    random.seed(recipe.train.seed)
    tok = use_chat_template(load_tokenizer(source), recipe.data.chat_template)
    train, val, mixture = _examples(recipe, tok, log)
    # loading's weight-sized temporaries (conversions, quantization) go back at once; the steps' memory is kept below
    allocator = return_freed_memory() if device == "cpu" else None
    by_rows = sharded and loads_by_rows(recipe.lora)  # each rank reads only its own rows of the base
    resume_from = found[-1] / ADAPTER if found and not (force and not resume) else None
    m = recipe.model
    model, summary = adapted_model(
        source,
        recipe.lora,
        resume_from,
        base_dtype(precision, torch_dtype(m.dtype)),
        chosen_format(m),
        "cpu" if sharded and not by_rows else device,
        ranks if sharded else None,
    )
    _set_model_options(model, recipe)
    found = _prepare_run_folder(recipe, out, found, resume, force, ranks, mixture)
    if sharded and not by_rows:  # the adapter went in before fsdp cuts it into shards
        shard_model(model)
    if allocator and not sharded:
        allocator = keep_freed_memory()
    evals = _run_evals(recipe, tok, tasks, out, ranks, log)
    trainer = Trainer(recipe, model, tok, train, val, out, ranks, report=log, evals=evals)
    log(
        f"model {recipe.model.source}: {summary['total']:,} parameters, {summary['trainable']:,} trainable "
        f"({summary['percent']:.3f}%) on {device}"
        + (f", {ranks.world} processes ({strategy})" if ranks.world > 1 else "")
    )
    reasons = {"model.quantize": quantize_why, "train.compile": compile_why}
    _describe_setup(log, recipe, model, (precision, why), reasons, allocator, device, sharded)
    shown = f"{len(recipe.data.sources)} sources" if recipe.data.sources else recipe.data.source
    size = f"{len(train)}" if isinstance(train, list) else "streamed"
    log(f"data {shown}: {size} train / {len(val)} val examples; {trainer.total} steps")
    _warn_if_stop_untrained(log, recipe, model, tok)
    if found:
        trainer.resume(found[-1])
        log(f"resuming from {found[-1]} (step {trainer.step})")
    return trainer.fit()


def _examples(recipe, tok, log) -> tuple[list[dict], list[dict], dict | None]:
    """(train, val, the mixture's record for metrics.jsonl or None): the objective's examples from each source,
    the training ones drawn together by weight (data/sources.py)."""
    objective, sections = objective_named(recipe.train.objective), source_sections(recipe.data)
    if recipe.data.streaming:
        return StreamedExamples(sections, tok, recipe.train.seed, log), streamed_val(recipe.data, tok, log), None
    parts = [_source_examples(objective, recipe.model_copy(update={"data": data}), tok, log) for *_, data in sections]
    if not recipe.data.sources:
        return (*parts[0], None)
    names, weights = [name for name, *_ in sections], [weight for _, weight, _ in sections]
    train, counts = mix([p[0] for p in parts], weights, recipe.train.seed)
    log(mixture_line(names, weights, [len(p[0]) for p in parts], counts))
    record = {"step": 0, **{f"data/{i}/rows": n for i, n in enumerate(counts)}}
    return train, [e for p in parts for e in p[1]], record


def _source_examples(objective, recipe, tok, log) -> tuple[list[dict], list[dict]]:
    """One source's (train, val) examples, from the cache of tokenized examples when they are there."""
    if not objective.cached:
        return objective.examples(recipe, tok, log)
    t = recipe.train
    settings = getattr(t, objective.name).model_dump() if objective.settings else None
    parts = {"data": recipe.data.model_dump(), "objective": objective.name, "settings": settings, "seed": t.seed}
    key = examples_key(parts, tok, recipe.data.source)
    return cached_examples(key, lambda: objective.examples(recipe, tok, log), log)


def _say(message: str) -> None:
    """Print above tqdm's progress bar rather than through it."""
    from tqdm.auto import tqdm

    tqdm.write(message)
    sys.stdout.flush()  # a line a supervisor (or a test) waits for is there at once


def _run_evals(recipe, tok, tasks, out: Path, ranks: Ranks, log) -> RunEvals | None:
    """The recipe's `eval` section as the trainer's extra evals (None when it asks for nothing); tasks: lm-eval's
    TaskManager that checked eval.tasks."""
    e = recipe.eval
    if not (e.tasks or e.prompts):
        return None
    return RunEvals(e, tok, tasks, partial(benchmark_file, out), out / SAMPLES, ranks.main, log)


def _check_run_folder(recipe, out: Path, resume: bool, force: bool) -> list[Path]:
    """The run folder's checkpoints; a finished or foreign folder is refused without --force."""
    found = checkpoints(out)
    if (out / ADAPTER).exists() and not force and not resume:
        raise UserError(f"{out} holds a finished run; pass --force to start over or choose another output.dir")
    if out.exists() and any(out.iterdir()) and not found and not force:
        raise UserError(
            f"{out} exists and holds no checkpoints; pass --force to start over or choose another output.dir"
        )
    return found


def _quantize_resolved(recipe, precision: str, device: str, source: ModelSource):
    """(the recipe with model.quantize auto replaced by the kind it picks here, why). The run folder's
    recipe.yaml records that kind, which `merge --onto dequantized` reads."""
    m = recipe.model
    kind, why = resolve_quantize(
        m.quantize, precision, device, source.gguf is not None, moves_w0(recipe.lora.init_lora_weights)
    )
    return recipe.model_copy(update={"model": m.model_copy(update={"quantize": kind})}), why


def _compile_resolved(recipe, device: str, sharded: bool):
    """(the recipe with train.compile auto replaced by what it picks here, why)."""
    on, why = resolve_compile(recipe.train.compile, device, sharded)
    return recipe.model_copy(update={"train": recipe.train.model_copy(update={"compile": on})}), why


def _choose_strategy(recipe, ranks: Ranks, device: str, source: ModelSource) -> str:
    weight_bytes = sum(f.stat().st_size for f in shard_files(source.folder))
    strategy = choose_strategy(recipe.train.distributed, ranks, device, weight_bytes, bool(recipe.model.quantize))
    if ranks.world > 1 and strategy == "fsdp":
        if "lm_head" in recipe.lora.targets:  # the chunked loss runs lm_head outside the model's backward
            raise UserError(
                "train.distributed=fsdp with lora.targets lm_head is not supported; use ddp, or drop lm_head"
            )
        if recipe.lora.modules_to_save or recipe.lora.trainable_token_indices:
            raise UserError(
                "train.distributed=fsdp with lora.modules_to_save or lora.trainable_token_indices is not supported; "
                "use ddp"
            )
        if family_of(read_config(source.folder)).experts:  # fsdp's loading by rows knows no stacked experts
            if recipe.train.distributed != "fsdp":
                return "ddp"
            raise UserError("train.distributed=fsdp on a mixture of experts is not supported; use ddp")
    return strategy


def _set_model_options(model, recipe) -> None:
    t = recipe.train
    model.gradient_checkpointing = t.gradient_checkpointing
    model.offload_activations = t.offload_activations
    if t.compile:  # resolved by _train: auto is true or false by now
        device = str(next(model.parameters()).device)
        model.compile_blocks(
            **compile_options(sum(p.numel() for p in model.parameters()), device, t.gradient_checkpointing)
        )


def _prepare_run_folder(
    recipe, out: Path, found: list[Path], resume: bool, force: bool, ranks: Ranks, first: dict | None = None
) -> list[Path]:
    """Start over under --force (unless resuming), clear what a killed run half wrote, write the resolved
    recipe and, starting afresh, `first` as metrics.jsonl's first line; returns the checkpoints still to resume
    from. The other ranks wait until the folder is ready."""
    if force and out.exists() and not (resume and found):
        found = []
        if ranks.main:
            shutil.rmtree(out)
    if ranks.main:
        out.mkdir(parents=True, exist_ok=True)
        remove_leftovers(out)
        write_run_recipe(out, recipe)
        if first and not found:
            (out / METRICS).write_text(json.dumps(first) + "\n")
    ranks.barrier()
    return found


def _describe_setup(
    log, recipe, model, precision_why: tuple, reasons: dict[str, str], allocator, device: str, sharded: bool
) -> None:
    """reasons: why each setting named (model.quantize, train.compile) has its value; those `auto` picked are said."""
    m, (precision, why) = recipe.model, precision_why
    dtype = str(base_dtype(precision, torch_dtype(m.dtype))).removeprefix("torch.")
    log(f"base weights: {base_weight_bytes(model) / 1e6:.1f} MB ({m.quantize or dtype}); precision {precision} ({why})")
    values = {"model.quantize": m.quantize or "null", "train.compile": str(recipe.train.compile).lower()}
    for key, reason in reasons.items():
        if reason.startswith("auto"):
            log(f"{key} {values[key]} ({reason})")
    if allocator:
        log(f"allocator: {allocator}")
    if recipe.train.compile is True:
        lengths = bucket_lengths(recipe.data.max_seq_len)
        params, replayed = sum(p.numel() for p in model.parameters()), ""
        if compile_options(params, device, recipe.train.gradient_checkpointing):
            replayed = ", each replayed as a CUDA graph"
        log(
            f"train.compile: rows padded to {', '.join(map(str, lengths))} tokens, so each decoder block compiles "
            f"a graph for {len(lengths)} row length{'s' if len(lengths) > 1 else ''} at most (per micro-batch "
            f"size){replayed}"
        )
    if precision == "bf16-mixed" and device == "cpu" and fused.ENABLED:
        log(
            "bf16 on the CPU: RMSNorm and SwiGLU run as C loops, built for this CPU on first use "
            "(about a second; kept on disk for later runs)"
        )
    if sharded:
        frozen = [p for p in model.parameters() if not p.requires_grad]
        log(
            f"fsdp: each rank holds {local_bytes(frozen) / 1e6:.3f} MB of the base's "
            f"{sum(p.numel() * p.element_size() for p in frozen) / 1e6:.3f} MB of frozen weights"
        )


def _warn_if_stop_untrained(log, recipe, model, tok) -> None:
    lora, stop = recipe.lora, end_of_turn_id(tok)
    trained = lora.modules_to_save or lora.trainable_token_indices or "lm_head" in lora.targets
    if not trained and looks_untrained(model, stop):
        rows = f"[{stop}]" if model.args.tie_word_embeddings else f"{{embed_tokens: [{stop}], lm_head: [{stop}]}}"
        log(
            f"warning: the token that ends an assistant turn ({tok.convert_ids_to_tokens(stop)}, id {stop}) "
            "looks untrained in this base (its embedding or lm_head row is near zero) and both stay frozen: "
            f"the model may never learn to stop; set lora.trainable_token_indices: {rows} "
            "(or lora.modules_to_save: [embed_tokens, lm_head]), or start from an instruct model"
        )


def looks_untrained(model, token_id: int | None) -> bool:
    """Whether a token's embedding or lm_head row is far below the others (< 0.1 x the median row norm),
    as the chat tokens of base checkpoints are that never saw them (base Qwen's <|im_end|>)."""
    if token_id is None:
        return False
    rows = {model.model.embed_tokens.weight, model.lm_head.weight}
    return any(
        float(norms[token_id]) < 0.1 * float(norms.median()) for norms in (w.detach().float().norm(dim=1) for w in rows)
    )
