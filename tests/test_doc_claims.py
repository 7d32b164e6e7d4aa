"""What the pages claim, against what backs it: each measured figure a page or a recipe states names the benchmark
whose results hold it, and each command a sentence or table writes inline uses options that exist and work
together."""

from __future__ import annotations

import argparse
import json
import re
import shlex

import yaml
from test_docs import PAGES

from helpers import ROOT
from lora_llama.errors import UserError

NUMBER = r"(\d+(?:\.\d+)?)"
# a measured figure as pages and recipe comments state it: a ratio (0.93x), a speed (130 tok/s), a step time (15.69 s
# a step), a duration (7.1 minutes, 7 min 9 s), a move (2.1156 -> 1.5542, 0.82 (step 25) -> 0.88), a measure (loss
# 0.693, accuracy 0.88, acc 0.4333), a share (within 0.2%, 2.2% of a core)
FIGURE = re.compile(
    rf"(?<![\w.]){NUMBER}x\b"
    rf"|(?<![\w.]){NUMBER} ?(?:tok/s|tokens/s)"
    rf"|(?<![\w.]){NUMBER} ?(?:s a step|s/step|s per step|ms a step)"
    rf"|(?<![\w.]){NUMBER} ?(?:min|minutes)\b(?: {NUMBER} s\b)?"
    rf"|(?<![\w.]){NUMBER}%(?= of (?:a|one) core| faster| slower)|within {NUMBER}%"
    rf"|\b(?:loss|accuracy|acc|acc_norm|reward|margin|perplexity)(?:,none)? (?:of )?{NUMBER}"
)
# a move from one value to the next (the next one looked ahead at, so that a chain a -> b -> c gives each)
MOVE = re.compile(rf"(?<![\w.]){NUMBER}(?: \([^)]*\))? -> (?={NUMBER})")
NAMED = re.compile(r"bench[./](?:results/)?(\w+)|`(\w+)\.jsonl`")


def figures(text: str) -> list[str]:
    found = [g for m in FIGURE.finditer(text) for g in m.groups() if g]
    moves = [m.groups() for m in MOVE.finditer(text)]
    return found + [g for move in moves if any("." in g for g in move) for g in move]  # 2 -> 1 processes: no figure


def prose(path) -> str:
    """What a file says in words: a page without its generated tables and code blocks, a recipe's or the Makefile's
    comments."""
    text = path.read_text()
    if path.suffix == ".md":
        text = re.sub(r"<!-- bench-table: generated.*?<!-- bench-table end -->", "", text, flags=re.S)
        return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return "\n".join(line.split("#", 1)[1] if "#" in line else "" for line in text.splitlines())


def backs(figure: str, names: set[str]) -> bool:
    """The figure is in the rows of one of these benchmarks' newest results, as the table shows them or as the
    results hold it (rounded as the figure is written)."""
    from bench.report import ROWS, newest_per_args, table

    known = [n for n in names if n in ROWS]
    if re.search(rf"(?<![\d.]){re.escape(figure)}(?!\d)", table(tuple(known)) if known else ""):
        return True
    places = len(figure.partition(".")[2])
    if places < 2:  # a whole or one-decimal figure as the table shows it: rounding raw values would match by chance
        return False
    values = []
    for name in names:
        for line in newest_per_args(name):
            values += re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", json.dumps(line))
    return any(abs(round(float(v), places) - float(figure)) < 10 ** -(places + 3) for v in values)


def test_a_figure_names_the_results_line_it_comes_from():
    """Every measured figure a page or a recipe comment states, outside the generated tables, sits in a paragraph
    (a comment block) that names its benchmark (`python -m bench.NAME` or bench/results/NAME.jsonl), and that
    benchmark's newest results hold it: a claim with no results line behind it fails."""
    from helpers import ROOT

    unbacked = []
    for path in [*PAGES, *sorted((ROOT / "recipes").glob("*.yaml")), ROOT / "Makefile"]:
        before = ""
        for paragraph in re.split(r"\n\s*\n", prose(path)):
            # a table's caption is the paragraph above it
            found = NAMED.findall(paragraph + (before if paragraph.startswith("|") else ""))
            names = {name for pair in found for name in pair if name}
            before = paragraph
            for figure in figures(" ".join(paragraph.split())):  # a figure and its unit may wrap
                if not backs(figure, names):
                    unbacked.append(f"{path.name}: {figure} (names {sorted(names) or 'no benchmark'})")
    assert not unbacked, unbacked


