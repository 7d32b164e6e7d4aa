"""The tokenizer of an exported GGUF: copied from a source GGUF, or built from an HF folder: its sentencepiece model
(tokenizer.model) as llama.cpp's converter reads one, or its tokenizer.json when it is byte-level BPE with a
pre-tokenizer llama.cpp knows, recognised by structure (GPT-2, SmolLM, Llama 3, Qwen2); anything else is refused,
never guessed.
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


def build_tokenizer(writer, folder: Path, vocab_size: int, gemma: bool = False) -> None:
    """An HF folder's tokenizer as llama.cpp's converter writes it: a sentencepiece model (tokenizer.model) as
    `llama`, else a byte-level BPE tokenizer.json as `gpt2`."""
    import gguf  # export checked that it is installed

    if (folder / "tokenizer.model").is_file():
        tokens, scores, types = sentencepiece_vocab(folder, vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        if gemma:  # Gemma's sentencepiece model adds no space before the text
            writer.add_add_space_prefix(False)
        special_vocab(folder, len(tokens), load_tokenizer(folder)).add_to_gguf(writer)
        return
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
    special_vocab(folder, len(tokens), tok, merges=True).add_to_gguf(writer)


def special_vocab(folder: Path, n_vocab: int, tok, merges: bool = False):
    """gguf's SpecialVocab of the folder (special ids, merges, chat template), with whether a BOS and an EOS are
    added taken from what its tokenizer `tok` does, not what its config may leave unsaid (llama.cpp's default adds a
    BOS to most vocabularies)."""
    import gguf

    special = gguf.SpecialVocab(folder, load_merges=merges, n_vocab=n_vocab)
    special.chat_template = special.chat_template or tok.chat_template
    probe = tok("a")["input_ids"]
    special.add_special_token = {
        "bos": tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id],
        "eos": tok.eos_token_id is not None and probe[-1:] == [tok.eos_token_id],
    }
    return special


def sentencepiece_vocab(folder: Path, vocab_size: int) -> tuple[list[bytes], list[float], list[int]]:
    """(tokens, scores, types) of a sentencepiece model as llama.cpp's converter makes them
    (`_create_vocab_sentencepiece`): each piece with its score and kind, ids the model lacks `[PADi]` (unused),
    tokenizer_config's added tokens over them (control when special, else user-defined, score -1000)."""
    import gguf

    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise UserError(
            "exporting a sentencepiece tokenizer (tokenizer.model) needs: pip install sentencepiece"
        ) from None
    sp = SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    T = gguf.TokenType
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores, types = [-10000.0] * vocab_size, [T.UNUSED] * vocab_size
    for i in range(min(sp.vocab_size(), vocab_size)):
        kinds = ((sp.IsUnknown, T.UNKNOWN), (sp.IsControl, T.CONTROL), (sp.IsUnused, T.UNUSED), (sp.IsByte, T.BYTE))
        tokens[i], scores[i] = sp.IdToPiece(i).encode(), sp.GetScore(i)
        types[i] = next((kind for test, kind in kinds if test(i)), T.NORMAL)
    config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    for i, added in ((int(k), v) for k, v in (config.get("added_tokens_decoder") or {}).items()):
        if i < vocab_size:
            special = added.get("special") or looks_special(added["content"])
            text = added["content"] if special else added["content"].replace("\u2581", " ")
            tokens[i], scores[i], types[i] = text.encode(), -1000.0, T.CONTROL if special else T.USER_DEFINED
    return tokens, scores, types


def looks_special(token: str) -> bool:
    """The converter's `does_token_look_special`: added tokens some models leave unmarked that are control tokens."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )
