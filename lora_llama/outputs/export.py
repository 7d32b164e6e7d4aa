"""`lora-llama export`: base (+ adapter) as one GGUF file for llama.cpp, Ollama and LM Studio, written in pure
Python with `gguf` (llama.cpp's own library), and an adapter alone as a llama.cpp LoRA GGUF.

The model is streamed as `merge` streams it: tensor infos come from the shards' headers, then each tensor is
read, folded, converted and written before the next is read. Names, layouts and metadata follow llama.cpp's
`convert_hf_to_gguf.py`: q and k rows of llama-architecture files are permuted from the HF rotate-half order
to llama.cpp's interleaved pairs; norms and biases stay float32. The tokenizer: gguf_vocab.py.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from lora_llama.data.chat import stop_token_ids
from lora_llama.errors import UserError
from lora_llama.files.atomic import atomic_file, refuse_existing, write_text_atomic
from lora_llama.files.json_files import read_config
from lora_llama.files.shards import open_safetensors
from lora_llama.loading.models import gguf_file, load_tokenizer, resolve_source
from lora_llama.model.config import ModelArgs, rope_inv_freq
from lora_llama.outputs import gguf_experts
from lora_llama.outputs.gguf_families import family_layout, write_family_hparams
from lora_llama.outputs.gguf_vocab import build_tokenizer, copy_tokenizer
from lora_llama.outputs.merge import Merger
from lora_llama.quant.gguf_tensors import permute_rows
from lora_llama.registry import local_model_name

GGUF_TYPES = ("f16", "bf16", "q8_0")
# our family -> llama.cpp architecture; llama.cpp's own converter writes Mistral as llama too
ARCHITECTURES = {
    "llama": "LLAMA",
    "mistral": "LLAMA",
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "mixtral": "LLAMA",
    "qwen2_moe": "QWEN2MOE",
    "qwen3_moe": "QWEN3MOE",
    "gemma3_text": "GEMMA3",
}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise UserError("export needs the gguf package: pip install gguf") from None
    return gguf


def _check_out(out: Path, force: bool) -> None:
    if out.suffix != ".gguf":
        raise UserError(f"{out}: the output must be a .gguf file")
    refuse_existing(out, force)
    if not out.parent.is_dir():
        raise UserError(f"{out.parent} does not exist")


# ---------------------------------------------------------------------------- names and layouts


def architecture(args: ModelArgs):
    if args.model_type not in ARCHITECTURES:
        raise UserError(
            f"export writes {', '.join(ARCHITECTURES)} models; convert a merged {args.model_type} folder "
            "(lora-llama merge) with llama.cpp's convert_hf_to_gguf.py"
        )
    return _gguf().MODEL_ARCH[ARCHITECTURES[args.model_type]]


class TensorNames:
    """HF tensor name -> GGUF name, and the row permutation it needs."""

    def __init__(self, args: ModelArgs):
        gguf = _gguf()
        self.args, self.arch = args, architecture(args)
        gguf_experts.check_every_layer_mixed(args, gguf.MODEL_ARCH_NAMES[self.arch])
        self.map = gguf.get_tensor_name_map(self.arch, args.n_layers)
        self.permuted = self.arch == gguf.MODEL_ARCH.LLAMA

    def name(self, hf_name: str) -> str:
        found = self.map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise UserError(f"no GGUF name for tensor {hf_name!r} of a {self.args.model_type} model")
        return found

    def layout(self, hf_name: str, w: torch.Tensor) -> torch.Tensor:
        if self.permuted and ".q_proj." in hf_name:
            return permute_rows(w, self.args.n_heads)
        if self.permuted and ".k_proj." in hf_name:
            return permute_rows(w, self.args.n_kv_heads)
        return family_layout(self.args, hf_name, w)


def rope_factors(args: ModelArgs) -> torch.Tensor | None:
    """Llama 3.1's frequency factors, the `rope_freqs` tensor llama.cpp reads: by how much the scaling
    divides each RoPE frequency (computed in float64, as the converter computes them in Python floats)."""
    s = args.rope_scaling or {}
    if s.get("rope_type", s.get("type")) != "llama3":
        return None
    plain = replace(args, rope_scaling=None)
    return (rope_inv_freq(plain, torch.float64) / rope_inv_freq(args, torch.float64)).float()


# ---------------------------------------------------------------------------- tensor types


def ggml_type(out_type: str, shape: tuple, name: str = ""):
    """1-D tensors (norms, biases) and routers stay F32; q8_0 needs rows in blocks of 32, else F16 (as llama.cpp's
    converter)."""
    T = _gguf().GGMLQuantizationType
    if len(shape) < 2 or name.endswith(gguf_experts.F32_TENSORS):
        return T.F32
    if out_type == "q8_0" and shape[-1] % 32 == 0:
        return T.Q8_0
    return T.BF16 if out_type == "bf16" else T.F16


def convert(w: torch.Tensor, qtype):
    gguf = _gguf()
    a = w.detach().to(torch.float32).numpy()
    T = gguf.GGMLQuantizationType
    if qtype == T.F32:
        return a
    if qtype == T.F16:
        return a.astype(np.float16)
    return gguf.quants.quantize(a, qtype)


def nbytes(shape: tuple, qtype) -> int:
    return math.prod(_gguf().quant_shape_to_byte_shape(shape, qtype))


# ---------------------------------------------------------------------------- metadata


def write_hparams(writer, args: ModelArgs, name: str, out_type: str) -> None:
    gguf = _gguf()
    writer.add_type("model")
    writer.add_name(name)
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_vocab_size(args.vocab_size)
    writer.add_rope_dimension_count(args.head_dim)
    file_type = {
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[out_type]
    gguf_experts.write_expert_hparams(writer, args)
    write_family_hparams(writer, args)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ---------------------------------------------------------------------------- the files


def _atomic_gguf(writer, out: Path, write_tensors) -> int:
    """Header, metadata and tensor infos, then the tensors, into a hidden temporary renamed over `out` at the
    end: a kill leaves no half-written file under the final name."""
    with atomic_file(out) as tmp:
        try:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            write_tensors()
        finally:
            writer.close()
    return out.stat().st_size


def _tensor_infos(writer, merger, names, out_type: str, freqs) -> int:
    """Every tensor's GGUF header entry, from the safetensors headers, in the order the tensors will be written;
    returns their number."""
    gguf = _gguf()
    if freqs is not None:
        f32 = gguf.GGMLQuantizationType.F32
        writer.add_tensor_info("rope_freqs.weight", tuple(freqs.shape), np.float32, freqs.numel() * 4, raw_dtype=f32)
    count, experts = 0, gguf_experts.StackedExperts(names.args)
    for f in merger.files:
        with open_safetensors(f) as sf:
            for key, shape in (item for k, _, s in merger.entries(sf) for item in experts.add(k, s)):
                name = names.name(key)
                qtype = ggml_type(out_type, shape, name)
                writer.add_tensor_info(name, shape, np.float32, nbytes(shape, qtype), raw_dtype=qtype)
                count += 1
    return count


def export_gguf(
    base: str,
    out: str | os.PathLike,
    adapter: str | os.PathLike | None = None,
    out_type: str = "f16",
    force: bool = False,
    onto: str = "original",
    quantize=None,
    progress: bool = True,
) -> dict:
    """Write base (+ adapter, merged) as one GGUF file, and its Ollama Modelfile beside it (`modelfile_for`);
    onto and quantize as `Merger` takes them."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    gguf = _gguf()
    if out_type not in GGUF_TYPES:
        raise UserError(f"unknown --type {out_type!r} (use {', '.join(GGUF_TYPES)})")
    out = Path(out)
    _check_out(out, force)
    modelfile = modelfile_for(out)
    refuse_existing(modelfile, force)
    merger = Merger(base, adapter, onto, quantize)
    args = ModelArgs.from_hf_config(merger.config)
    names = TensorNames(args)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[names.arch])
    write_hparams(writer, args, out.stem, out_type)
    source_gguf = gguf_file(base)
    if source_gguf is not None:
        copy_tokenizer(writer, source_gguf)
    else:
        build_tokenizer(writer, merger.folder, args.vocab_size, args.gemma)
    freqs = rope_factors(args)
    count = _tensor_infos(writer, merger, names, out_type, freqs)

    def write_tensors():
        if freqs is not None:
            writer.write_tensor_data(freqs.numpy())
        experts = gguf_experts.StackedExperts(args)
        with tqdm(total=count, desc="export", unit="tensor", disable=not progress) as bar:
            for f in merger.files:
                with open_safetensors(f) as sf:
                    for key, w in (item for k, t in merger.tensors(sf) for item in experts.add(k, t)):
                        qtype = ggml_type(out_type, tuple(w.shape), names.name(key))
                        writer.write_tensor_data(convert(names.layout(key, w), qtype))
                        bar.update(1)

    size = _atomic_gguf(writer, out, write_tensors)
    write_modelfile(modelfile, [f"FROM ./{out.name}"], merger.folder, args)
    return {
        "out": str(out),
        "bytes": size,
        "tensors": count,
        "modelfile": str(modelfile),
        "seconds": time.perf_counter() - start,
    }


