"""A training run's folder: its file names and readers, one run at a time, checkpoint state
without pickles, metrics and plots.

    out/checkpoints/step-N/{adapter/, state.safetensors, state.json, trainer_state.json}
    out/metrics.jsonl, out/samples.jsonl, out/eval/, out/tensorboard/, out/loss.png, out/recipe.yaml, out/adapter/
    out/merged/, out/model.gguf                              (what `merge` and `export` write from a run, the studio's)
    .out.lock, .out.JOB.log                                  (beside the folder: its lock, and a command's output)

Trainer state (optimizer, scheduler, RNG) is split into its tensors (safetensors) and the
rest (JSON): loading a checkpoint someone sent you runs no code, where a pickle would.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import threading
from pathlib import Path

import torch

from lora_llama.errors import UserError
from lora_llama.files.json_files import read_json, write_json
from lora_llama.loading.adapters import ADAPTER_CONFIG

# the run folder's names: every other module spells them through these
ADAPTER, CHECKPOINTS, METRICS, LOSS_PLOT, RECIPE = "adapter", "checkpoints", "metrics.jsonl", "loss.png", "recipe.yaml"
SAMPLES, TENSORBOARD, BENCHMARKS = "samples.jsonl", "tensorboard", "eval"  # eval.prompts' answers; eval.tasks' results
MERGED, EXPORTED = "merged", "model.gguf"  # a run's adapter merged into its base, and exported to GGUF


def lock_file(out: Path) -> Path:
    """The run's lock, beside its folder (--force may delete the folder itself)."""
    return Path(out).parent / f".{Path(out).name}.lock"


def log_file(out: Path, job: str) -> Path:
    """The output of a command run on the run's behalf (train, merge, export, push), beside its folder."""
    return Path(out).parent / f".{Path(out).name}.{job}.log"


def logged_runs(root: Path, job: str) -> list[Path]:
    """The run folders under root that a `job` command has a log for (a run that failed before writing anything)."""
    return [root / p.name[1 : -len(f".{job}.log")] for p in Path(root).glob(f".*.{job}.log")]


def adapters_under(root: Path) -> list[Path]:
    """Every adapter folder under a runs folder: a run's final one, its checkpoints', and a folder of one's own
    copied in (one or two levels down); none inside a temporary (atomic writes' start with a dot)."""
    patterns = (f"*/{ADAPTER_CONFIG}", f"*/*/{ADAPTER_CONFIG}", f"*/{CHECKPOINTS}/step-*/{ADAPTER}/{ADAPTER_CONFIG}")
    found = {p.parent for g in patterns for p in Path(root).glob(g)}
    return sorted(p for p in found if not any(part.startswith(".") for part in p.relative_to(root).parts))


def written_models(root: Path) -> list[Path]:
    """The models runs under root wrote: merged folders and GGUF exports."""
    return sorted([*(p.parent for p in Path(root).glob(f"*/{MERGED}/config.json")), *Path(root).glob(f"*/{EXPORTED}")])


def benchmark_file(run: Path, step: int) -> Path:
    """Where lm-eval's results of a run's eval.tasks at `step` go (step 0: the base model's)."""
    return Path(run) / BENCHMARKS / f"lm-eval-step-{step}.json"


def benchmark_files(run: Path | None) -> dict[int, Path]:
    """{step: file} of the benchmark results a run wrote."""
    found = sorted((Path(run) / BENCHMARKS).glob("lm-eval-step-*.json")) if run else []
    return {int(f.stem.rsplit("-", 1)[1]): f for f in found}


STATE_TENSORS, STATE_JSON, TRAINER_STATE = "state.safetensors", "state.json", "trainer_state.json"


def run_of_adapter(adapter: Path) -> Path | None:
    """The run folder an adapter folder belongs to (run/adapter or run/checkpoints/step-N/adapter), or None."""
    adapter = Path(adapter).resolve()
    for run in (adapter.parent, adapter.parent.parent.parent):
        if (run / RECIPE).is_file():
            return run
    return None


def read_run_recipe(run: Path | None) -> dict:
    """The resolved recipe a run wrote (as plain data), or {} when there is none."""
    import yaml

    path = Path(run) / RECIPE if run else None
    return (yaml.safe_load(path.read_text()) or {}) if path and path.is_file() else {}


def write_run_recipe(out: Path, recipe) -> None:
    import yaml

    (out / RECIPE).write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))


def evals(run: Path | None, reporting) -> tuple[dict | None, dict]:
    """(the last eval record of a run's metrics, the step-0 one: the base model's), by the objective's headline
    measure (its `reporting`); None and {} where there are none."""
    found = [r for r in read_metrics(Path(run) / METRICS) if reporting.headline.key in r] if run else []
    return (found[-1] if found else None), next((r for r in found if r["step"] == 0), {})


@contextlib.contextmanager
def run_lock(out: Path):
    """Hold a lock on the run folder for the whole run; a second run on it is refused at once.

    The lock file sits beside the folder (--force may delete the folder) and is an flock, which
    the kernel drops when its holder dies: the lock of a killed run is simply taken over.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    f = open(lock_file(out), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise UserError(
            f"{out} is in use by a running `lora-llama train` (pid {holder}); "
            "wait for it to end or choose another output.dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    try:
        yield
    finally:
        f.close()  # closing releases the flock


@contextlib.contextmanager
def stop_requests():
    """Yield a list that SIGTERM (a preempted job) or SIGINT (Ctrl-C) fill with the signal's name,
    for the trainer to stop at the next step boundary; a second signal stops at once.
    Outside the main thread (no signal handlers there) the list just stays empty."""
    requested: list[str] = []

    def handler(signum, frame):
        if requested:
            raise KeyboardInterrupt(requested[0])
        requested.append(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield requested
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def checkpoint_dir(out: Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step-{step}"


def checkpoint_steps(out: Path) -> list[int]:
    """The steps of a run's complete checkpoints, oldest first."""
    return [int(p.name.removeprefix("step-")) for p in checkpoints(out)]


