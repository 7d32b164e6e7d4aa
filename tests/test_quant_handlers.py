"""One handler per quantized format: what each says of itself (layout, bytes, rows) checked against the layers and
tensors it makes, and the rest of the package naming no format."""

import ast
import pathlib

import pytest
import torch

from lora_llama.errors import UserError
from lora_llama.quant.handlers import BY_SETTING, NF4, FileBlocks, Int8, chosen_format, layer_format, quant_format
from lora_llama.quant.linear import QuantizedLinear, tensor_bytes
from lora_llama.quant.names import FROM_FLOAT, SETTINGS

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lora_llama"


def test_each_setting_has_its_handler():
    assert tuple(BY_SETTING) == SETTINGS
    assert FROM_FLOAT == tuple(k for k in SETTINGS if BY_SETTING[k].from_float)
    assert [type(quant_format(s)) for s in SETTINGS] == [Int8, NF4, FileBlocks]
    with pytest.raises(UserError, match="unknown quantize 'int4' \\(use int8 or nf4 or source\\)"):
        quant_format("int4")


@pytest.mark.parametrize("fmt", [Int8(), NF4(), NF4(double_quant=True)], ids=repr)
@pytest.mark.parametrize("shape", [(48, 256), (40, 96)])  # nf4: rows of whole blocks, and laid out flat
def test_layout_and_bytes_are_those_of_the_tensors_made(fmt, shape):
    w = torch.randn(shape)
    made = fmt.quantize(w)
    assert {k: (tuple(t.shape), t.dtype) for k, t in made.items()} == fmt.layout(*shape)
    layer = QuantizedLinear.from_tensors(shape[1], shape[0], fmt.name, made)
    assert fmt.bytes(*shape) == tensor_bytes(layer)
    assert repr(layer.quant_format()) == repr(fmt)


def test_gguf_blocks_layout_is_that_of_the_file_rows():
    from helpers import quantized_layers

    for kind, layer in quantized_layers(rows=8, in_features=512).items():
        fmt = layer.quant_format()
        assert fmt.bytes(8, 512) == tensor_bytes(layer), kind
        assert torch.equal(fmt.dequantize(dict(layer.named_buffers()), (8, 512), torch.float32), layer.dequantize())


def test_bytes_by_hand():
    """int8: a byte a weight and a float32 scale a row; nf4: half a byte and a float32 absmax per 64; with double
    quantization a byte per 64 and a float32 per 256 blocks, plus the offset."""
    assert Int8().bytes(4096, 4096) == 4096 * 4096 + 4 * 4096
    assert NF4().bytes(4096, 4096) == 4096 * 4096 / 2 + 4 * 4096 * 4096 / 64
    assert NF4(double_quant=True).bytes(4096, 4096) == 4096 * 4096 / 2 + 4096 * 4096 / 64 + 4 * 1024 + 4


@pytest.mark.parametrize("fmt", [Int8(), NF4(), NF4(double_quant=True)], ids=repr)
def test_rows_quantized_alone_are_those_of_the_whole_weight(fmt):
    w = torch.randn(12, 128)
    whole, part = fmt.quantize(w), fmt.quantize_rows(lambda lo, hi: w[lo:hi], 12, 4, 9)
    for name, t in part.items():
        assert torch.equal(t, whole[name][4:9] if name in ("codes", "scales") else whole[name]), name  # by row


def test_round_trip_is_the_quantized_weight():
    w = torch.randn(16, 128)
    for fmt in (Int8(), NF4(), NF4(double_quant=True)):
        layer = QuantizedLinear.from_tensors(128, 16, fmt.name, fmt.quantize(w))
        assert torch.equal(fmt.roundtrip(w), layer.dequantize()), fmt
    assert torch.equal(FileBlocks().roundtrip(w), w)


def test_settings_come_from_a_model_section_a_mapping_or_the_command_line():
    import argparse

    assert repr(chosen_format({"quantize": "nf4", "nf4_double_quant": True})) == "NF4(double_quant=True)"
    assert repr(chosen_format(argparse.Namespace(quantize="int8", nf4_double_quant=False))) == "Int8(products=False)"
    assert repr(chosen_format({"quantize": "int8", "int8_products": True})) == "Int8(products=True)"
    assert Int8(products=True).settings() == {"quantize": "int8", "int8_products": True}
    assert chosen_format({}) is None and chosen_format(argparse.Namespace()) is None
    assert NF4(double_quant=True).settings() == {"quantize": "nf4", "nf4_double_quant": True}
    assert layer_format("nf4", ["codes", "scales", "absmax2", "offset"]).double_quant


def format_names(path: pathlib.Path) -> list[str]:
    """'line: text' for each string constant or name in a module that names a quantized format's setting or nf4's
    double quantization (the safetensors dtype table's "int8" is torch's dtype name, not the format)."""
    found, tree = [], ast.parse(path.read_text())
    dtype_tables = [
        n for n in ast.walk(tree) if isinstance(n, ast.Dict) and any(getattr(k, "value", None) == "I8" for k in n.keys)
    ]
    skipped = {id(v) for table in dtype_tables for v in table.values}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
        text = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else text
        if text in ("int8", "nf4") or isinstance(text, str) and "double_quant" in text and " " not in text:
            found.append(f"{node.lineno}: {text}")
    return found


def test_no_module_outside_the_handlers_names_a_format():
    outside = [
        p
        for p in PACKAGE.rglob("*.py")
        if p.parent.name != "quant" and p.relative_to(PACKAGE).as_posix() != "recipe/schema.py"
    ]
    found = {p.relative_to(PACKAGE).as_posix(): format_names(p) for p in outside}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_the_format_check_sees_a_format(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('if kind == "nf4":\n    load(args.nf4_double_quant)\nDTYPES = {"I8": "int8"}\n')
    assert format_names(f) == ["1: nf4", "2: nf4_double_quant"]


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_bf16_dequantization_on_the_cpu_is_one_c_loop(monkeypatch, kind):
    """The handler's bf16 weight comes from dequantize.c's loop, equal bit for bit to torch's kernels' float32 weight
    rounded once to bf16."""
    from lora_llama.quant import formats

    if formats._library() is None:
        pytest.skip("no C compiler here")
    calls, loop = [], formats._loop
    monkeypatch.setattr(formats, "_loop", lambda *a: calls.append(a) or loop(*a))
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    fmt = quant_format(kind)
    tensors = fmt.quantize(w)
    got = fmt.dequantize(tensors, w.shape, torch.bfloat16)
    assert calls == [(kind, torch.bfloat16)]
    monkeypatch.setattr(formats, "_loop", lambda *a: None)  # torch's kernels
    assert torch.equal(got, fmt.dequantize(tensors, w.shape, torch.float32).bfloat16())
