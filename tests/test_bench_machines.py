"""The machine a benchmark line names: its CPU, and the instruction-set caps it ran under; which lines README's
short table shows."""

from __future__ import annotations


def test_a_run_capped_below_the_cpus_instructions_is_a_machine_of_its_own(monkeypatch):
    """bench lines record ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY; the tables list such a run apart from the
    uncapped one on the same CPU, and README's short table leaves it out."""
    from bench import common, report

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert common.isa_caps() == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert "; ONEDNN_MAX_CPU_ISA=AVX2; ATEN_CPU_CAPABILITY=avx2; torch" in common.cpu_line()
    line = {"cpu": "X", "cores": 2, "cpu_flags": ["avx2", "avx512_bf16"], "torch": "2.13.0", "args": []}
    capped = {**line, "isa_cap": {"ONEDNN_MAX_CPU_ISA": "AVX2"}}
    assert report.machine(capped) == report.machine(line).replace(
        "; torch", ", run capped at ONEDNN_MAX_CPU_ISA=AVX2; torch"
    )
    rows = [{**line, "date": "2026-01-01", "rows": []}, {**capped, "date": "2026-01-02", "rows": []}]
    monkeypatch.setattr(report, "newest_per_args", lambda name: rows)
    assert "capped" in report.table(("cpu",)) and "capped" not in report.table(("cpu",), cpu_only=True)


def test_readmes_short_table_shows_a_benchmarks_whole_runs_only(monkeypatch):
    """A run of some of bench.cpu's sizes (`--sizes`) is in docs/performance.md's table, not in README's."""
    from bench import report

    line = {"cpu": "X", "cores": 2, "cpu_flags": ["avx2"], "torch": "2.13.0", "date": "2026-01-01", "rows": []}
    rows = [{**line, "args": ["--default"]}, {**line, "args": ["--sizes", "135m"]}]
    monkeypatch.setattr(report, "newest_per_args", lambda name: rows)
    monkeypatch.setitem(report.ROWS, "cpu", lambda line: [("what", "ours", "theirs", "ratio")])
    assert "`python -m bench.cpu --sizes 135m`" in report.table(("cpu",))
    short = report.table(("cpu",), cpu_only=True)
    assert "`python -m bench.cpu --default`" in short and "--sizes" not in short
