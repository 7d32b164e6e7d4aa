"""Model card + upload of an adapter to the Hugging Face Hub through `huggingface_hub`.

Nothing of the Hub protocol is written here: `HfApi.create_repo` and
`HfApi.upload_folder` do it, and follow `HF_ENDPOINT` as huggingface_hub does.
The token is passed to the client only; it never reaches output, logs or the card.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import yaml

from lora_llama.errors import UserError
from lora_llama.harness.tasks import comparison_table, metrics
from lora_llama.loading.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lora_llama.objectives.catalog import DEFAULT, objective_named
from lora_llama.registry import REGISTERED_DATA, is_hub_id, registered_model
from lora_llama.training.run_folder import ADAPTER, LOSS_PLOT, RECIPE, benchmark_files, evals, read_run_recipe


def find_adapter(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """(adapter folder, run folder or None) for an adapter folder or a training run folder."""
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file():
        run = path.parent if (path.parent / RECIPE).is_file() else None
        adapter = path
    elif (path / ADAPTER / ADAPTER_CONFIG).is_file():
        adapter, run = path / ADAPTER, path
    else:
        raise UserError(f"{path} holds no adapter ({ADAPTER_CONFIG}), nor a run folder with adapter/")
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        raise UserError(f"{adapter} holds no {ADAPTER_WEIGHTS}")
    return adapter, run


def model_card(adapter: Path, run: Path | None, repo_id: str) -> str:
    """README.md: YAML front matter the Hub understands, then settings, results and usage."""
    cfg = json.loads((adapter / ADAPTER_CONFIG).read_text())
    recipe = read_run_recipe(run)
    base = cfg.get("base_model_name_or_path") or "unknown"
    known = registered_model(base)
    # a local base is named by its folder's name only: no path of this machine goes into the card
    hub_base = known.hub_id if known else base if is_hub_id(base) else None
    shown = hub_base or Path(base).name
    data_source = (recipe.get("data") or {}).get("source")
    meta = {
        "library_name": "peft",
        "pipeline_tag": "text-generation",
        "tags": ["lora", "lora-llama", "peft", "text-generation"],
    }
    if hub_base:
        meta = {"base_model": hub_base, **meta}
    if known:
        meta["license"] = known.license
    if data_source and is_hub_id(data_source):
        meta["datasets"] = [data_source]
    base_results, results = benchmark_results(run)
    if results:
        meta["model-index"] = model_index(repo_id.split("/")[-1], results)
    objective = (recipe.get("train") or {}).get("objective", DEFAULT.name)
    if objective != DEFAULT.name:
        meta["tags"].append(objective)
    base_link = f"[{hub_base}](https://huggingface.co/{hub_base})" if hub_base else f"a local base model (`{shown}`)"
    lines = [
        f"# {repo_id.split('/')[-1]}",
        "",
        f"A LoRA adapter for {base_link}, trained with [lora-llama](https://github.com/lora-llama/lora-llama).",
        *_settings(cfg, recipe, data_source),
        *_results(objective_named(objective).reporting, run),
        *_benchmark_lines(base_results, results),
        *_usage(shown, repo_id),
    ]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n\n" + "\n".join(lines)


def _settings(cfg: dict, recipe: dict, data_source: str | None) -> list[str]:
    """The card's settings table: the adapter's, the data's, the objective's and the training's."""
    lines = [
        "",
        "## Settings",
        "",
        "| setting | value |",
        "| --- | --- |",
        f"| rank r | {cfg['r']} |",
        f"| alpha | {cfg['lora_alpha']} |",
        f"| dropout | {cfg['lora_dropout']} |",
        f"| target modules | {', '.join(cfg['target_modules'])} |",
        f"| rsLoRA | {cfg.get('use_rslora', False)} |",
    ]
    if data_source:
        known_data = REGISTERED_DATA.get(data_source)
        shown_data = data_source if is_hub_id(data_source) else Path(data_source).name
        lines.append(f"| data | {known_data.description if known_data else shown_data} |")
    train = recipe.get("train") or {}
    objective = train.get("objective", DEFAULT.name)
    lines.append(f"| objective | {objective_named(objective).card_line(train.get(objective))} |")
    for key in ("lr", "batch_size", "grad_accum", "max_steps", "epochs", "schedule"):
        if train.get(key) is not None:
            lines.append(f"| {key} | {train[key]} |")
    return lines