def checkpoints(out: Path) -> list[Path]:
    """A run's complete checkpoint folders, oldest first (atomic_dir's temporaries start with a dot)."""
    found = [p for p in (Path(out) / CHECKPOINTS).glob("step-*") if p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def remove_leftovers(out: Path) -> None:
    """Temporary folders of writes that a killed run left half done (never mistaken for results)."""
    for parent in (out, out / CHECKPOINTS):
        for p in parent.glob(".*.tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------- state without pickles


def _split(obj, tensors: dict, path: str):
    """obj with every tensor replaced by a reference into `tensors`, tuples and non-string keys kept."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": path}
    if isinstance(obj, dict):
        items = [[k, _split(v, tensors, f"{path}.{k}")] for k, v in obj.items()]
        return {"__dict__": items}
    if isinstance(obj, (list, tuple)):
        items = [_split(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    return obj


def _join(obj, tensors: dict):
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_join(v, tensors) for v in obj["__tuple__"])
        return {k: _join(v, tensors) for k, v in obj["__dict__"]}
    return obj


def save_state(folder: Path, state: dict) -> None:
    from safetensors.torch import save_file

    tensors: dict = {}
    tree = _split(state, tensors, "state")
    save_file(tensors, folder / STATE_TENSORS, metadata={"format": "pt"})
    write_json(folder / STATE_JSON, tree)


def load_state(folder: Path) -> dict:
    """What save_state wrote; a broken file is one UserError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(folder / STATE_TENSORS)
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {folder / STATE_TENSORS}: truncated or not a safetensors file ({e})") from None
    try:
        return _join(read_json(folder / STATE_JSON), tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{folder / STATE_JSON} does not describe a trainer state ({type(e).__name__}: {e})") from None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------- metrics


def read_metrics(path: Path) -> list[dict]:
    """The metric records; a last line cut short by a kill is skipped, not an error."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the lines of a JSONL log (metrics, samples) written after the checkpoint we resume from, so none is
    repeated."""
    if path.is_file():
        path.write_text("".join(json.dumps(r) + "\n" for r in read_metrics(path) if r["step"] <= step))


class MetricsLog:
    """metrics.jsonl and the run's trackers (`trackers.py`): a record per logged step (rank 0 writes)."""

    def __init__(self, out: Path, resumed_step: int, main: bool, report_to=None, recipe=None):
        """report_to: train.report_to (null: TensorBoard when installed); recipe: what the trackers record."""
        from lora_llama.training.trackers import Trackers, check_trackers

        self.path, self.main = Path(out) / METRICS, main
        config = recipe.model_dump(mode="json") if recipe is not None else {}
        names = check_trackers(report_to)
        self.trackers = Trackers(names, Path(out), Path(out) / TENSORBOARD, config, resumed_step) if main else None

    def write(self, record: dict) -> None:
        """A 0-d tensor in the record (a step's gradient norm, left on its device) is read here, as a float."""
        if not self.main:
            return
        record = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.trackers.log(record)

    def close(self) -> None:
        if self.trackers:
            self.trackers.close()


def eval_at_start(metrics: Path, reporting) -> dict:
    """The eval figures logged at step 0, the base model's: the objective's headline measure (`eval_loss_start`,
    `eval_reward_start`) and each benchmark's (`lm_eval/arc_easy/acc_start`)."""
    at_start = [r for r in read_metrics(metrics) if r["step"] == 0]
    start = {}
    for key in [reporting.headline.key, *(k for r in at_start for k in r if k.startswith("lm_eval/"))]:
        found = [r[key] for r in at_start if key in r]
        start.update({f"{key}_start": found[0]} if found else {})
    return start


def plot_losses(metrics: Path, png: Path, reporting) -> None:
    """The loss curves; a second panel with the figures the objective's reporting draws beside them (preference:
    the reward accuracy and margin; GRPO: the sampled completions' reward and the held-out greedy one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)

    def curve(key):
        return [(r["step"], r[key]) for r in rows if key in r]

    panel = [k for k in reporting.panel() if curve(k)]
    fig, axes = plt.subplots(1, 2 if panel else 1, figsize=(12 if panel else 7, 4), squeeze=False)
    ax = axes[0][0]
    for key, style, label in (("loss", "-", "train loss"), ("eval_loss", "o-", "eval loss")):
        if curve(key):
            ax.plot(*zip(*curve(key)), style, label=label, alpha=0.7 if key == "loss" else 1.0)
    ax.set_ylabel(f"loss ({reporting.loss_unit})" if reporting.loss_unit else "loss")
    for key in panel:
        held_out = key.startswith("eval_")
        axes[0][1].plot(*zip(*curve(key)), "o-" if held_out else "-", label=key, alpha=1.0 if held_out else 0.7)
    for a in axes[0]:
        a.set_xlabel("step")
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
