"""Model sources (loading/models.py), the file layer under them (files.py) and registered names (registry.py)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import build_checkpoint, hf_model
from lora_llama import UserError, load_model
from lora_llama.cli import main
from lora_llama.files.atomic import atomic_dir
from lora_llama.files.shards import shard_files, write_safetensors_streaming
from lora_llama.loading.models import gguf_cache_key, gguf_to_folder, resolve_source
from lora_llama.registry import is_hub_id, package_dir


def test_load_model_records_where_it_came_from_and_matches_transformers(tiny_ckpt):
    model = load_model(tiny_ckpt)
    assert model.source == str(tiny_ckpt) and model.folder == tiny_ckpt
    ref = hf_model(tiny_ckpt)
    assert set(model.state_dict()) == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert not model.training and all(p.requires_grad for p in model.parameters())


def test_the_gguf_cache_is_keyed_by_content(tiny_ckpt, tmp_path, monkeypatch):
    """The same GGUF at two paths (two virtual environments) is dequantised once; other bytes make a new entry."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    monkeypatch.setenv("LORA_LLAMA_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    a.parent.mkdir(), b.parent.mkdir()
    assert main(["export", "--base", str(tiny_ckpt), "--out", str(a)]) == 0
    shutil.copy(a, b)
    os.utime(b, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 10**9))
    first = gguf_to_folder(a)
    conversions = []
    read = gguf_utils.load_gguf_checkpoint
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", lambda *x, **k: conversions.append(x[0]) or read(*x, **k))
    assert gguf_to_folder(b) == first and conversions == []
    key, seen = gguf_cache_key(b)
    assert seen.read_text() == key and first.name.endswith(key)  # remembered: the next lookup reads no GGUF bytes
    assert load_model(b).state_dict().keys() == load_model(tiny_ckpt).state_dict().keys()

    other = build_checkpoint(tmp_path / "other", seed=1)
    b.unlink()
    assert main(["export", "--base", str(other), "--out", str(b)]) == 0  # changed in place: new bytes, new mtime
    second = gguf_to_folder(b)
    assert second != first and set(conversions) == {str(b)}  # read again (config, tensors, tokenizer)
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == sorted([".seen", first.name, second.name])
    assert not torch.equal(
        load_model(b).state_dict()["model.norm.weight"], load_model(a).state_dict()["model.norm.weight"]
    )


def test_sources_that_are_not_models(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    cases = {
        tmp_path / "empty": "has no config.json",
        tmp_path / "notes.txt": "neither a model folder nor a .gguf",
        tmp_path / "nothing": "model not found",
        "not a name": "model not found",
    }
    for source, message in cases.items():
        with pytest.raises(UserError, match=message):
            resolve_source(source)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}),
            "unexpected tensor 'model.layers.0.extra.weight'",
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.zeros(3)}),
            r"model.norm.weight has shape \(3,\), config.json implies \(64,\)",
        ),
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            "lacks 1 tensors, first 'model.layers.1.mlp.up_proj.weight'",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_its_config_is_one_line(tiny_ckpt, tmp_path, edit, message):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    tensors = load_file(tiny_ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(UserError, match=message):
        load_model(folder)


def test_broken_files_name_the_file(tiny_ckpt, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json is not valid JSON"):
        load_model(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="config.json does not hold a JSON object"):
        load_model(folder)
    (folder / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    (folder / "model.safetensors").write_bytes((tiny_ckpt / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(UserError, match="cannot read .*model.safetensors: truncated"):
        load_model(folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(UserError, match="shard model-1.safetensors named in model.safetensors.index.json is missing"):
        shard_files(folder)


def test_atomic_dir_publishes_only_complete_folders(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("crash while writing")
    assert list(tmp_path.iterdir()) == []  # neither the result nor the temporary folder
    with atomic_dir(out) as tmp:
        (tmp / "a").write_text("first")
    with pytest.raises(UserError, match="already exists"):
        with atomic_dir(out):
            pass
    with pytest.raises(RuntimeError):
        with atomic_dir(out, force=True) as tmp:
            raise RuntimeError("crash")
    assert (out / "a").read_text() == "first"  # force replaces only after success
    with atomic_dir(out, force=True) as tmp:
        (tmp / "b").write_text("second")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["b"]


def test_streaming_writer_is_read_by_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16()}
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    size = write_safetensors_streaming(tmp_path / "x.safetensors", entries, iter(tensors.values()), {"format": "pt"})
    assert size == 3 * 5 * 4 + 7 * 8 + 4 * 2
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="header says"):
        write_safetensors_streaming(tmp_path / "y.safetensors", entries, iter([torch.zeros(2)] * 3))


def test_hub_id_detection(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("user/my.data_set-2")
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "model").mkdir()
    for not_hub in ("local/model", "./a/b", "/abs/path", "~/x", "a/b/c", "plain", "a b/c"):
        assert not is_hub_id(not_hub), not_hub


def test_a_registered_name_whose_package_is_missing_says_how_to_install():
    with pytest.raises(UserError, match="needs the package 'no_such_pkg_xyz': pip install x"):
        package_dir("no_such_pkg_xyz", "pip install x", "model 'm'")
