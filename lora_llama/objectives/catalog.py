"""Every objective, in the order the schema lists them: `train.objective`'s choices, the `train.<name>` settings
sections and `data.format`'s choices all come from here. An objective joins by being listed in OBJECTIVES."""

from __future__ import annotations

from functools import partial

from lora_llama.errors import UserError
from lora_llama.objectives.base import Objective, bucketed_length
from lora_llama.objectives.dpo import DPO
from lora_llama.objectives.grpo.objective import GRPO
from lora_llama.objectives.kto import KTO
from lora_llama.objectives.orpo import ORPO
from lora_llama.objectives.sft import SFT

OBJECTIVES: tuple[type[Objective], ...] = (SFT, DPO, ORPO, KTO, GRPO)
DEFAULT = SFT


def objective_named(name: str) -> type[Objective]:
    for objective in OBJECTIVES:
        if objective.name == name:
            return objective
    raise UserError(f"unknown train.objective {name!r} (choose from {', '.join(o.name for o in OBJECTIVES)})")


def build_objective(recipe, tokenizer, eos_ids: list[int]) -> Objective:
    """The recipe's objective; under train.compile its rows are padded to a few lengths (bucketed_length)."""
    objective = objective_named(recipe.train.objective).build(recipe, tokenizer, eos_ids)
    objective.pack_to = recipe.data.max_seq_len if recipe.data.packing else None
    if recipe.train.compile is True:  # resolved by then: auto is true or false
        objective.row_length = partial(bucketed_length, limit=recipe.data.max_seq_len)
    return objective


def data_formats() -> dict[str, str]:
    """Every data.format an objective reads -> the columns it holds, in the objectives' order."""
    return {fmt: columns for o in OBJECTIVES for fmt, columns in o.data_formats.items()}


def readers(fmt: str) -> list[type[Objective]]:
    """The objectives that read data.format `fmt`."""
    return [o for o in OBJECTIVES if fmt in o.data_formats]


def check_objective_fits_data(name: str, fmt: str, packing: bool, streaming: bool = False) -> None:
    """Raises ValueError (the schema's cross-key rule) when the objective does not read the data's format, packs
    none while data.packing asks for it, or reads no stream while data.streaming asks for one."""
    objective = objective_named(name)
    if fmt != "auto" and fmt not in objective.data_formats:
        read_by = ", ".join(o.name for o in readers(fmt))
        raise ValueError(
            f"train.objective {name} reads data.format {' / '.join(objective.data_formats)} (or auto), "
            f"not {fmt} (which train.objective {read_by} reads)"
        )
    if packing and not objective.packs:
        raise ValueError(
            f"data.packing is not supported with train.objective {name}: each of its examples needs rows of its own"
        )
    if streaming and not objective.streams:
        streamed = ", ".join(o.name for o in OBJECTIVES if o.streams)
        raise ValueError(f"data.streaming is read by train.objective {streamed}, not {name}")
