"""The benchmarks that take no arguments refuse any, before they measure or record anything."""

from __future__ import annotations

import importlib
import sys

import pytest

from helpers import ROOT

NO_ARGUMENTS = ("agent", "data_cache", "demo", "merge", "setup", "streaming", "studio")


@pytest.mark.parametrize("name", NO_ARGUMENTS)
def test_an_unknown_option_is_refused_before_anything_runs(name, monkeypatch, capsys):
    main = importlib.import_module(f"bench.{name}").main
    results = {p.name: p.read_text() for p in (ROOT / "bench" / "results").glob("*.jsonl")}
    monkeypatch.setattr(sys, "argv", [f"bench.{name}", "--steps", "3"])
    with pytest.raises(SystemExit) as refused:
        main()
    assert refused.value.code == 2 and "unrecognized arguments: --steps 3" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in (ROOT / "bench" / "results").glob("*.jsonl")} == results


def test_help_prints_what_the_benchmark_measures(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.demo", "--help"])
    with pytest.raises(SystemExit) as done:
        importlib.import_module("bench.demo").main()
    assert done.value.code == 0 and "`make demo`'s time after setup" in capsys.readouterr().out
