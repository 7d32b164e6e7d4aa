"""Where a run's metrics go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow and trackio, by trl's
`report_to` names, each through its own library. Every tracker gets the run's resolved recipe as its config and
the metrics under metrics.jsonl's names."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from lora_llama.errors import UserError

# the module each tracker needs, and the pip package that provides it
NEEDS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}


def check_trackers(report_to: list[str] | None) -> list[str]:
    """The trackers a run writes to: those named (each installed, or one line naming the package to install), or
    TensorBoard when it is installed and none is named."""
    if report_to is None:
        return ["tensorboard"] if importlib.util.find_spec("tensorboard") else []
    missing = [t for t in report_to if importlib.util.find_spec(NEEDS[t][0]) is None]
    if missing:
        raise UserError(
            f"train.report_to names {missing[0]}, which is not installed: pip install {NEEDS[missing[0]][1]} "
            "(or take it out of train.report_to)"
        )
    return list(report_to)


def flat(tree: dict, prefix: str = "") -> dict:
    """{"train.lr": 1e-3, ...}: a nested recipe as the flat parameters MLflow takes."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class TensorBoard:
    """Event files in `folder` (the run folder's tensorboard/)."""

    def __init__(self, folder: Path, name: str, project: str, config: dict, resumed_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run drops the events written after its checkpoint
        self.writer = SummaryWriter(str(folder), purge_step=resumed_step + 1 if resumed_step else None)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A wandb run in the run folder (WANDB_MODE=offline writes it there without a network; `wandb sync` later).
    wandb's own variables win over the recipe, as under transformers' integration: WANDB_PROJECT, WANDB_NAME and
    WANDB_DIR replace train.project, train.run_name and the run folder; WANDB_ENTITY names the team."""

    def __init__(self, out: Path, name: str, project: str, config: dict, resumed_step: int):
        import wandb

        # read here rather than left to wandb, whose settings outlive a run in the same process
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or project,
            entity=os.environ.get("WANDB_ENTITY") or None,
            name=os.environ.get("WANDB_NAME") or name,
            dir=os.environ.get("WANDB_DIR") or str(out),
            config=config,
            reinit="create_new",
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run in the tracking store MLFLOW_TRACKING_URI names (MLflow's default otherwise), in
    the experiment MLFLOW_EXPERIMENT_NAME names, else train.project."""

    def __init__(self, out: Path, name: str, project: str, config: dict, resumed_step: int):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or project)
        self.run = mlflow.start_run(run_name=name)
        mlflow.log_params({k: str(v) for k, v in flat(config).items()})

    def log(self, metrics: dict, step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class Trackio:
    """A trackio run in train.project (transformers passes its `project` the same way)."""

    def __init__(self, out: Path, name: str, project: str, config: dict, resumed_step: int):
        import trackio

        self.trackio = trackio
        trackio.init(project=project, name=name, config=config)

    def log(self, metrics: dict, step: int) -> None:
        self.trackio.log(metrics, step=step)

    def close(self) -> None:
        self.trackio.finish()


KINDS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow, "trackio": Trackio}


class Trackers:
    """The run's trackers: each logged record goes to every one, under metrics.jsonl's names."""

    def __init__(self, names: list[str], out: Path, tensorboard_dir: Path, config: dict, resumed_step: int):
        """config: the resolved recipe as a dict; its train.run_name (else the folder's name) and train.project
        name the run."""
        train = config.get("train", {})
        name, project, self.trackers = train.get("run_name") or Path(out).name, train.get("project", "lora-llama"), []
        for n in names:
            try:
                folder = tensorboard_dir if n == "tensorboard" else Path(out)
                self.trackers.append(KINDS[n](folder, name, project, config, resumed_step))
            except Exception as e:  # a tracker's own setup error (a store it refuses, a login it needs): one line
                self.close()
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise UserError(f"train.report_to {n} could not start: {reason}") from None

    def log(self, record: dict) -> None:
        metrics = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log(metrics, record["step"])

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
