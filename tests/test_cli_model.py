"""`lora-llama generate` / `eval`, the SmolLM2 GGUF, and one-line errors for bad model input."""

import json
import math
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, hf_model
from lora_llama.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True, cwd=ROOT)


def test_help_is_fast_and_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("train", "merge", "push", "generate", "eval"):
        assert cmd in r.stdout
        assert run_cli(cmd, "--help").returncode == 0
    # the CLI module must not pull in torch at import time
    r = subprocess.run(
        [sys.executable, "-c", "import sys, lora_llama.cli; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.stdout.strip() == "False"


def bad_model_cases(tmp_path, tiny_ckpt):
    import shutil

    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "gpt2"
    shutil.copytree(tiny_ckpt, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    trunc = tmp_path / "trunc"
    shutil.copytree(tiny_ckpt, trunc)
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return {
        "missing": (str(tmp_path / "nope"), "not found"),
        "no config": (str(empty), "no config.json"),
        "not llama": (str(other), "'gpt2'"),
        "truncated": (str(trunc), "truncated"),
        "unknown name": ("smollm3-999m", "registered name"),
    }


def test_bad_model_input_is_one_line_exit_2(tmp_path, tiny_ckpt, capsys):
    for label, (model, expect) in bad_model_cases(tmp_path, tiny_ckpt).items():
        code = main(["generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "2"])
        err = capsys.readouterr().err
        assert code == 2, label
        assert expect in err, (label, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (label, err)


def test_generate_prints_the_greedy_continuation(tiny_ckpt, capsys):
    from lora_llama import load_model, load_tokenizer
    from lora_llama.model.generate import generate

    assert main(["generate", "--model", str(tiny_ckpt), "--prompt", "the quick", "--max-new-tokens", "6"]) == 0
    tok = load_tokenizer(tiny_ckpt)
    expected = tok.decode(generate(load_model(tiny_ckpt), tok("the quick")["input_ids"], 6), skip_special_tokens=True)
    assert capsys.readouterr().out == expected + "\n"


def test_eval_loss_equals_transformers(tiny_ckpt, tmp_path, capsys):
    from transformers import AutoTokenizer

    docs = ["the quick brown fox", "to be or not to be, that is the question", "hello world"]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert main(["eval", "--model", str(tiny_ckpt), "--data", str(data)]) == 0
    out = json.loads(capsys.readouterr().out)
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    ref_model = hf_model(tiny_ckpt)
    total, count = 0.0, 0
    with torch.no_grad():
        for d in docs:
            ids = torch.tensor([tok(d)["input_ids"]])
            n = ids.shape[1] - 1
            total += float(ref_model(ids, labels=ids).loss) * n
            count += n
    assert out["tokens"] == count
    assert abs(out["loss"] - total / count) < 1e-5
    assert abs(out["perplexity"] - math.exp(total / count)) < 1e-3
    # a plain text file, one document per line, gives the same numbers
    txt = tmp_path / "docs.txt"
    txt.write_text("\n".join(docs) + "\n")
    assert main(["eval", "--model", str(tiny_ckpt), "--data", str(txt)]) == 0
    assert json.loads(capsys.readouterr().out) == out


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_and_knows_paris(smollm2):
    from transformers import AutoModelForCausalLM

    from lora_llama import load_model, load_tokenizer
    from lora_llama.data.chat import eos_token_ids
    from lora_llama.model.generate import generate

    model = load_model("smollm2-135m-instruct")
    assert model.args.n_layers == 30 and model.args.n_kv_heads == 3 and model.args.tie_word_embeddings
    tok = load_tokenizer("smollm2-135m-instruct")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    with torch.no_grad():
        assert (model(x) - ref(x).logits).abs().max() < 1e-3
    answer = tok.decode(generate(model, prompt, 20, eos_ids=eos_token_ids(model, tok)))
    assert "Paris" in answer


def test_hub_id_offline_is_one_clear_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code = main(["generate", "--model", "someone/some-llama", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "someone/some-llama" in err and len(err.strip().splitlines()) == 1


def test_generate_compare_prints_base_and_adapter_answers(tiny_ckpt, tmp_path, capsys):
    from lora_llama import LoraSettings, apply_lora, load_model, load_tokenizer, save_adapter
    from lora_llama.data.chat import encode_rendered
    from lora_llama.lora.adapted import lora_modules
    from lora_llama.model.generate import generate

    model = load_model(tiny_ckpt)
    torch.manual_seed(0)  # A's initialisation draws from the global generator: the same adapter whatever ran before
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=["q", "v", "o"]))
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    save_adapter(model, tmp_path / "a")
    prompts = ["the quick", "to be"]
    args = [
        "generate",
        "--model",
        str(tiny_ckpt),
        "--adapter",
        str(tmp_path / "a"),
        "--compare",
        "--chat",
        "--max-new-tokens",
        "5",
    ]
    assert main(args + [x for p in prompts for x in ("--prompt", p)]) == 0
    out = capsys.readouterr().out
    tok, base = load_tokenizer(tiny_ckpt), load_model(tiny_ckpt)
    want = []
    for p in prompts:
        ids, _ = encode_rendered(
            tok, tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        )
        answers = [
            tok.decode(generate(m, ids, 5, eos_ids=[tok.eos_token_id]), skip_special_tokens=True).strip()
            for m in (base, model)
        ]
        assert answers[0] != answers[1]  # the adapter changes the answer, so the check can tell them apart
        want += [f"prompt:  {p}", f"base:    {answers[0]}", f"adapter: {answers[1]}", ""]
    assert out.splitlines() == want
    assert main(["generate", "--model", str(tiny_ckpt), "--compare", "--prompt", "x"]) == 2
    assert "--compare needs --adapter" in capsys.readouterr().err