def modelfile_for(gguf_path: Path) -> Path:
    """FILE.Modelfile beside FILE.gguf: one per exported file, so several exports share a folder
    (`ollama create NAME -f FILE.Modelfile`)."""
    return gguf_path.with_suffix(".Modelfile")


def write_modelfile(path: Path, head: list[str], folder: Path, args: ModelArgs) -> None:
    """The head (FROM, and ADAPTER for a LoRA file), then a stop for every token that ends a turn (Ollama reads
    the chat template from the GGUF's tokenizer.chat_template)."""
    tok = load_tokenizer(folder)

    def quoted(t):
        return t.replace("\\", "\\\\").replace('"', '\\"')  # Modelfile strings are double-quoted

    lines = head + [
        f'PARAMETER stop "{quoted(tok.convert_ids_to_tokens(i))}"'
        for i in stop_token_ids(tok, args.eos_token_id, folder)
    ]
    write_text_atomic(path, "\n".join(lines) + "\n")


def ollama_base(base: str, folder: Path, out: Path) -> str:
    """What a LoRA file's Modelfile takes as FROM: the base's GGUF (relative when it sits beside the LoRA file)
    or its HF folder (`folder`, resolved from it), which Ollama imports too."""
    path = (gguf_file(base) or folder).resolve()
    return f"./{path.name}" if path.parent == out.resolve().parent else str(path)