def _results(reporting, run: Path | None) -> list[str]:
    """The objective's Results sentence (its headline before and after, its other held-out measures) and the loss
    plot."""
    last, start = evals(run, reporting)
    sentence = reporting.results(last, start) if last else None
    lines = ["", "## Results", "", sentence] if sentence else []
    if run and (run / LOSS_PLOT).is_file():
        lines += ["", f"![training curve]({LOSS_PLOT})"]
    return lines


def benchmark_results(run: Path | None) -> tuple[dict | None, dict | None]:
    """lm-eval's results of a run's `eval.tasks`: the base's (step 0) and the adapter's (the last step after 0);
    None where there are none."""
    files = benchmark_files(run)
    last = max((step for step in files if step > 0), default=None)
    return (
        json.loads(files[0].read_text()) if 0 in files else None,
        json.loads(files[last].read_text()) if last is not None else None,
    )


def model_index(name: str, results: dict) -> list[dict]:
    """The Hub's `model-index` metadata: one entry per lm-eval task with its metrics."""
    by_task: dict[str, list[dict]] = {}
    for (task, metric), value in metrics(results).items():
        entry = {"type": metric.split(",")[0], "name": metric.replace(",none", ""), "value": round(float(value), 4)}
        by_task.setdefault(task, []).append(entry)
    entries = [
        {"task": {"type": "text-generation"}, "dataset": {"name": task, "type": task}, "metrics": found}
        for task, found in by_task.items()
    ]
    return [{"name": name, "results": entries}]


def _benchmark_lines(base: dict | None, adapter: dict | None) -> list[str]:
    if not adapter:
        return []
    return ["", "## Benchmarks (lm-evaluation-harness)", "", comparison_table(base or {"results": {}}, adapter)]


def _usage(shown: str, repo_id: str) -> list[str]:
    return [
        "",
        "## Use",
        "",
        "With peft and transformers:",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'base = AutoModelForCausalLM.from_pretrained("{shown}")',
        f'model = PeftModel.from_pretrained(base, "{repo_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{shown}")',
        "```",
        "",
        "With lora-llama:",
        "",
        "```bash",
        f"hf download {repo_id} --local-dir adapter",
        f'lora-llama generate --model {shown} --adapter adapter --chat --prompt "Hello!"',
        "```",
        "",
    ]


def stage(adapter: Path, run: Path | None, repo_id: str, folder: Path) -> list[str]:
    """Copy what gets uploaded into `folder`; returns the file names."""
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copy2(adapter / name, folder / name)
    if run and (run / LOSS_PLOT).is_file():
        shutil.copy2(run / LOSS_PLOT, folder / LOSS_PLOT)
    (folder / "README.md").write_text(model_card(adapter, run, repo_id))
    return sorted(p.name for p in folder.iterdir())


def resolve_token(token: str | None) -> str:
    from huggingface_hub import get_token

    token = token or os.environ.get("HF_TOKEN") or get_token()
    if not token:
        raise UserError("no Hugging Face token: pass --token, set HF_TOKEN, or run `hf auth login`")
    return token


def push(
    path: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    log=print,
) -> str | None:
    """Upload an adapter (or a run's final adapter) with its model card; returns the commit URL."""
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UserError(f"--repo-id must look like USER/NAME, got {repo_id!r}")
    adapter, run = find_adapter(path)
    with tempfile.TemporaryDirectory(prefix="lora-llama-push-") as tmp:
        files = stage(adapter, run, repo_id, Path(tmp))
        if dry_run:
            log(f"dry run: would upload to {repo_id}: {', '.join(files)}")
            log((Path(tmp) / "README.md").read_text())
            return None
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        api = HfApi(token=resolve_token(token))
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            if revision:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            info = api.upload_folder(
                folder_path=tmp,
                repo_id=repo_id,
                revision=revision,
                commit_message=commit_message or "Upload LoRA adapter with lora-llama",
            )
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status in (401, 403):
                raise UserError(
                    f"the Hub refused {repo_id} (HTTP {status}): the token lacks write access to it, or it is not valid"
                ) from None
            raise UserError(f"the Hub answered HTTP {status} for {repo_id}") from None
        except (OSError, ConnectionError) as e:
            raise UserError(f"cannot reach the Hub at {api.endpoint}: {type(e).__name__}") from None
        except Exception as e:  # httpx raises its own transport errors, not OSError
            if type(e).__module__.startswith("httpx"):
                raise UserError(f"cannot reach the Hub at {api.endpoint}: {type(e).__name__}") from None
            raise
    log(f"pushed {', '.join(files)} to {info.commit_url}")
    return info.commit_url
