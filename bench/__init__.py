"""Benchmarks against transformers+peft (and trl) in one run each: `python -m bench.NAME` from the repository root."""
