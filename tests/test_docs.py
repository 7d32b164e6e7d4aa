"""The documentation against the code: the recipe reference and bench tables are generated, every documented
command parses as the CLI reads it, every recipe snippet validates, and the commands a CPU can run do run."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
# commands of other tools that docs show beside ours (run by their own projects, not here)
SCRIPT_VALUES = {"SLURM_NNODES": "2", "SLURM_NODEID": "0", "HEAD": "node-0"}
OTHER_TOOLS = {"pip", "llama-cli", "llama-quantize", "ollama", "cd", "hf"}
# documented commands that need what a CPU-only machine without the Hub lacks (GPUs, a Hub login, 7-8B weights,
# a finished GRPO run), or more than one short step (the agent's recipes: a finished SFT run, prompts that list
# tools; bench.agent runs them)
NEEDS_MORE = (
    "--nproc-per-node 8",
    "llama3-8b",
    "llama2-7b",
    "qwen2.5-7b",
    "mistral-7b",
    "RECIPE.yaml",
    "runs/int8",
    "runs/smollm2-grpo",
    "runs/my-run",  # the evaluation guide's standard benchmarks, whose data is on the Hub
    "smollm2-tools",
    "lora-llama studio",  # a server: it runs until stopped (tests/test_studio.py drives it)
)


def code_blocks(lang: str) -> list[tuple[str, str]]:
    """(page name, block text) of every fenced block of that language."""
    found = []
    for page in PAGES:
        for block in re.findall(rf"^```{lang}\n(.*?)^```", page.read_text(), flags=re.M | re.S):
            found.append((page.name, block))
    return found


def commands() -> list[tuple[str, str]]:
    """(page, command line) of every bash block, and the lines of sh scripts that start lora-llama: continuations
    joined, comments and environment assignments dropped."""
    out = []
    scripts = [
        (
            page,
            "\n".join(
                line for line in b.replace("\\\n", " ").splitlines() if "lora_llama" in line or "lora-llama" in line
            ),
        )
        for page, b in code_blocks("sh")
    ]
    for page, block in code_blocks("bash") + scripts:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if not line or line.startswith("#"):
                continue
            for name, value in SCRIPT_VALUES.items():  # the SLURM script's variables, as a job would set them
                line = line.replace(f"${name}", value)
            for part in line.split("&&"):
                words = shlex.split(part)
                while words and (re.match(r"^[A-Z_]+=", words[0]) or words[0] == "srun"):  # SLURM's srun runs it
                    words = words[1:]
                if words:
                    out.append((page, shlex.join(words)))
    return out


def lora_llama_args(command: str) -> list[str] | None:
    """The arguments `lora-llama` gets from a documented command, or None when it is another tool's."""
    words = shlex.split(command)
    if words[0] == "lora-llama":
        return words[1:]
    if "-m" in words and words[words.index("-m") + 1] == "lora_llama":
        return words[words.index("-m") + 2 :]
    return None


def test_recipe_reference_is_generated_from_the_schema():
    from lora_llama.recipe.reference import reference

    assert (ROOT / "docs" / "recipes.md").read_text() == reference(), (
        "docs/recipes.md is stale: python -m lora_llama.recipe.reference docs/recipes.md"
    )


def recipe_keys() -> set[str]:
    """Every recipe key path: `lora.r`, `train.grpo.group_size`, ..."""
    from pydantic import BaseModel

    from lora_llama.recipe.schema import Recipe

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            yield prefix + name
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                yield from walk(field.annotation, prefix + name + ".")

    return set(walk(Recipe, ""))


def test_the_pages_name_only_recipe_keys_that_exist():
    """A key path a page writes in backticks (`train.lr`, `lora.targets: [...]`) is a key of the schema."""
    sections = "|".join(("model", "lora", "data", "train", "eval", "output"))
    keys = recipe_keys()
    wrong = [
        (page.name, key)
        for page in PAGES
        for key in re.findall(rf"`((?:{sections})\.[a-z_.]*[a-z_])[`:= ]", page.read_text())
        if key not in keys
    ]
    assert not wrong, wrong


