"""`lora-llama export` (GGUF for llama.cpp / Ollama, and llama.cpp LoRA GGUFs) read back by an independent reader,
transformers' GGUF loader; `merge --onto dequantized`; refusals."""

import json

import pytest
import torch

from helpers import (
    build_checkpoint,
    hf_model,
    make_adapter,
    make_tokenizer,
    peak_growth,
    rel,
    sharded_checkpoint,
    token_ids,
)
from lora_llama import load_model
from lora_llama.cli import main

TEXTS = [
    "hello world, how are you today? i am fine.",
    "The Quick brown fox 12345 jumps\n\nover   the lazy dog's tail!",
    "what's the capital of france? paris is. <|im_end|> to be or not to be",
    "   leading spaces and\ttabs 3.14",
]
MESSAGES = [
    {"role": "user", "content": "what is the capital of france?"},
    {"role": "assistant", "content": "paris is."},
]
TOLERANCE = {"f16": 2e-3, "bf16": 2e-2, "q8_0": 3e-2}  # of the largest |logit|


def gguf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def gguf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def assert_same_model(gguf_path, merged_folder, out_type, vocab):
    x = torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, ours = gguf_model(gguf_path)(x).logits, hf_model(merged_folder)(x).logits
    scale = float(ours.abs().max())
    assert float((theirs - ours).abs().max()) < TOLERANCE[out_type] * scale, (float((theirs - ours).abs().max()), scale)
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() > 0.95


def assert_same_tokenizer(gguf_path, folder):
    from transformers import AutoTokenizer

    theirs, ours = gguf_tokenizer(gguf_path), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours(text)["input_ids"], text
    rendered = ours.apply_chat_template(MESSAGES, tokenize=False)
    assert theirs.apply_chat_template(MESSAGES, tokenize=False) == rendered
    assert theirs(rendered)["input_ids"] == ours(rendered)["input_ids"]


@pytest.mark.parametrize(
    "family, out_type",
    [("llama", "f16"), ("mistral", "f16"), ("qwen2", "f16"), ("qwen3", "f16"), ("llama", "bf16"), ("llama", "q8_0")],
)
def test_exported_gguf_reads_back_as_the_merged_model(family, out_type, tmp_path, capsys):
    # transformers' GGUF reader takes Qwen3's head_dim from its default (128), not from the file: give it 128
    extra = {"head_dim": 128} if family == "qwen3" else {}
    base = build_checkpoint(tmp_path / "base", family=family, **extra)
    adapter = make_adapter(base, tmp_path / "adapter")
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "merged")]) == 0
    out = tmp_path / "gguf" / "model.gguf"
    out.parent.mkdir()
    assert main(["export", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--type", out_type]) == 0
    assert "wrote" in capsys.readouterr().out
    assert_same_model(out, tmp_path / "merged", out_type, 300)
    assert_same_tokenizer(out, tmp_path / "merged")
    assert (out.parent / "model.Modelfile").read_text() == 'FROM ./model.gguf\nPARAMETER stop "<|im_end|>"\n'
    from gguf import GGUFReader

    fields = GGUFReader(out).fields
    arch = fields["general.architecture"].contents()
    assert arch == {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[family]
    assert fields[f"{arch}.attention.key_length"].contents() == (128 if family == "qwen3" else 16)
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.Modelfile", "model.gguf"]  # no temporary left


def tokenizer_with(pre_tokenizer, normalizer=None):
    """The test tokenizer retrained behind another pre-tokenizer (Llama 3's or Qwen2's split)."""
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    from helpers import CORPUS

    fast = make_tokenizer()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder, tok.normalizer = pre_tokenizer, fast.backend_tokenizer.decoder, normalizer
    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]
    from tokenizers import pre_tokenizers

    tok.train_from_iterator(
        CORPUS + TEXTS,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.post_processor = fast.backend_tokenizer.post_processor
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>")
    out.chat_template = fast.chat_template
    return out


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "smollm"])
def test_pre_tokenizers_llama_cpp_knows(name, tmp_path):
    from gguf import GGUFReader
    from tokenizers import Regex, normalizers, pre_tokenizers

    from lora_llama.outputs.gguf_vocab import LLAMA3_SPLIT, QWEN2_SPLIT

    if name == "smollm":
        pre = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        normalizer = None
    else:
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT if name == "llama-bpe" else QWEN2_SPLIT), behavior="isolated")
        pre = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        normalizer = normalizers.NFC() if name == "qwen2" else None
    base = build_checkpoint(tmp_path / "base")
    tokenizer_with(pre, normalizer).save_pretrained(base)
    out = tmp_path / "m.gguf"
    assert main(["export", "--base", str(base), "--out", str(out)]) == 0
    assert GGUFReader(out).fields["tokenizer.ggml.pre"].contents() == name
    if name != "smollm":  # transformers rebuilds Llama 3's and Qwen2's splits from the name; SmolLM's it does not know
        assert_same_tokenizer(out, base)


