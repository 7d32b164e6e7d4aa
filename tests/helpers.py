"""Helpers the tests import: tiny random LLaMA checkpoints built with transformers, an offline tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "smollm2-chat-cpu.yaml")  # the default recipe, under the overrides a test gives

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is the capital of france? paris is.",
    "to be or not to be, that is the question",
    "hello world, how are you today? i am fine.",
] * 20

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


# per family: what its config must be told to fit TINY (Qwen3's head_dim defaults to 128)
FAMILY_DEFAULTS = {"qwen3": dict(head_dim=16)}


def make_tokenizer():
    """A byte-level BPE tokenizer trained on a few lines, with BOS added and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = CHATML
    return fast


def build_checkpoint(folder: Path, shards: int = 1, seed: int = 0, family: str = "llama", **overrides) -> Path:
    """A tiny random checkpoint of transformers' class for `family` (a model_type), saved with a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, **{**TINY, **FAMILY_DEFAULTS.get(family, {}), **overrides})
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # random norms and biases so that a wrong mapping shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    size = sum(p.numel() * 4 for p in model.parameters())
    max_shard = f"{int(size / shards * 1.1) // 1000}KB" if shards > 1 else "10GB"
    model.save_pretrained(folder, max_shard_size=max_shard)
    tok = make_tokenizer()
    tok.save_pretrained(folder)
    return folder


def chat_file(path: Path, pairs) -> Path:
    """A JSONL chat data set of one user question and one assistant answer per (q, a) pair."""
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hf_model(folder):
    """transformers' own class for the checkpoint (LlamaForCausalLM, MistralForCausalLM, ...)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


# for memory measurements in a fresh subprocess: prepend to its script
PEAK_MEMORY_HELPERS = r"""
def status_kb(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
def reset_peak():  # Linux: writing 5 to clear_refs resets VmHWM, so only what follows counts
    open("/proc/self/clear_refs", "w").write("5")
"""


def sharded_checkpoint(folder: Path, shards: int) -> tuple[Path, list[Path]]:
    """A checkpoint big enough for memory measurements (~90 MB), in `shards` files."""
    base = build_checkpoint(
        folder,
        shards=shards,
        vocab_size=4000,
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    files = list(base.glob("model-*.safetensors"))
    assert len(files) >= shards
    return base, files


def fresh_python(script: str, *argv, env: dict | None = None) -> dict:
    """The JSON object that `script` prints last, run in a fresh Python (for process-wide state: memory, malloc)."""
    import os
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", script, *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def peak_growth(setup: str, work: str, *argv) -> int:
    """Bytes the peak RSS grows by while `work` runs in a fresh Python (after `setup`: imports are not the work's)."""
    script = (
        PEAK_MEMORY_HELPERS
        + f"import sys, json\n{setup}\nbase = status_kb('VmRSS')\nreset_peak()\n{work}\n"
        + "print(json.dumps({'base_kb': base, 'peak_kb': status_kb('VmHWM')}))\n"
    )
    mem = fresh_python(script, *argv)
    return (mem["peak_kb"] - mem["base_kb"]) * 1024


ALL = ["q", "k", "v", "o", "gate", "up", "down"]  # every decoder linear (peft's all-linear but lm_head)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative error ‖a - b‖ / ‖b‖, in float64."""
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def token_ids(batch: int = 2, seq: int = 24, seed: int = 1, vocab: int = 300) -> torch.Tensor:
    """(batch, seq) seeded token ids of the tiny checkpoints' vocabulary, above its special ids 0-2."""
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def make_adapter(base, out, targets=ALL, std: float = 0.1, seed: int = 0, source=None, **save_options):
    """A saved rank-4 adapter on `targets` of `base` (loaded from `source` when given), its B seeded off zero."""
    from lora_llama import LoraSettings, apply_lora, load_model, save_adapter

    model = load_model(source or base)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=list(targets)))
    random_lora_b(model, seed, std)
    return save_adapter(model, out, **save_options)