def test_every_recipe_key_is_in_the_reference():
    from lora_llama.recipe.schema import Recipe

    text = (ROOT / "docs" / "recipes.md").read_text()
    for section, field in Recipe.model_fields.items():
        assert f"## `{section}`" in text
        for key in field.annotation.model_fields:
            assert f"| `{key}` |" in text, f"{section}.{key}"


def test_bench_tables_are_generated_from_the_results():
    from bench.report import CPU_ONLY, rewrite
    from bench.report import PAGES as TABLES

    for page, names in TABLES.items():
        want = rewrite(ROOT / page, names, page in CPU_ONLY)
        assert (ROOT / page).read_text() == want, f"{page}: run python -m bench.report"


def test_gpu_memory_table_is_computed_by_the_estimator():
    from bench.memory_estimate import table

    page = (ROOT / "docs" / "gpu.md").read_text()
    shown = page.split("<!-- memory table: python -m bench.memory_estimate -->\n")[1].split("<!-- end memory table")[0]
    assert shown == table(), "docs/gpu.md's memory table is stale: python -m bench.memory_estimate"


def test_every_documented_command_is_known():
    from lora_llama.cli import build_parser, check_combinations

    makefile = (ROOT / "Makefile").read_text()
    markers = (ROOT / "pyproject.toml").read_text()
    for page, command in commands():
        words = shlex.split(command)
        args = lora_llama_args(command)
        if args is not None:
            parsed, extra = build_parser().parse_known_args(args)  # argparse exits on an unknown option
            assert all("=" in x and not x.startswith("-") for x in extra) and (
                not extra or parsed.command == "train"
            ), f"{page}: {command}"
            check_combinations(parsed)  # options that only work together, as the CLI checks them
        elif words[0] == "make":
            assert re.search(rf"^{words[1]}:", makefile, flags=re.M), f"{page}: no make target {words[1]}"
        elif (
            words[:3] == [".venv/bin/python", "-m", "pytest"] or words[:2] == ["python", "-m"] and words[2] == "pytest"
        ):
            for marker in re.findall(r"\b(slow|distributed|cuda)\b", command):
                assert f'"{marker}:' in markers, f"{page}: marker {marker} is not registered"
        elif words[:2] == ["python", "-m"] and words[2].startswith("bench."):
            source = (ROOT / "bench" / f"{words[2].split('.')[1]}.py").read_text()
            assert all(f'"{w}"' in source for w in words[3:] if w.startswith("--")), f"{page}: {command}"
        elif words[0] == "bash":  # a script of the repository's
            assert (ROOT / words[1]).is_file(), f"{page}: {command}"
        elif words[:2] == ["python", "-m"] and words[2].startswith("lora_llama."):
            assert (ROOT / "lora_llama" / f"{words[2].split('.')[1]}.py").is_file(), f"{page}: {command}"
        else:
            assert words[0] in OTHER_TOOLS, f"{page}: {command}"


def test_every_recipe_snippet_validates(tmp_path):
    from lora_llama.recipe.schema import load_recipe

    for i, (page, block) in enumerate(code_blocks("yaml")):
        (tmp_path / f"{i}.yaml").write_text(block)
        load_recipe(str(tmp_path / f"{i}.yaml"))  # a UserError names the page's mistake


def test_every_data_snippet_parses():
    for page, block in code_blocks("jsonl"):
        for line in block.splitlines():
            json.loads(line)


def test_every_python_snippet_compiles():
    for page, block in code_blocks("python"):
        compile(block, page, "exec")


def runnable(command: str) -> bool:
    args = lora_llama_args(command)
    return (
        args is not None
        and not any(n in command for n in NEEDS_MORE)
        and command.split()[0] == "lora-llama"
        and not (args[0] == "push" and "--dry-run" not in args)
    )


