"""lm-evaluation-harness tasks on the native model: task names checked, results as lm-eval writes them, and the
base model beside its adapter (the adapter switched off, not loaded twice)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lora_llama.errors import UserError
from lora_llama.harness.lm import native_lm
from lora_llama.lora.adapted import adapters_disabled


def task_manager(include_path: str | os.PathLike | None = None):
    """lm-eval's TaskManager over its own tasks and the YAML task files under include_path."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError('--tasks needs lm-eval: pip install -e ".[eval]" (or pip install lm-eval)') from None
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path}: no such folder")
    return TaskManager(include_path=str(include_path) if include_path else None)


def check_tasks(manager, tasks: list[str]) -> None:
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(
            f"unknown lm-eval task {unknown[0]!r} (lm-eval's own need the Hub; local ones come from "
            "--include-path DIR, a YAML over a JSONL file)"
        )


def run_tasks(model, tokenizer, tasks: list[str], manager, limit=None, num_fewshot=None, chat=False, batch_size=8):
    """lm-eval's results dict (`results`, `configs`, `n-shot`, ...) for `tasks` on the model as it stands."""
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=native_lm(model, tokenizer, batch_size=batch_size),
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        apply_chat_template=chat,
        log_samples=False,
    )


def run_base_and_adapter(model, tokenizer, tasks, manager, **options) -> dict:
    """{"base": results, "adapter": results}: the adapter switched off for the base's run."""
    with adapters_disabled(model):
        base = run_tasks(model, tokenizer, tasks, manager, **options)
    return {"base": base, "adapter": run_tasks(model, tokenizer, tasks, manager, **options)}


def metrics(results: dict) -> dict[tuple[str, str], float]:
    """{(task, metric): value} of lm-eval's results, its stderr entries left out."""
    return {
        (task, name): value
        for task, row in results["results"].items()
        for name, value in row.items()
        if isinstance(value, (int, float)) and "_stderr" not in name and name != "alias"
    }


def comparison_table(base: dict, adapter: dict) -> str:
    """A markdown table: each task and metric, the base's value, the adapter's and the difference."""
    a = metrics(adapter)
    lines = ["| task | metric | base | adapter | difference |", "| --- | --- | --- | --- | --- |"]
    for (task, name), value in sorted(metrics(base).items()):
        if (task, name) in a:
            lines.append(f"| {task} | {name} | {value:.4f} | {a[task, name]:.4f} | {a[task, name] - value:+.4f} |")
    return "\n".join(lines)


def to_json(results: dict) -> str:
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
