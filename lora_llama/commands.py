"""What each `lora-llama` sub-command does with its parsed arguments: call the library, print the result.

torch and transformers are imported inside the commands so `--help` answers at once.
"""

from __future__ import annotations

import json
import os
import sys

from lora_llama.errors import UserError
from lora_llama.model.config import torch_dtype
from lora_llama.runtime.launcher import speaks_for_job


def _load(args):
    """Model (with the adapter when given) and tokenizer for generate / eval."""
    from pathlib import Path

    from lora_llama.loading.adapted import adapted_model
    from lora_llama.loading.adapters import CHAT_TEMPLATE
    from lora_llama.loading.models import load_model, load_tokenizer
    from lora_llama.quant.handlers import chosen_format

    where = dict(dtype=torch_dtype(args.dtype), quantize=chosen_format(args), device=args.device)
    model = (
        adapted_model(args.model, adapter=args.adapter, **where)[0] if args.adapter else load_model(args.model, **where)
    )
    tok = load_tokenizer(args.model)
    kept = Path(args.adapter) / CHAT_TEMPLATE if args.adapter else None
    if kept is not None and kept.is_file():  # the template the adapter was trained with (data.chat_template)
        tok.chat_template = kept.read_text()
    return model, tok


def cmd_train(args) -> int:
    from lora_llama.recipe.schema import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # a bad recipe fails here, before any process starts
    if recipe.output.push_to_hub:  # no token fails now, not after hours of training
        from lora_llama.outputs.hub import resolve_token

        resolve_token(None)
    if "RANK" in os.environ:  # a worker of torchrun's: it ends with its launcher
        from lora_llama.runtime.launcher import die_with_parent

        die_with_parent()
    elif (args.nproc_per_node or 1) > 1 or args.nnodes > 1:
        from lora_llama.runtime.launcher import launch, launcher_args

        torchrun = launcher_args(
            args.nproc_per_node or 1, args.nnodes, args.node_rank, args.rdzv_endpoint, str(recipe.output.dir)
        )
        return launch(
            torchrun, ["train", args.recipe, *args.overrides] + ["--resume"] * args.resume + ["--force"] * args.force
        )
    from lora_llama.objectives.catalog import objective_named
    from lora_llama.training.from_recipe import train_from_recipe

    result = train_from_recipe(recipe, resume=args.resume, force=args.force)
    if not speaks_for_job():  # rank 0 reports for the job
        return 0
    headline = objective_named(recipe.train.objective).reporting.headline
    benchmarks = sorted(k for k in result if k.startswith("lm_eval/") and not k.endswith("_start"))
    for key in [headline.key, *benchmarks]:
        if f"{key}_start" in result and key in result:
            name = headline.name if key == headline.key else key.removeprefix("lm_eval/")
            step = result["step"]
            print(f"{name} {result[f'{key}_start']:.4f} (base model) -> {result[key]:.4f} (adapter, step {step})")
    if recipe.output.push_to_hub:
        from lora_llama.outputs.hub import push

        result["pushed"] = push(recipe.output.dir, recipe.output.push_to_hub)
    print(json.dumps(result))
    return 0


def _trained_quantize(args) -> dict:
    """quantize= for merge / export: the format --quantize names, or the one the run the adapter comes from
    trained on (its recipe's model section, beside run/adapter or run/checkpoints/step-N/adapter)."""
    from lora_llama.quant.handlers import chosen_format

    if args.quantize or args.onto != "dequantized" or not args.adapter:
        return {"quantize": chosen_format(args)}
    from lora_llama.training.run_folder import read_run_recipe, run_of_adapter

    return {"quantize": chosen_format(read_run_recipe(run_of_adapter(args.adapter)).get("model") or {})}


def _warnings_to_stderr(call):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return result


def cmd_merge(args) -> int:
    from lora_llama.outputs.merge import merge_checkpoint

    result = _warnings_to_stderr(
        lambda: merge_checkpoint(
            args.base,
            args.adapter,
            args.out,
            dtype=args.dtype,
            force=args.force,
            onto=args.onto,
            **_trained_quantize(args),
        )
    )
    print(
        f"merged into {result['out']}: {result['shards']} shards, {result['bytes'] / 1e6:.1f} MB "
        f"in {result['seconds']:.1f} s"
    )
    return 0


