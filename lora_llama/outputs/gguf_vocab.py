"""The tokenizer of an exported GGUF: copied from a source GGUF, or built from an HF folder's tokenizer.json when it
is byte-level BPE with a pre-tokenizer llama.cpp knows, recognised by structure (GPT-2, SmolLM, Llama 3, Qwen2);
anything else is refused, never guessed.
"""

from __future__ import annotations

from pathlib import Path

from lora_llama.errors import UserError
from lora_llama.files.json_files import read_json
from lora_llama.loading.models import load_tokenizer

# the original regexes of Llama 3's and Qwen2's tokenizer.json (llama.cpp's llama-vocab.cpp quotes them)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def copy_tokenizer(writer, source: Path) -> None:
    """Every tokenizer.* field of a source GGUF, as it is."""
    import gguf  # export checked that it is installed

    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            types = field.types
            sub = types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), types[0], sub_type=sub)


def pre_tokenizer_name(tokenizer_json: dict) -> str | None:
    """llama.cpp's name for a byte-level BPE pre-tokenizer, recognised by its structure; None when unknown."""
    pre, norm = tokenizer_json.get("pre_tokenizer") or {}, tokenizer_json.get("normalizer")

    def byte_level(p, regex):
        return (
            p.get("type") == "ByteLevel" and p.get("use_regex", True) == regex and not p.get("add_prefix_space", False)
        )

    def split(p, regex):
        return (
            p.get("type") == "Split"
            and (p.get("pattern") or {}).get("Regex") == regex
            and p.get("behavior") == "Isolated"
            and not p.get("invert", False)
        )

    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if norm is None and len(steps) == 1 and byte_level(steps[0], True):
        return "gpt-2"
    if len(steps) != 2:
        return None
    first, second = steps
    if norm is None and first.get("type") == "Digits" and first.get("individual_digits") and byte_level(second, True):
        return "smollm"
    if norm is None and split(first, LLAMA3_SPLIT) and byte_level(second, False):
        return "llama-bpe"
    if (norm is None or norm.get("type") == "NFC") and split(first, QWEN2_SPLIT) and byte_level(second, False):
        return "qwen2"
    return None


def build_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer from an HF folder, as llama.cpp's converter writes it (`gpt2` model)."""
    import gguf  # export checked that it is installed

    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"{folder} has no tokenizer.json: cannot describe its tokenizer to llama.cpp")
    spec = read_json(folder / "tokenizer.json")
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise UserError(
            f"{folder}: a {model.get('type')} tokenizer"
            + (" with byte fallback (sentencepiece style)" if model.get("byte_fallback") else "")
            + " is not exported; only byte-level BPE tokenizers are. "
            "Convert the merged folder with llama.cpp's convert_hf_to_gguf.py"
        )
    pre = pre_tokenizer_name(spec)
    if pre is None:
        raise UserError(
            f"{folder}: its pre-tokenizer is not one llama.cpp is known to reproduce "
            "(GPT-2, SmolLM, Llama 3, Qwen2); refusing to guess. Convert the merged folder with "
            "llama.cpp's convert_hf_to_gguf.py"
        )
    tok = load_tokenizer(folder)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = {i: t for i, t in tok.added_tokens_decoder.items()}
    T = gguf.TokenType
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(T.CONTROL if added[i].special else T.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(T.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens))
    special.chat_template = special.chat_template or tok.chat_template
    # what the tokenizer does, not what its config may leave unsaid: llama.cpp's default adds a BOS to most vocabularies
    probe = tok("a")["input_ids"]
    special.add_special_token = {
        "bos": tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id],
        "eos": tok.eos_token_id is not None and probe[-1:] == [tok.eos_token_id],
    }
    special.add_to_gguf(writer)
