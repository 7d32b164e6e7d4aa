"""Benchmarks through lm-evaluation-harness on the native model: its lm-eval model and the tasks run on it."""