def docs_workspace(folder: Path, smollm2) -> None:
    """The files the documented commands name, as a user's working folder holds them."""
    from lora_llama.loading.models import gguf_to_folder

    (folder / "recipes").symlink_to(ROOT / "recipes")
    (folder / "tasks").symlink_to(ROOT / "tasks")
    (folder / "out").mkdir()
    (folder / "notes.txt").write_text("What can you eat?\nWho is your father?\n")
    (folder / "my-data.jsonl").write_text(code_blocks("jsonl")[0][1] * 20)  # the data page's example record
    (folder / "my-recipe.yaml").write_text(next(b for page, b in code_blocks("yaml") if page == "README.md"))
    (folder / "path" / "to").mkdir(parents=True)  # README's local model folder: the default model as HF files
    (folder / "path" / "to" / "my-model").symlink_to(gguf_to_folder(smollm2))


@pytest.mark.slow
@pytest.mark.distributed  # the distributed guide's two-process command among them
def test_the_commands_a_cpu_can_run_do_run(smollm2, tmp_path):
    """Every documented lora-llama command that needs no GPU, Hub or 7B weights, in the order the docs give them,
    after a two-step run of the default recipe into runs/smollm2-chat; then README's Python snippet."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    docs_workspace(tmp_path, smollm2)
    train = [
        sys.executable,
        "-m",
        "lora_llama",
        "train",
        "recipes/smollm2-chat-cpu.yaml",
        "train.max_steps=2",
        "train.eval_every=2",
        "train.save_every=2",
        "data.max_examples=40",
        "train.precision=fp32",
    ]
    r = subprocess.run(train, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    ran = []
    for page, command in commands():
        if not runnable(command):
            continue
        args = lora_llama_args(command)
        if args[0] == "train":  # one short step into a fresh folder: the options, not the training, are checked here
            args = args + [
                "train.max_steps=1",
                "data.max_examples=40",
                "data.max_seq_len=128",
                "data.val_size=0",
                "train.precision=fp32",
                "output.dir=runs/doc",
                "--force",
            ]
        if args[0] == "eval" and "--tasks" in args and "--limit" not in args:  # a few questions: the options run
            args = args + ["--limit", "3"]
        threads = "1" if "--nproc-per-node" in args else "2"
        r = subprocess.run(
            [sys.executable, "-m", "lora_llama", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**env, "OMP_NUM_THREADS": threads},
            timeout=600,
        )
        assert r.returncode == 0, f"{page}: {command}\n{r.stderr[-2000:]}"
        ran.append(command)
    print("\n".join(ran))
    assert len(ran) >= 8
    readme_python = next(block for page, block in code_blocks("python") if page == "README.md")
    r = subprocess.run([sys.executable, "-c", readme_python], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
def test_the_python_guide_runs(smollm2, tmp_path):
    """docs/python.md's blocks, in order, as one script: load, adapt, train steps, generate, save, merge, train."""
    script = "\n".join(block for page, block in code_blocks("python") if page == "python.md")
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split()[1]) for line in r.stdout.splitlines() if re.match(r"^[0-2] \d", line)]
    assert len(losses) == 3 and losses[2] < losses[0]  # the three steps lower the loss on their example


def test_readme_is_a_short_page():
    lines, in_code = (ROOT / "README.md").read_text().splitlines(), False
    long = []
    for number, line in enumerate(lines, 1):
        in_code = in_code != line.startswith("```")
        # the bench table's rows and machine lines are generated
        generated = line.startswith(("| `python -m bench.", "|  |")) or re.match(r"^[A-Z]: ", line)
        if not in_code and not generated and len(line) > 160:
            long.append(number)
    assert len(lines) <= 220 and not long, (len(lines), long)


def test_no_history_in_the_project():
    """Code, recipes and docs speak in the present tense: no sessions, no issue numbers (history is in git)."""
    words = re.compile(r"\bsession \d|\bsessions? \d|\bissue \d+|\bissues? #\d|\bslow day\b|\bdev machine\b", re.I)
    files = [
        *PAGES,
        ROOT / "Makefile",
        *ROOT.glob("recipes/*.yaml"),
        *ROOT.glob("lora_llama/**/*.py"),
        *ROOT.glob("bench/*.py"),
        *ROOT.glob("tests/*.py"),
    ]
    found = [
        f"{f.name}:{n}"
        for f in files
        if f != Path(__file__)
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if words.search(line)
    ]
    assert not found, found