def random_lora_b(model, seed: int = 1, std: float = 0.1) -> None:
    """Every lora_B moved off zero (seeded), so that the adapter changes what the model computes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


# the float16 factors' byte offsets in a K super-block, and their size: they keep every weight within ~±0.2
K_FACTORS = {"Q4_K": ((0, 2), 2e-4), "Q5_K": ((0, 2), 1e-4), "Q6_K": ((208,), 5e-5)}


def random_k_blocks(kind: str, rows: int, in_features: int, seed: int = 0):
    """(rows, bytes) of random K super-blocks: every byte random (each scale, min and code bit pattern occurs) but
    the float16 factors, drawn from [size / 2, size)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, in_features // weights, size), dtype=np.uint8)
    offsets, factor = K_FACTORS[kind]
    for at in offsets:
        d = (rng.uniform(0.5, 1, (rows, in_features // weights, 1)) * factor).astype(np.float16)
        blocks[..., at : at + 2] = d.view(np.uint8)
    return blocks.reshape(rows, -1)


def random_blocks(kind: str, rows: int, in_features: int, seed: int = 0):
    """(rows, bytes) of `kind` blocks: random K super-blocks (random_k_blocks), or random weights (std 0.05)
    quantized by gguf-py."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    if kind in K_FACTORS:
        return random_k_blocks(kind, rows, in_features, seed)
    w = np.random.default_rng(seed).standard_normal((rows, in_features)).astype(np.float32) * 0.05
    return quants.quantize(w, GGMLQuantizationType[kind])


def quantized_layers(rows: int = 64, in_features: int = 512, seed: int = 2) -> dict:
    """{name: QuantizedLinear} of every layer kind: int8, nf4, nf4 with double quantization (from random float
    weights), and each GGUF block format (random blocks)."""
    from lora_llama.quant.gguf_blocks import GGUF_FORMATS
    from lora_llama.quant.handlers import NF4
    from lora_llama.quant.linear import QuantizedLinear

    linear = torch.nn.Linear(in_features, rows, bias=False)
    torch.nn.init.normal_(linear.weight, std=0.05, generator=torch.Generator().manual_seed(seed))
    layers = {
        "int8": QuantizedLinear.from_linear(linear, "int8"),
        "nf4": QuantizedLinear.from_linear(linear, "nf4"),
        "nf4-dq": QuantizedLinear.from_linear(linear, NF4(double_quant=True)),
    }
    for kind in GGUF_FORMATS:
        blocks = torch.from_numpy(random_blocks(kind.upper(), rows, in_features, seed))
        layers[kind] = QuantizedLinear(in_features, rows, kind, blocks, torch.empty(0))
    return layers


def gguf_with_blocks(src: Path, out: Path, kinds: dict, seed: int = 0) -> Path:
    """A copy of the GGUF file `src` whose tensors `blk.N.{part}.weight` hold random blocks of kinds[part]."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():  # gguf_new_metadata's copy: the writer adds the architecture itself
        if field.name != gguf.Keys.General.ARCHITECTURE and not field.name.startswith("GGUF."):
            kind = field.types[0]
            writer.add_key_value(
                field.name,
                field.contents(),
                kind,
                sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None,
            )
    for i, t in enumerate(reader.tensors):
        kind = kinds.get(t.name.split(".")[-2]) if t.name.startswith("blk.") else None
        if kind is None:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dimensions innermost first
        writer.add_tensor(t.name, random_blocks(kind, rows, cols, seed + i), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# preference data: (prompt, chosen, rejected)
PREFERENCE_ROWS = [
    ("what is the capital of france?", "paris is.", "the lazy dog"),
    ("hello world", "how are you today? i am fine.", "to be"),
    ("the quick brown fox", "jumps over the lazy dog", "what is the question"),
    ("to be or not to be", "that is the question", "hello"),
]


def preference_records(conversational: bool):
    if not conversational:
        return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PREFERENCE_ROWS]
    return [
        {
            "prompt": [{"role": "user", "content": p}],
            "chosen": [{"role": "assistant", "content": c}],
            "rejected": [{"role": "assistant", "content": r}],
        }
        for p, c, r in PREFERENCE_ROWS
    ]


def preference_file(path, rows):
    path.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in rows))
    return path


def one_error_line(err: str) -> bool:
    """stderr holds one error line and no traceback (the progress bar's lines aside)."""
    import re

    bar = re.compile(r"^[^|]*:\s+\d+%\|")  # tqdm's "train:  50%|..." lines
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not bar.match(line)]
    return len(lines) == 1 and lines[0].startswith("lora-llama ") and "Traceback" not in err


# local lm-eval tasks over the tiny checkpoints' vocabulary (tests of the harness and of a recipe's eval.tasks)
QUESTIONS = [
    ("what is the capital of france?", ["paris", "rome", "lima"], 0),
    ("the quick brown fox jumps over the", ["cat", "lazy dog", "moon"], 1),
    ("to be or not to be, that is the", ["answer", "end", "question"], 2),
    ("hello world, how are you", ["today?", "fine", "there"], 0),
    ("what is up", ["the sky", "down", "left"], 0),
]


def local_tasks(folder):
    """A multiple-choice task and a generation task (exact match, stopping at a newline), each a YAML over a JSONL."""
    folder.mkdir()
    rows = [{"question": q, "choices": c, "answer": a, "target": c[a]} for q, c, a in QUESTIONS]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'rows.jsonl'}\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        "task: tiny_mc\n" + data + "output_type: multiple_choice\ndoc_to_text: question\n"
        "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "gen.yaml").write_text(
        "task: tiny_gen\n" + data + "output_type: generate_until\ndoc_to_text: question\n"
        'doc_to_target: target\ngeneration_kwargs:\n  until: ["\\n", "?"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder
