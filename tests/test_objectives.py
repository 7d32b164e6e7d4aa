"""Objectives as one extension point: each objective's name is spelled in its own module only, and the schema's
choices and sections, the recipe entry and the trainer find objectives through the catalog."""

import ast
import re

from helpers import ROOT
from lora_llama.objectives.catalog import OBJECTIVES, data_formats
from lora_llama.recipe.schema import DataSection, TrainSection

PACKAGE = ROOT / "lora_llama"


def strings_naming(name: str) -> list[str]:
    """'file:line' of every string constant in the package (docstrings included) with `name` as a whole word."""
    word = re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w-])")
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and word.search(node.value):
                found.append(f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}")
    return found


def test_each_objective_is_named_in_its_own_module_only():
    for objective in OBJECTIVES:
        module = objective.__module__.removeprefix("lora_llama.").replace(".", "/")
        # its module, or the whole subpackage named after it (objectives/grpo/)
        home = module.rsplit("/", 1)[0] + "/" if module.split("/")[-2] == objective.name else module + ".py:"
        places = strings_naming(objective.name)
        assert places and all(p.startswith(home) for p in places), (objective.name, places)


def test_the_name_check_finds_a_name_elsewhere():
    assert any(p.startswith("objectives/base.py:") for p in strings_naming("tokens"))


def test_the_schema_takes_its_choices_from_the_catalog():
    assert TrainSection.model_fields["objective"].annotation.__args__ == tuple(o.name for o in OBJECTIVES)
    sections = [name for name in TrainSection.model_fields if any(o.name == name for o in OBJECTIVES)]
    assert sections == [o.name for o in OBJECTIVES if o.settings]
    for o in OBJECTIVES:
        if o.settings:
            assert TrainSection.model_fields[o.name].annotation is o.settings
    assert DataSection.model_fields["format"].annotation.__args__ == (*data_formats(), "auto")
