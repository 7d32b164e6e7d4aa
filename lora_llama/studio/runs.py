"""The run folders under the studio's runs folder, as the page shows them: each one's status (running, finished,
stopped, failed with its one-line error, not started), its step, its metrics, eval.prompts' answers, lm-eval's
before and after, and its resolved recipe. Everything is read from what `lora-llama train` writes; a run is
running while it holds its folder's lock."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

from lora_llama.loading.adapters import ADAPTER_CONFIG
from lora_llama.objectives.catalog import DEFAULT, objective_named
from lora_llama.training.run_folder import (
    ADAPTER,
    METRICS,
    RECIPE,
    SAMPLES,
    benchmark_files,
    checkpoint_dir,
    checkpoint_steps,
    checkpoints,
    lock_file,
    log_file,
    logged_runs,
    read_metrics,
    read_run_recipe,
)

TRAIN = "train"  # the job that trains a run: `lora-llama train`


def is_running(run: Path) -> bool:
    """Whether a `lora-llama train` holds the run folder's lock (the kernel drops a killed one's). Read from
    /proc/locks, so that looking never takes the lock a starting run is about to take; elsewhere, a probe."""
    lock = lock_file(run)
    if not lock.is_file():
        return False
    locks = Path("/proc/locks")
    if locks.is_file():
        inode = lock.stat().st_ino
        return any(
            line.split()[1] == "FLOCK" and line.split()[5].endswith(f":{inode}")
            for line in locks.read_text().splitlines()
            if len(line.split()) > 5
        )
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def last_error(run: Path) -> str | None:
    """The one-line error of the last studio-started process of this run, when it ended with one."""
    log = log_file(run, TRAIN)
    if not log.is_file():
        return None
    errors = [line for line in output_lines(log) if line.startswith("lora-llama train: error:")]
    return errors[-1].removeprefix("lora-llama train: error: ") if errors else None


def output_lines(log: Path) -> list[str]:
    """A process's output as a terminal shows it: a progress bar's redraws (carriage returns) leave its last one."""
    return [line.rsplit("\r", 1)[-1] for line in log.read_text(errors="replace").split("\n") if line.strip()]


def status(run: Path) -> tuple[str, str | None]:
    """The run's state, and its one-line error when it failed."""
    if is_running(run):
        return "running", None
    if (run / ADAPTER / ADAPTER_CONFIG).is_file():
        return "finished", None
    if error := last_error(run):
        return "failed", error
    return ("stopped" if checkpoints(run) else "not started"), None


def summary(run: Path, rows: list[dict]) -> dict:
    """One line of the runs list; rows: the run's metrics."""
    state, failure = status(run)
    steps = [r["step"] for r in rows if "loss" in r]
    losses = [r["loss"] for r in rows if "loss" in r]
    return {
        "name": run.name,
        "status": state,
        "failure": failure,
        "step": steps[-1] if steps else 0,
        "loss": losses[-1] if losses else None,
        "modified": max((p.stat().st_mtime for p in (run / METRICS, run / RECIPE) if p.is_file()), default=0),
    }


def list_runs(root: Path) -> list[dict]:
    """Every run folder under root (one holding a recipe.yaml or metrics.jsonl, or a training log), newest first."""
    folders = {p for p in root.iterdir() if p.is_dir() and ((p / RECIPE).is_file() or (p / METRICS).is_file())}
    folders |= set(logged_runs(root, TRAIN))
    return sorted((summary(p, read_metrics(p / METRICS)) for p in folders), key=lambda s: -s["modified"])


def detail(run: Path) -> dict:
    """What the run's page shows: the summary, metrics rows, eval.prompts' answers, lm-eval's results per step,
    the checkpoints' steps and the resolved recipe (the run's output is followed as it grows: server.py)."""
    benchmarks = {}
    for step, f in benchmark_files(run).items():
        results = json.loads(f.read_text()).get("results", {})
        benchmarks[step] = {
            task: {k: v for k, v in r.items() if isinstance(v, (int, float))} for task, r in results.items()
        }
    rows, steps = read_metrics(run / METRICS), checkpoint_steps(run)[::-1]
    reporting = objective_named((read_run_recipe(run).get("train") or {}).get("objective", DEFAULT.name)).reporting
    head = summary(run, rows)
    return {
        **head,
        "metrics": rows,
        # the curves its objective draws: training (the loss, then its own figures) and held-out measures
        "curves": {"train": ["loss", *reporting.curves], "held_out": [m.key for m in reporting.held_out if m.charted]},
        "samples": read_metrics(run / SAMPLES),  # JSONL as metrics.jsonl is: a line being written is left for later
        "benchmarks": benchmarks,
        "recipe": (run / RECIPE).read_text() if (run / RECIPE).is_file() else "",
        # the adapters chat can load: the final one, then each checkpoint's, newest first (label, path under root)
        "adapters": ([["the adapter", f"{run.name}/{ADAPTER}"]] if head["status"] == "finished" else [])
        + [[f"step {s}", (checkpoint_dir(run, s) / ADAPTER).relative_to(run.parent).as_posix()] for s in steps],
    }
