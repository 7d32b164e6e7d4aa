"""`lora-llama merge` against peft's merge_and_unload, its memory bound, and its refusals."""

import json
from functools import partial

import pytest
import torch

from helpers import build_checkpoint, hf_model, make_adapter, peak_growth, sharded_checkpoint, token_ids
from lora_llama import load_adapter, load_model
from lora_llama.cli import main

ids = partial(token_ids, 2, 20, seed=0)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    d = tmp_path_factory.mktemp("merge")
    base = build_checkpoint(d / "base", shards=3, seed=5)
    return base, make_adapter(base, d / "adapter")


def test_merge_matches_peft_and_native(sharded, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter = sharded
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m")]) == 0
    assert "merged into" in capsys.readouterr().out
    out = tmp_path / "m"
    assert len(list(out.glob("model-*-of-00003.safetensors"))) == 3 and (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    x = ids()
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(x).logits
        ref = PeftModel.from_pretrained(hf_model(base), adapter).merge_and_unload()(x).logits
        native = load_model(base)
        load_adapter(native, adapter)
        unmerged = native(x)
        assert (merged - ref).abs().max() < 1e-5
        assert (merged - unmerged).abs().max() < 1e-4
        assert (load_model(out)(x) - merged).abs().max() < 1e-4


def test_merge_bf16(sharded, tmp_path):
    from safetensors import safe_open

    base, adapter = sharded
    assert (
        main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "b"), "--dtype", "bf16"])
        == 0
    )
    for f in (tmp_path / "b").glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            assert all(sf.get_tensor(k).dtype == torch.bfloat16 for k in sf.keys())
    assert json.loads((tmp_path / "b" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    x = ids()
    with torch.no_grad():
        ref = load_model(tmp_path / "b", dtype=torch.float32)(x)
        fp32 = load_model(base)
        load_adapter(fp32, adapter)
        exact = fp32(x)
    assert (ref - exact).abs().max() / exact.abs().max() < 0.05


def test_tied_lm_head_adapter_leaves_embedding(tmp_path):
    base = build_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    adapter = make_adapter(base, tmp_path / "a", targets=["q", "lm_head"])
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m")]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["tie_word_embeddings"] is False
    x = ids()
    native = load_model(base)
    load_adapter(native, adapter)
    with torch.no_grad():
        assert (load_model(tmp_path / "m")(x) - native(x)).abs().max() < 1e-4
        assert torch.equal(
            load_model(tmp_path / "m").model.embed_tokens.weight, load_model(base).model.embed_tokens.weight
        )


def test_refusals_leave_nothing(sharded, tmp_path, make_ckpt, capsys):
    base, adapter = sharded
    wide = make_ckpt("wide", hidden_size=96)
    wide_adapter = make_adapter(wide, tmp_path / "wa")
    cases = {
        "other hidden size": (["--adapter", str(wide_adapter)], "do not fit"),
        "missing adapter file": (["--adapter", str(tmp_path / "nothing")], "not found"),
    }
    capsys.readouterr()  # drop what building the checkpoints printed
    for label, (extra, message) in cases.items():
        out = tmp_path / label.replace(" ", "_")
        assert main(["merge", "--base", str(base), "--out", str(out), *extra]) == 2, label
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (label, err)
        assert not out.exists()
        assert not list(tmp_path.glob(f".{out.name}*")), "temporary folder left behind"
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(existing)]) == 2
    assert "--force" in capsys.readouterr().err
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]


def test_merge_peak_memory_is_about_one_shard(tmp_path):
    base, shards = sharded_checkpoint(tmp_path / "big", 8)
    adapter = make_adapter(base, tmp_path / "a")
    grown = peak_growth(
        "import torch, safetensors, tqdm.auto, lora_llama.outputs.merge as m, lora_llama.model.config",
        "m.merge_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3], progress=False)",
        base,
        adapter,
        tmp_path / "out",
    )
    largest = max(f.stat().st_size for f in shards)
    adapter_size = (adapter / "adapter_model.safetensors").stat().st_size
    print(f"merge grew {grown / 1e6:.1f} MB; largest shard {largest / 1e6:.1f} MB, adapter {adapter_size / 1e6:.1f} MB")
    assert grown < 2.5 * largest + adapter_size, (grown, largest)