def export_lora_gguf(
    adapter: str | os.PathLike, out: str | os.PathLike, base: str | None = None, force: bool = False
) -> dict:
    """The adapter alone as a llama.cpp LoRA GGUF (`llama-cli -m model.gguf --lora FILE`): lora_a (r, in) and
    lora_b (out, r) per adapted weight under the model's GGUF names (B's rows permuted like the weight's; experts
    stacked: gguf_experts.expert_lora_tensors), adapter.lora.alpha = scale · r (llama.cpp scales by alpha / r)."""
    from lora_llama.loading.adapters import adapter_deltas

    start = time.perf_counter()
    gguf = _gguf()
    out = Path(out)
    _check_out(out, force)
    modelfile = modelfile_for(out)
    refuse_existing(modelfile, force)
    if not Path(adapter).is_dir():
        raise UserError(f"adapter folder not found: {adapter}")
    deltas, scale, cfg = adapter_deltas(adapter)
    if cfg.get("modules_to_save") or cfg.get("trainable_token_indices"):
        raise UserError(
            "an adapter that trains embedding or lm_head rows (modules_to_save, trainable_token_indices) has no "
            "llama.cpp LoRA form; export the merged model instead"
        )
    if cfg.get("use_dora"):
        raise UserError(
            "a DoRA adapter has no llama.cpp LoRA form (its magnitudes rescale whole rows); "
            "export the merged model instead"
        )
    base = base or (cfg.get("base_model_name_or_path") and local_model_name(cfg["base_model_name_or_path"]))
    if not base:
        raise UserError(f"{adapter}: adapter_config.json names no base model; pass --base")
    folder = resolve_source(base)
    args = ModelArgs.from_hf_config(read_config(folder))
    names = TensorNames(args)
    if "lm_head.weight" in deltas and args.tie_word_embeddings:
        raise UserError(
            "an adapter on a tied lm_head has no llama.cpp LoRA form (the base has no output tensor); "
            "export the merged model instead"
        )
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[names.arch])
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    factors = []  # (checkpoint-side name, A, B) per adapted weight; a mixture's experts stacked (E, ...)
    for key, (A, B, _) in deltas.items():
        factors += gguf_experts.expert_lora_tensors(key, A, B, args) or [(key, A, names.layout(key, B))]
    rank = factors[0][1].shape[-2]
    writer.add_float32("adapter.lora.alpha", scale * rank)  # llama.cpp scales by alpha / r
    tensors = [
        (names.name(key) + f".lora_{ab}", t.float().contiguous()) for key, *AB in factors for ab, t in zip("ab", AB)
    ]
    for name, t in tensors:
        writer.add_tensor_info(name, tuple(t.shape), np.float32, t.numel() * 4, raw_dtype=gguf.GGMLQuantizationType.F32)
    size = _atomic_gguf(writer, out, lambda: [writer.write_tensor_data(t.contiguous().numpy()) for _, t in tensors])
    write_modelfile(modelfile, [f"FROM {ollama_base(base, folder, out)}", f"ADAPTER ./{out.name}"], folder, args)
    return {
        "out": str(out),
        "bytes": size,
        "tensors": len(tensors),
        "modelfile": str(modelfile),
        "seconds": time.perf_counter() - start,
    }
