"""What the pages claim, against what backs it: each measured figure a page quotes is in bench/results, and each
command a sentence or table writes inline uses options that exist and work together."""

from __future__ import annotations

import argparse
import re
import shlex

from test_docs import PAGES

from lora_llama.errors import UserError

# a measured figure as pages quote it: a ratio (0.93x), a speed (130 tok/s), a step time (15.69 s a step), a duration
# (7.1 minutes) or an eval loss's move (2.1156 -> 1.5542)
FIGURE = re.compile(
    r"(?<![\w.])(\d+\.\d+)x\b|(?<![\w.])(\d+(?:\.\d+)?) (?:tok/s|tokens/s|s a step|minutes)\b"
    r"|(\d\.\d{4}) -> (\d\.\d{4})"
)


def test_a_figure_quoted_in_a_page_comes_from_the_results():
    """Every measured figure a page states outside its generated tables is in the newest results of some
    benchmark, as bench.report shows them: a claim with no results line behind it fails."""
    from bench.report import ROWS, table

    shown = table(tuple(ROWS))
    unbacked = []
    for page in PAGES:
        text = re.sub(r"<!-- bench-table: generated.*?<!-- bench-table end -->", "", page.read_text(), flags=re.S)
        for number, line in enumerate(text.splitlines(), 1):
            for figure in (g for m in FIGURE.finditer(line) for g in m.groups() if g):
                if not re.search(rf"(?<![\d.]){re.escape(figure)}(?!\d)", shown):
                    unbacked.append(f"{page.name}:{number}: {figure}")
    assert not unbacked, unbacked


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
        rf"\b({folders})/(\w+)((?:\.\w+)*)", (ROOT / "ARCHITECTURE.md").read_text()
    ):
        path = package / folder / f"{module}.py"
        names = [n for n in dotted.split(".") if n and n != "py"]
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
