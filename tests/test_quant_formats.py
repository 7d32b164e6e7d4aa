"""int8 and nf4 as formats: quantized and dequantized against bitsandbytes and by hand, and which kernel dequantizes
nf4 on the CPU."""

import pytest
import torch

from lora_llama.quant import formats
from lora_llama.quant.formats import NF4_CODE, dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4
from lora_llama.quant.handlers import quant_format


def test_int8_by_hand():
    w = torch.tensor([[0.5, -1.27, 0.013, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 1.1, -0.999, 0.004]])
    q, scale = quantize_int8(w)
    assert torch.allclose(scale, torch.tensor([0.01, 0.0, 2.0 / 127]))  # absmax(row) / 127
    assert q.tolist() == [[50, -127, 1, 0], [0, 0, 0, 0], [127, 70, -63, 0]]  # round(w / scale): 69.85, -63.44, 0.25
    assert torch.equal(dequantize_int8(q, scale), q.float() * scale[:, None])


@pytest.mark.parametrize("isa", [None, "AVX2", "SSE41"])  # the loops built for AVX-512 (where the CPU has it), AVX2, C
def test_each_build_of_the_loops_writes_the_formulas_values(isa, monkeypatch, tmp_path):
    """Every byte value of nf4 and every int8 code against scales of every magnitude (subnormal products and ties
    between two bf16 values included), bf16 and float32, by each instruction set's build of dequantize.c
    (ONEDNN_MAX_CPU_ISA caps the build): the float32 product rounded to nearest even, as torch rounds it."""
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    formats._library.cache_clear()
    try:
        if formats._library() is None:
            pytest.skip("no C compiler here")
        g = torch.Generator().manual_seed(5)
        packed = torch.arange(256, dtype=torch.uint8).repeat(4)[torch.randperm(1024, generator=g)].view(16, 64)
        absmax = torch.tensor([1.0, 0.03, 7.5, 1e-39, 2.0**-126, 0.0, 123.4, 1 + 2**-7 + 2**-8]).repeat(4).view(16, 2)
        scales = torch.tensor([1.0, 1e-3, 0.0078740157, 3.7e-42, 2.0**-100, 0.0, 1234.5, 1 + 2**-7 + 2**-8])
        q = torch.arange(-127, 128, dtype=torch.int8).repeat(len(scales), 3)[:, :757]  # no whole number of vectors
        for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
            want = formats._nf4_eager(packed, absmax, 2048, dtype).view(16, 128)
            assert torch.equal(dequantize_nf4(packed, absmax, (16, 128), dtype).view(bits), want.view(bits))
            want = q.to(torch.float32).mul_(scales[:, None]).to(dtype)
            assert torch.equal(dequantize_int8(q, scales, dtype).view(bits), want.view(bits))
            assert torch.equal(dequantize_int8(q[:, 1::2], scales, dtype), want[:, 1::2])  # strided codes
    finally:
        formats._library.cache_clear()


def test_without_a_compiler_one_warning_and_torch_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(formats, "_bitsandbytes_on_cpu", lambda: False)
    formats._library.cache_clear()
    try:
        q, scale = quantize_int8(torch.randn(6, 128, generator=torch.Generator().manual_seed(3)))
        codes, absmax = quantize_nf4(q.float())
        with pytest.warns(UserWarning, match="quantized bases dequantize through torch's kernels"):
            got = dequantize_int8(q, scale, torch.bfloat16)
        assert formats._library() is None
        assert torch.equal(got, (q.float() * scale[:, None]).bfloat16())
        assert torch.equal(
            dequantize_nf4(codes, absmax, q.shape, torch.bfloat16),
            formats._nf4_eager(codes, absmax, q.numel(), torch.bfloat16).view(q.shape),
        )
    finally:
        formats._library.cache_clear()


# on the CPU by dequantize.c's loop, by bitsandbytes' kernel, or by the formulas here
@pytest.mark.parametrize("kernel", ["loop", "bitsandbytes", "formulas"])
@pytest.mark.parametrize("shape", [(96, 128), (7, 40), (3, 5), (1, 50), (40, 64)])  # (1, 50): an odd count of bytes
def test_nf4_equals_bitsandbytes(shape, kernel, monkeypatch):
    bnb = pytest.importorskip("bitsandbytes.functional")
    if kernel != "loop":
        monkeypatch.setattr(formats, "_loop", lambda kind, dtype: None)
    if kernel == "formulas":
        monkeypatch.setattr(formats, "_bitsandbytes_on_cpu", lambda: False)
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0, 0] = 0.9  # an outlier: its block's absmax
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4")
    codes, absmax = quantize_nf4(w)
    assert torch.equal(codes.reshape(-1), packed.reshape(-1)) and torch.equal(absmax.reshape(-1), state.absmax)
    assert torch.equal(dequantize_nf4(codes, absmax, w.shape), bnb.dequantize_4bit(packed, state))
    assert torch.equal(quant_format("nf4").roundtrip(w), bnb.dequantize_4bit(packed, state))
    shifted = torch.empty(codes.numel() + 1, dtype=torch.uint8)[1:]  # the same bytes at an odd offset
    shifted.copy_(codes.reshape(-1))
    assert torch.equal(dequantize_nf4(shifted, absmax, w.shape), bnb.dequantize_4bit(packed, state))
    # bf16: bitsandbytes' float32 weight rounded once
    assert torch.equal(
        dequantize_nf4(codes, absmax, w.shape, torch.bfloat16), bnb.dequantize_4bit(packed, state).bfloat16()
    )


def test_nf4_by_bitsandbytes_on_cpu_only_where_equal(monkeypatch):
    """bf16 on the CPU takes bitsandbytes' kernel once it has reproduced the formulas on every byte value (float32
    keeps the formulas: the import's memory); a kernel that differs is never used."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(formats, "_loop", lambda kind, dtype: None)  # as where dequantize.c is not built
    formats._bitsandbytes_on_cpu.cache_clear()
    try:
        assert formats._bitsandbytes_on_cpu()
        calls = []
        real = formats.nf4_by_bitsandbytes
        monkeypatch.setattr(formats, "nf4_by_bitsandbytes", lambda *a: calls.append(a[2]) or real(*a))
        codes, absmax = quantize_nf4(torch.randn(64, 128, generator=torch.Generator().manual_seed(1)))
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(
                dequantize_nf4(codes, absmax, (64, 128), dtype),
                formats._nf4_eager(codes, absmax, 8192, dtype).view(64, 128),
            )
        assert calls == [(64, 128)]  # the bf16 weight
        formats._bitsandbytes_on_cpu.cache_clear()
        monkeypatch.setattr(
            formats, "nf4_by_bitsandbytes", lambda codes, absmax, shape, dtype: real(codes, absmax * 2, shape, dtype)
        )
        assert not formats._bitsandbytes_on_cpu()
    finally:
        formats._bitsandbytes_on_cpu.cache_clear()


def test_nf4_codebook_and_layout_by_hand():
    w = torch.tensor([[1.0, -1.0, 0.0, 0.5] * 16])  # one block of 64, absmax 1
    codes, absmax = quantize_nf4(w)
    assert absmax.tolist() == [[1.0]] and codes.shape == (1, 32)
    # 1.0 -> code 15, -1.0 -> 0, 0.0 -> 7, 0.5 -> the nearest value, 0.4407 (12); the first of a pair in the high nibble
    assert codes[0, :2].tolist() == [15 << 4 | 0, 7 << 4 | 12]
    assert dequantize_nf4(codes, absmax, w.shape)[0, :4].tolist() == [1.0, -1.0, 0.0, NF4_CODE[12]]