def test_the_figure_check_reads_every_form():
    """The forms pages write figures in, each found (and a count of processes is not a figure)."""
    said = (
        "accuracy 0.00 (step 0) -> 0.82 (step 25), 7 min 9 s, 14 s a step, 0.97x, 784 tok/s, eval loss 2.1156 -> "
        "1.5542, acc 0.4333, within 0.2% of float32, 2.2% of a core, 2 -> 1 processes"
    )
    assert sorted(set(figures(said)), key=said.index) == [
        "0.00",
        "0.82",
        "7",
        "9",
        "14",
        "0.97",
        "784",
        "2.1156",
        "1.5542",
        "0.4333",
        "0.2",
        "2.2",
    ]


def test_commands_written_inline_use_options_that_work_together():
    """`lora-llama export --adapter A --out F.gguf` in a sentence or a table: every option exists for its
    sub-command and the options given pass the CLI's combination checks. (A span may leave out arguments the
    sentence is not about, so required ones are not asked for.)"""
    from lora_llama.cli import build_parser, check_combinations

    commands_by_name = build_parser()._subparsers._group_actions[0].choices
    for page in PAGES:
        prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for span in re.findall(r"`(lora-llama [a-z]+ [^`]*--[^`]+)`", prose):
            words = shlex.split(span)[1:]
            sub = commands_by_name[words[0]]
            given = argparse.Namespace(command=words[0], **{a.dest: a.default for a in sub._actions})
            for i, word in enumerate(words):
                if word.startswith("--"):
                    assert word in sub._option_string_actions, f"{page.name}: {span}: {word}"
                    action = sub._option_string_actions[word]
                    value = words[i + 1] if action.nargs != 0 and i + 1 < len(words) else True
                    setattr(given, action.dest, value)
            try:
                check_combinations(given)
            except UserError as e:
                raise AssertionError(f"{page.name}: {span}: {e}") from None


def test_every_module_and_name_architecture_names_exists():
    """`training/trainer.Trainer.fit`, `data/sft.pack`, `model/llama.py`, `data/prompts` in ARCHITECTURE.md's prose,
    tables and diagram: the module is a file of the package and each name after it is defined there (a top-level
    function, class or constant, then a member of that class), so the page cannot drift from the code."""
    import ast

    from helpers import ROOT

    package = ROOT / "lora_llama"
    folders = "|".join(p.name for p in package.iterdir() if p.is_dir() and not p.name.startswith("__"))
    missing = []
    for folder, module, dotted in re.findall(
        rf"\b({folders})/((?:\w+/)*\w+)((?:\.\w+)*)", (ROOT / "ARCHITECTURE.md").read_text()
    ):
        path = package / folder / f"{module}.py"
        names = [n for n in dotted.split(".") if n and n != "py"]
        if not names and (package / folder / module).is_dir():  # a subpackage, named as a folder
            continue
        if not path.is_file():
            missing.append(f"{folder}/{module}")
            continue
        scope = ast.parse(path.read_text()).body
        for name in names:
            found = [
                node
                for node in scope
                if getattr(node, "name", None) == name
                or any(
                    getattr(t, "id", None) == name for t in getattr(node, "targets", [getattr(node, "target", None)])
                )
            ]
            if not found:
                missing.append(f"{folder}/{module}{dotted}")
                break
            scope = getattr(found[0], "body", [])
    assert not missing, missing


def test_gpu_recipes_state_the_memory_their_own_step_needs():
    """Each GPU recipe's comment gives the estimator's figure for its own model, batch and length."""
    from bench.memory_estimate import SHAPES, recipe_gb

    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        if yaml.safe_load(recipe.read_text())["model"]["source"] not in SHAPES:
            continue
        gb, batch, length = recipe_gb(recipe)
        comment = " ".join(line.lstrip("# ") for line in recipe.read_text().splitlines() if line.startswith("#"))
        said = re.search(r"about (\d+) GB a step at batch (\d+) x (\d+)", comment)
        assert said, f"{recipe.name} states no memory for its step"
        assert said.groups() == (f"{gb['total']:.0f}", str(batch), str(length)), (recipe.name, said.group(0))


def test_make_bench_runs_every_benchmark_the_tables_show():
    """One list: the tables' benchmarks (bench.report.PAGES) are what `make bench` runs (bench.all), each row's
    arguments included, and each has its module and its rows."""
    from bench.all import runs
    from bench.report import PAGES, ROWS, newest_per_args

    bench_target = (ROOT / "Makefile").read_text().split("\nbench: ")[1].split("\n\n")[0]
    assert "-m bench.all" in bench_target and "for b in" not in bench_target
    shown = {name for names in PAGES.values() for name in names}
    assert all((ROOT / "bench" / f"{name}.py").is_file() and name in ROWS for name in shown)
    rows = {(f"bench.{n}", *line.get("args", [])) for n in shown for line in newest_per_args(n) if "gpu" not in line}
    assert set(map(tuple, runs())) == rows and rows