def test_unknown_tokenizer_and_other_bad_inputs_exit_2_writing_nothing(tmp_path, capsys):
    from tokenizers import pre_tokenizers

    base = build_checkpoint(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter")
    odd = build_checkpoint(tmp_path / "odd")
    tokenizer_with(pre_tokenizers.Whitespace()).save_pretrained(odd)
    other = build_checkpoint(tmp_path / "other", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    gemma = build_checkpoint(tmp_path / "gemma")
    cfg = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma"}))
    (tmp_path / "taken.gguf").write_text("mine")
    cases = [
        (["--base", str(odd), "--out", str(tmp_path / "a.gguf")], "pre-tokenizer"),
        (["--base", str(other), "--adapter", str(adapter), "--out", str(tmp_path / "b.gguf")], "do not fit"),
        (["--base", str(gemma), "--out", str(tmp_path / "c.gguf")], "model_type 'gemma'"),
        (["--base", str(base), "--out", str(tmp_path / "taken.gguf")], "already exists"),
        (["--base", str(base), "--out", str(tmp_path / "d.bin")], ".gguf"),
        (["--adapter", str(tmp_path / "nope"), "--lora-gguf", str(tmp_path / "e.gguf")], "adapter folder not found"),
    ]
    capsys.readouterr()
    for argv, message in cases:
        assert main(["export", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base", "gemma", "odd", "other", "taken.gguf"]
    assert (tmp_path / "taken.gguf").read_text() == "mine"


def test_lora_gguf_holds_the_adapter_in_the_model_files_layout(tmp_path):
    """Read back: every lora_b @ lora_a · alpha / r is the weight change between the exported base and the exported
    merged model (llama layout: q and k rows permuted), and each pair fits its weight as llama.cpp checks."""
    from gguf import GGUFReader

    base = build_checkpoint(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", std=1.0)
    assert main(["export", "--adapter", str(adapter), "--lora-gguf", str(tmp_path / "lora.gguf")]) == 0
    (tmp_path / "plain").mkdir(), (tmp_path / "merged").mkdir()
    assert main(["export", "--base", str(base), "--out", str(tmp_path / "plain" / "m.gguf")]) == 0
    assert (
        main(["export", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "merged" / "m.gguf")])
        == 0
    )
    lora = GGUFReader(tmp_path / "lora.gguf")
    assert lora.fields["general.type"].contents() == "adapter" and lora.fields["adapter.type"].contents() == "lora"
    alpha = lora.fields["adapter.lora.alpha"].contents()
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in lora.tensors}

    def read(p):
        return {t.name: torch.from_numpy(t.data.astype("float32")) for t in GGUFReader(p).tensors}

    plain, merged = read(tmp_path / "plain" / "m.gguf"), read(tmp_path / "merged" / "m.gguf")
    assert len(tensors) == 2 * 7 * 2
    for name in {n.rsplit(".", 1)[0] for n in tensors}:
        a, b = tensors[name + ".lora_a"], tensors[name + ".lora_b"]
        assert a.shape[1] == plain[name].shape[1] and b.shape[0] == plain[name].shape[0] and a.shape[0] == b.shape[1]
        delta = (b @ a) * alpha / a.shape[0]
        assert torch.allclose(merged[name] - plain[name], delta, atol=2e-3 * float(delta.abs().max()) + 1e-3), name


def test_four_exports_share_a_folder_each_with_its_modelfile(tmp_path):
    """f16 and q8_0 of the merged model, the base alone and the adapter as a LoRA GGUF over that base, in one folder:
    each GGUF has FILE.Modelfile, and the LoRA file's names its base (FROM) and itself (ADAPTER), as Ollama reads."""
    base = build_checkpoint(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter")
    out = tmp_path / "out"
    out.mkdir()
    merged = ["export", "--base", str(base), "--adapter", str(adapter)]
    assert main([*merged, "--out", str(out / "chat-f16.gguf")]) == 0
    assert main([*merged, "--out", str(out / "chat-q8_0.gguf"), "--type", "q8_0"]) == 0
    assert main(["export", "--base", str(base), "--out", str(out / "base.gguf")]) == 0
    lora = ["export", "--base", str(out / "base.gguf"), "--adapter", str(adapter), "--lora-gguf"]
    assert main([*lora, str(out / "chat-lora.gguf")]) == 0
    stem = {"f16": "chat-f16", "q8_0": "chat-q8_0", "base": "base", "lora": "chat-lora"}
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{s}.{ext}" for s in stem.values() for ext in ("gguf", "Modelfile")
    )
    stop = 'PARAMETER stop "<|im_end|>"\n'
    for name in ("chat-f16", "chat-q8_0", "base"):
        assert (out / f"{name}.Modelfile").read_text() == f"FROM ./{name}.gguf\n" + stop
    assert (out / "chat-lora.Modelfile").read_text() == "FROM ./base.gguf\nADAPTER ./chat-lora.gguf\n" + stop
    # a second export under a taken name is refused whole, the first file's Modelfile untouched
    assert main([*merged, "--out", str(out / "chat-f16.gguf")]) == 2
    assert main([*lora, str(out / "chat-lora.gguf")]) == 2
    assert (out / "chat-lora.Modelfile").read_text().startswith("FROM ./base.gguf")


@pytest.mark.slow
def test_smollm2_with_adapter(smollm2, tmp_path):
    """A GGUF base: its tokenizer is copied; the merged model, in f16 and q8_0 (size within 2% of the tensors' own)."""
    from gguf import GGUFReader

    adapter = make_adapter("smollm2-135m-instruct", tmp_path / "adapter", targets=["q", "k", "v", "o"], std=0.02)
    assert (
        main(["merge", "--base", "smollm2-135m-instruct", "--adapter", str(adapter), "--out", str(tmp_path / "merged")])
        == 0
    )
    for out_type in ("f16", "q8_0"):
        out = tmp_path / out_type / "smol.gguf"
        out.parent.mkdir()
        assert (
            main(
                [
                    "export",
                    "--base",
                    "smollm2-135m-instruct",
                    "--adapter",
                    str(adapter),
                    "--out",
                    str(out),
                    "--type",
                    out_type,
                ]
            )
            == 0
        )
        if out_type == "f16":
            assert_same_model(out, tmp_path / "merged", out_type, 49152)
            assert_same_tokenizer(out, tmp_path / "merged")
            assert 'PARAMETER stop "<|im_end|>"' in out.with_suffix(".Modelfile").read_text()
        else:
            reader = GGUFReader(out)
            expected = sum(t.n_elements * (34 / 32 if len(t.shape) > 1 else 4) for t in reader.tensors)
            assert abs(out.stat().st_size / expected - 1) < 0.02, (out.stat().st_size, expected)
            source = GGUFReader(smollm2)
            for key in (
                "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges",
                "tokenizer.chat_template",
                "tokenizer.ggml.pre",
            ):
                assert reader.fields[key].contents() == source.fields[key].contents(), key


def test_merge_onto_dequantized_reproduces_the_adapter_on_int8(tmp_path, capsys):
    base = build_checkpoint(tmp_path / "base")
    run = tmp_path / "run"
    adapter = make_adapter(base, run / "adapter", std=0.3)
    (run / "recipe.yaml").write_text("model: {quantize: int8}\n")
    x = token_ids(2, 24, seed=2)
    trained = load_model(base, quantize="int8")
    from lora_llama.loading.adapters import load_adapter

    load_adapter(trained, adapter)
    # training mode: bitsandbytes then multiplies with dequantised weights, as it did while the adapter trained (its
    # inference kernels quantise the activations to int8 too, which no fold of weights can reproduce)
    with torch.no_grad():
        expected = trained.train()(x)

    def merge(out, *onto):
        return main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / out), *onto])

    assert merge("deq", "--onto", "dequantized") == 0  # int8 read from the run's recipe.yaml
    assert merge("orig", "--onto", "original") == 0
    assert merge("default") == 0
    with torch.no_grad():
        deq, orig = load_model(tmp_path / "deq")(x), load_model(tmp_path / "orig")(x)
    assert rel(deq, expected) < 1e-3 < rel(orig, expected), (rel(deq, expected), rel(orig, expected))
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / folder / "model-00001-of-00001.safetensors") for folder in ("orig", "default"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (run / "recipe.yaml").unlink()
    assert merge("x", "--onto", "dequantized") == 2
    assert "--quantize" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_export_peak_memory_is_about_one_shard(tmp_path):
    base, shards = sharded_checkpoint(tmp_path / "big", 4)
    adapter = make_adapter(base, tmp_path / "a")
    # the tokenizer's modules (transformers' tokenization, jinja) load first: a fixed cost, whatever the model's size
    grown = peak_growth(
        "import torch, safetensors, gguf, numpy, tqdm.auto, transformers, lora_llama.outputs.export as e\n"
        "from lora_llama.data.chat import end_of_turn_id\nend_of_turn_id(e.load_tokenizer(sys.argv[1]))",
        "e.export_gguf(sys.argv[1], sys.argv[3], adapter=sys.argv[2], progress=False)",
        base,
        adapter,
        tmp_path / "out.gguf",
    )
    largest = max(f.stat().st_size for f in shards)
    print(f"export grew {grown / 1e6:.1f} MB; largest shard {largest / 1e6:.1f} MB")
    assert grown < 2.5 * largest, (grown, largest)