def cmd_export(args) -> int:
    from lora_llama.outputs.export import export_gguf, export_lora_gguf

    if args.lora_gguf:  # cli.check_combinations: --adapter without --out
        r = _warnings_to_stderr(
            lambda: export_lora_gguf(args.adapter, args.lora_gguf, base=args.base, force=args.force)
        )
        print(f"wrote {r['out']}: {r['tensors']} LoRA tensors, {r['bytes'] / 1e6:.1f} MB in {r['seconds']:.1f} s")
        return 0
    r = _warnings_to_stderr(
        lambda: export_gguf(
            args.base,
            args.out,
            adapter=args.adapter,
            out_type=args.type,
            force=args.force,
            onto=args.onto,
            **_trained_quantize(args),
        )
    )
    print(
        f"wrote {r['out']}: {r['tensors']} tensors, {r['bytes'] / 1e6:.1f} MB ({args.type}) in {r['seconds']:.1f} s; "
        f"{r['modelfile']} for `ollama create`"
    )
    return 0


def cmd_push(args) -> int:
    from lora_llama.outputs.hub import push

    push(
        args.path,
        args.repo_id,
        token=args.token,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
        dry_run=args.dry_run,
    )
    return 0


def _prompt_ids(args, tok, prompt: str) -> list[int]:
    from lora_llama.data.chat import encode_rendered

    if args.chat:
        if not tok.chat_template:
            raise UserError(f"{args.model} has no chat template; drop --chat")
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids, _ = encode_rendered(tok, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    else:
        ids = tok(prompt)["input_ids"]
    if not ids:
        raise UserError("the prompt is empty")
    return ids


def cmd_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from lora_llama.data.chat import eos_token_ids
    from lora_llama.lora.adapted import adapters_disabled
    from lora_llama.model.generate import generate

    model, tok = _load(args)
    settings = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_ids=eos_token_ids(model, tok),
        use_cache=not args.no_cache,
    )
    for prompt in args.prompt:
        ids = _prompt_ids(args, tok, prompt)
        if args.compare:
            with adapters_disabled(model):
                base = generate(model, ids, **settings)
            tuned = generate(model, ids, **settings)
            print(f"prompt:  {prompt}")
            print(f"base:    {tok.decode(base, skip_special_tokens=True).strip()}")
            print(f"adapter: {tok.decode(tuned, skip_special_tokens=True).strip()}\n", flush=True)
            continue
        streamer = TextStreamer(tok, skip_special_tokens=True)
        generate(model, ids, **settings, on_token=lambda t: streamer.put(torch.tensor([t])))
        streamer.end()
    return 0


def cmd_eval(args) -> int:
    if args.tasks is not None:
        return _eval_tasks(args)
    from lora_llama.data.loading import read_documents
    from lora_llama.objectives.sft import evaluate_documents

    model, tok = _load(args)
    docs = read_documents(args.data)
    if not docs:
        raise UserError(f"{args.data} holds no documents")
    result = evaluate_documents(model, tok, docs, batch_size=args.batch_size)
    print(json.dumps(result))
    return 0


def _eval_tasks(args) -> int:
    """lm-eval's tasks on the model (and with --compare, on the base too): its table printed, its JSON written."""
    import time
    from pathlib import Path

    from lora_llama.files.atomic import refuse_existing, write_text_atomic
    from lora_llama.harness.tasks import (
        check_tasks,
        comparison_table,
        run_base_and_adapter,
        run_tasks,
        task_manager,
        to_json,
    )

    tasks = [t for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks names no task")
    out = Path(args.output or time.strftime("lm-eval-%Y%m%d-%H%M%S.json"))
    refuse_existing(out, args.force)
    manager = task_manager(args.include_path)
    check_tasks(manager, tasks)  # before the model loads
    model, tok = _load(args)
    options = dict(limit=args.limit, num_fewshot=args.num_fewshot, chat=args.chat, batch_size=args.batch_size)
    if args.compare:
        results = run_base_and_adapter(model, tok, tasks, manager, **options)
        print(comparison_table(results["base"], results["adapter"]))
    else:
        from lm_eval.utils import make_table  # lm-eval is there: task_manager would have said otherwise

        results = run_tasks(model, tok, tasks, manager, **options)
        print(make_table(results))
    write_text_atomic(out, to_json(results) + "\n")
    print(f"results: {out}")
    return 0


def cmd_studio(args) -> int:
    from pathlib import Path

    from lora_llama.studio.server import serve

    serve(
        Path(args.runs),
        args.host,
        args.port,
        auth=args.auth,
        token=args.token,
        allowed_hosts=args.allowed_hosts.split(","),
        ready=lambda url: print(f"lora-llama studio: {url}", flush=True),
    )
    return 0
