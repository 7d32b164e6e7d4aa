"""train.report_to: Weights & Biases (offline) and MLflow (a file store) get the recipe and every metric of
metrics.jsonl, read back through their own libraries; a tracker that is not installed stops the run before it
starts, in one line."""

import json

import pytest

from helpers import RECIPE, one_error_line
from lora_llama.cli import main


def train(tiny_ckpt, chat_data, out, *extra):
    return main(
        [
            "train",
            RECIPE,
            f"model.source={tiny_ckpt}",
            f"data.source={chat_data}",
            "data.val_size=0.25",
            "train.max_steps=3",
            "train.eval_every=2",
            f"output.dir={out}",
            *extra,
        ]
    )


def logged(out) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as {name: [(step, value), ...]}."""
    series: dict = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                series.setdefault(k, []).append((record["step"], v))
    return series


def same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """The same steps and, to float32's precision (MLflow and wandb keep doubles or JSON), the same values."""
    b = sorted(b)
    return [s for s, _ in a] == [s for s, _ in b] and [v for _, v in a] == pytest.approx([v for _, v in b], rel=1e-6)


def wandb_records(raw: bytes):
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB's log format,
    32 KiB blocks of records (checksum 4, length 2, type 1: full, first, middle, last)."""
    assert raw[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero fill at the end of the file
            break
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            yield pending


def test_mlflow_file_store_holds_the_recipe_and_every_metric(tiny_ckpt, chat_data, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this to keep a file store
    assert train(tiny_ckpt, chat_data, tmp_path / "run", "train.report_to=[mlflow]") == 0
    client = mlflow.tracking.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("lora-llama").experiment_id])
    assert run.data.params["train.max_steps"] == "3" and run.data.params["model.source"] == str(tiny_ckpt)
    for name, series in logged(tmp_path / "run").items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert same(history, series), name


def wandb_run(folder):
    """The history ({name: [(step, value)]}), config and run header (project, name, entity) of the one offline run
    under `folder`, read from its .wandb file."""
    from wandb.proto import wandb_internal_pb2

    (events,) = folder.glob("offline-run-*/run-*.wandb")
    history, config, header = {}, {}, None
    for data in wandb_records(events.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for k, v in row.items():
                if not k.startswith("_"):
                    history.setdefault(k, []).append((row["_step"], v))
        if record.WhichOneof("record_type") == "run":  # the run's header record carries the config
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            header = record.run
    return history, config, header


def test_wandb_offline_run_holds_the_recipe_and_every_metric(tiny_ckpt, chat_data, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_DIR", "WANDB_ENTITY"):
        monkeypatch.delenv(variable, raising=False)
    extra = ["train.report_to=[wandb]", "train.run_name=first-try", "train.project=chat-bots"]
    assert train(tiny_ckpt, chat_data, tmp_path / "run", *extra) == 0
    history, config, header = wandb_run(tmp_path / "run" / "wandb")
    assert config["train"]["max_steps"] == 3 and config["model"]["source"] == str(tiny_ckpt)
    assert (header.project, header.display_name) == ("chat-bots", "first-try")  # the recipe's names
    for name, series in logged(tmp_path / "run").items():
        assert same(sorted(history[name]), series), name


def test_wandb_variables_win_over_the_recipe(tiny_ckpt, chat_data, tmp_path, monkeypatch):
    """WANDB_PROJECT, WANDB_NAME, WANDB_DIR and WANDB_ENTITY decide as under transformers' integration."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "team-project")
    monkeypatch.setenv("WANDB_NAME", "from-the-shell")
    monkeypatch.setenv("WANDB_ENTITY", "my-team")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    (tmp_path / "wandb-home").mkdir()
    extra = ["train.report_to=[wandb]", "train.run_name=first-try", "train.project=chat-bots"]
    assert train(tiny_ckpt, chat_data, tmp_path / "run", *extra) == 0
    assert not (tmp_path / "run" / "wandb").exists()
    history, _, header = wandb_run(tmp_path / "wandb-home" / "wandb")
    assert (header.project, header.display_name, header.entity) == ("team-project", "from-the-shell", "my-team")
    assert same(sorted(history["loss"]), logged(tmp_path / "run")["loss"])


def test_mlflow_experiment_from_the_recipe_or_its_variable(tiny_ckpt, chat_data, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    extra = ["train.report_to=[mlflow]", "train.max_steps=1", "train.run_name=first-try"]
    assert train(tiny_ckpt, chat_data, tmp_path / "a", *extra, "train.project=chat-bots") == 0
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-experiment")
    assert train(tiny_ckpt, chat_data, tmp_path / "b", *extra, "train.project=chat-bots") == 0
    client = mlflow.tracking.MlflowClient()
    for experiment in ("chat-bots", "team-experiment"):
        (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
        assert run.info.run_name == "first-try"


def test_a_tracker_not_installed_is_one_line_before_the_run(tiny_ckpt, chat_data, tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    assert train(tiny_ckpt, chat_data, tmp_path / "run", "train.report_to=[trackio]") == 2
    err = capsys.readouterr().err
    assert one_error_line(err) and "pip install trackio" in err and not (tmp_path / "run").exists()


def test_an_unknown_tracker_is_refused_by_the_recipe(tiny_ckpt, chat_data, tmp_path, capsys):
    assert train(tiny_ckpt, chat_data, tmp_path / "run", "train.report_to=[comet]") == 2
    err = capsys.readouterr().err
    assert one_error_line(err) and "report_to" in err
