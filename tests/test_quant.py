"""Frozen int8 / nf4 base weights, weight-only: the formats against bitsandbytes and a hand computation, the
layer against a float nn.Linear holding the dequantized weight, training, memory, resume, PEFT, merge."""

import pytest
import torch

from helpers import ALL, ROOT, hf_model, peak_growth, random_lora_b, rel, sharded_checkpoint, token_ids
from lora_llama import LoraSettings, apply_lora, load_adapter, load_model, merge_lora, save_adapter
from lora_llama.lora.adapted import lora_modules
from lora_llama.objectives.token_losses import target_loss
from lora_llama.quant.formats import (
    quantize_absmax,
    quantize_nf4,
)
from lora_llama.quant.handlers import NF4, quant_format
from lora_llama.quant.linear import QuantizedLinear, base_weight_bytes


def ids(seed=0):
    return token_ids(2, 24, seed)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_layer_equals_a_float_linear_holding_the_dequantized_weight(kind):
    g = torch.Generator().manual_seed(1)
    plain = torch.nn.Linear(128, 96).requires_grad_(False)
    q = QuantizedLinear.from_linear(plain, kind)
    ref = torch.nn.Linear(128, 96).requires_grad_(False)
    ref.weight.copy_(quant_format(kind).roundtrip(plain.weight))
    ref.bias.copy_(plain.bias)
    x = torch.randn(5, 7, 128, generator=g, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    gy = torch.randn(5, 7, 96, generator=g)
    y, y_ref = q(x), ref(x_ref)
    y.backward(gy)
    y_ref.backward(gy)
    assert rel(y, y_ref) < 1e-6 and rel(x.grad, x_ref.grad) < 1e-6
    assert q.codes.dtype == (torch.int8 if kind == "int8" else torch.uint8) and not q.weight.is_floating_point()


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_nothing_weight_sized_is_kept_for_backward(tiny_ckpt, kind):
    """What autograd saves over a forward with every linear adapted: activations only, no (out, in) weight."""
    model = load_model(tiny_ckpt, quantize=kind)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    weight_sizes = {m.base_layer.in_features * m.base_layer.out_features for m in lora_modules(model).values()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.numel(), t.dtype)) or t, lambda t: t):
        loss, n = target_loss(model, ids(), ids())
    float_saved = [(s, d) for s, d in saved if d.is_floating_point and s in weight_sizes]
    assert not float_saved, float_saved
    (loss / n).backward()
    grads = {k for k, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".lora_A." in k or ".lora_B." in k for k in grads)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_logits_equal_the_round_tripped_float_model(tiny_ckpt, kind):
    q = load_model(tiny_ckpt, quantize=kind)
    assert type(q.model.layers[0].mlp.up_proj) is QuantizedLinear and type(q.lm_head) is torch.nn.Linear
    ref = load_model(tiny_ckpt)
    with torch.no_grad():
        for block in ref.model.layers:
            for parent in (block.self_attn, block.mlp):
                for lin in parent.children():
                    if type(lin) is torch.nn.Linear:
                        lin.weight.copy_(quant_format(kind).roundtrip(lin.weight))
        assert rel(q(ids()), ref(ids())) < 1e-5


@pytest.mark.parametrize("kind,ratio", [("int8", 0.27), ("nf4", 0.16)])
def test_base_bytes(tiny_ckpt, kind, ratio):
    fp = base_weight_bytes(load_model(tiny_ckpt), decoder_linears_only=True)
    q = base_weight_bytes(load_model(tiny_ckpt, quantize=kind), decoder_linears_only=True)
    assert q <= ratio * fp, (q, fp)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_run_trains_and_resumes_bit_for_bit(tiny_ckpt, tmp_path, kind):
    from safetensors.torch import load_file
    from test_train import chat_file, metrics, recipe

    from lora_llama.training.from_recipe import train_from_recipe

    data = chat_file(tmp_path / "d.jsonl")
    settings = (
        f"model.quantize={kind}",
        "train.max_steps=12",
        "train.batch_size=8",
        "train.lr=1e-2",
        "lora.targets=[q,k,v,o,gate,up,down]",
        "train.schedule=constant",
        "train.eval_every=1000",
        "train.save_every=6",
    )
    said = []
    train_from_recipe(
        recipe(tiny_ckpt, data, tmp_path / "full", *settings), log=lambda *a: said.append(" ".join(map(str, a)))
    )
    losses = [m["loss"] for m in metrics(tmp_path / "full") if "loss" in m]
    assert losses[-1] < 0.9 * losses[0]
    # the steps keep freed memory for the next step (runtime/allocator.py), a quantized base's too
    assert any(line.startswith("allocator: glibc keeps freed memory") for line in said) or any(
        line.startswith("allocator: left to the environment") for line in said
    ), said
    train_from_recipe(
        recipe(tiny_ckpt, data, tmp_path / "cut", *settings[:1], "train.max_steps=6", *settings[2:]),
        log=lambda *_: None,
    )
    train_from_recipe(recipe(tiny_ckpt, data, tmp_path / "cut", *settings), resume=True, log=lambda *_: None)
    full, cut = (load_file(tmp_path / r / "adapter" / "adapter_model.safetensors") for r in ("full", "cut"))
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)


@pytest.mark.parametrize("how", ["rows", "whole"])
def test_products_on_a_quantized_base_allocate_nothing_weight_sized(how, monkeypatch):
    """Products on CPU weights over kernels/workspace.WHOLE_WEIGHTS (each dequantized for forward and again for
    backward) allocate nothing near a weight's size once the reusable buffer has grown: each weight is written into
    that buffer a chunk at a time, so no piece of weight size is freed into the heap a training step keeps. The
    control, each weight dequantized whole, allocates a weight-sized tensor for each forward and backward
    product, and the measure (every op's newly allocated outputs, backward included) sees them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lora_llama.kernels import workspace

    if how == "whole":
        monkeypatch.setattr(
            QuantizedLinear,
            "transient_weight",
            lambda self, dtype, transposed=False: self.dequantize(dtype).t() if transposed else self.dequantize(dtype),
        )
    allocated = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {
                t.untyped_storage().data_ptr()
                for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            }
            allocated.extend(
                t.untyped_storage().nbytes()
                for t in torch.utils._pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen
            )
            return out

    torch.manual_seed(0)
    shapes = ((2048, 1536), (1536, 2048), (2048, 2560), (2560, 2048), (1024, 2560))  # 12-20 MB each in float32
    layers = [QuantizedLinear.from_linear(torch.nn.Linear(i, o, bias=False), "int8") for i, o in shapes]
    xs = [torch.randn(16, i, requires_grad=True) for i, _ in shapes]
    for layer, x in zip(layers, xs):  # the buffer grows to the largest weight here
        layer(x).sum().backward()
    with Allocations():
        for layer, x in zip(layers, xs):
            layer(x).sum().backward()
    smallest = min(i * o for i, o in shapes) * 4
    big = sum(size >= smallest for size in allocated)
    if how == "rows":  # a chunk's float32 temporaries: CHUNK_WEIGHTS weights, 4 bytes each
        assert max(allocated) <= workspace.CHUNK_WEIGHTS * 4 < smallest and big == 0, max(allocated)
    else:
        assert big >= 2 * len(shapes), big  # a weight-sized tensor at least for each forward and backward product


def test_int8_adapter_in_peft_on_fp32_and_merge_uses_original_weights(tiny_ckpt, tmp_path):
    from peft import PeftModel

    q = load_model(tiny_ckpt, quantize="int8")
    apply_lora(q, LoraSettings(r=4, alpha=8, targets=ALL))
    random_lora_b(q, 1)
    save_adapter(q, tmp_path / "a")
    x = ids(2)
    with torch.no_grad():
        native8 = q(x)
        peft32 = PeftModel.from_pretrained(hf_model(tiny_ckpt), tmp_path / "a")(x).logits
    assert rel(native8, peft32) < 0.05
    # merge_lora folds ΔW into the original fp32 W0, so the result equals the fp32 merge exactly
    fp = load_model(tiny_ckpt)
    load_adapter(fp, tmp_path / "a")
    merge_lora(fp)
    merge_lora(q)
    assert type(q.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        assert (q(x) - fp(x)).abs().max() < 1e-5
    from lora_llama import UserError

    with pytest.raises(UserError, match="quantised"):
        again = load_model(tiny_ckpt, quantize="int8")
        load_adapter(again, tmp_path / "a")
        next(iter(lora_modules(again).values())).merge()


def test_generate_with_the_kv_cache_on_nf4(tiny_ckpt):
    from lora_llama.model.generate import generate

    model = load_model(tiny_ckpt, quantize="nf4")
    prompt = ids()[0, :6].tolist()
    assert generate(model, prompt, 8) == generate(model, prompt, 8, use_cache=False)


def test_unknown_quantize_is_one_line(tiny_ckpt, capsys, tmp_path):
    from test_train import chat_file

    from lora_llama.cli import main

    code = main(
        [
            "train",
            str(ROOT / "recipes" / "smollm2-chat-cpu.yaml"),
            f"model.source={tiny_ckpt}",
            f"data.source={chat_file(tmp_path / 'd.jsonl')}",
            f"output.dir={tmp_path / 'run'}",
            "model.quantize=int4",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "model.quantize" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_loading_peak_memory_below_fp32_size(tmp_path, kind):
    base, shards = sharded_checkpoint(tmp_path / "big", 8)
    fp32_size = sum(f.stat().st_size for f in shards)
    # the setup builds the model once on the meta device: the ~800 modules its first construction imports are not
    # the load's memory
    setup = (
        "import torch, safetensors\nfrom lora_llama import load_model\n"
        "from lora_llama.loading.models import resolve_source\nfrom lora_llama.model.config import ModelArgs\n"
        "from lora_llama.files.json_files import read_config\nfrom lora_llama.model.llama import Llama"
        "\nwith torch.device('meta'):\n    Llama(ModelArgs.from_hf_config(read_config(resolve_source(sys.argv[1]))))"
    )
    grown = peak_growth(setup, f"model = load_model(sys.argv[1], quantize='{kind}')", base)
    print(f"{kind} load grew {grown / 1e6:.1f} MB, float32 checkpoint {fp32_size / 1e6:.1f} MB")
    assert grown < 0.75 * fp32_size, (grown, fp32_size)  # the quantized linears, the float embeddings, one shard


def test_nf4_double_quant_against_bitsandbytes():
    """The absmax values, less their mean, in bitsandbytes' 8-bit dynamic map over blocks of 256: the same offset and
    second-level absmax; each code the map's nearest value (bitsandbytes' CPU kernel picks a neighbour for ~0.2%)."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    from lora_llama.quant.formats import dynamic_map

    assert torch.equal(dynamic_map(), bnb.create_dynamic_map())
    w = torch.randn(300, 512, generator=torch.Generator().manual_seed(3)) * 0.05  # 2400 blocks: 9 of 256 and a rest
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    _, absmax = quantize_nf4(w)
    codes, absmax2, offset = quantize_absmax(absmax)
    assert torch.equal(absmax2, state.state2.absmax) and torch.equal(offset, state.offset)
    scaled = torch.cat([(absmax.reshape(-1) - offset)[i : i + 256] / absmax2[i // 256] for i in range(0, 2400, 256)])
    nearest = (scaled[:, None] - dynamic_map()).abs().min(dim=1).values
    assert torch.allclose((scaled - dynamic_map()[codes.reshape(-1).long()]).abs(), nearest, atol=1e-7)
    assert rel(NF4(double_quant=True).roundtrip(w), bnb.dequantize_4bit(packed, state)) < 1e-3
    lin = torch.nn.Linear(512, 300)
    q = QuantizedLinear.from_linear(lin, NF4(double_quant=True))
    assert q.scales.dtype == torch.uint8 and torch.equal(q.dequantize(), NF4(double_quant=True).roundtrip(lin.weight))


@pytest.mark.parametrize("row_major_transpose", [False, True])
def test_transient_weights_are_the_dequantized_weights_in_one_reused_buffer(monkeypatch, row_major_transpose):
    """A product's weight is written a few rows at a time into one buffer per thread and dtype: every format's
    weight and transpose equal dequantize()'s, bit for bit, and the next layer's weight reuses the same memory."""
    from helpers import quantized_layers
    from lora_llama.kernels import workspace
    from lora_llama.quant import linear as quant

    monkeypatch.setattr(workspace, "CHUNK_WEIGHTS", 3 * 512)  # 3 rows a chunk: 64 rows take 22 chunks, the last short
    monkeypatch.setattr(workspace, "WHOLE_WEIGHTS", 0)
    monkeypatch.setattr(quant, "copies_transposed", lambda dtype, device: row_major_transpose)
    pointers = set()
    for name, layer in quantized_layers(rows=64, in_features=512).items():
        for dtype in (torch.float32, torch.bfloat16):
            expected = layer.dequantize(dtype)
            assert torch.equal(layer.transient_weight(dtype), expected), (name, dtype)
            t = layer.transient_weight(dtype, transposed=True)
            assert torch.equal(t, expected.t()) and t.is_contiguous() == row_major_transpose, (name, dtype)
            pointers.add((dtype, t.data_ptr()))
    assert len(pointers) == 2  # one buffer per dtype, reused by every layer


@pytest.mark.slow
def test_compiled_dequantization_equals_the_eager_kernels():
    """What a GPU runs (the formulas through inductor, one graph per format and dtype) gives the eager kernels'
    weights bit for bit; compiled here for the CPU, as test_cuda compiles them for CUDA."""
    from torch._dynamo.utils import counters

    from helpers import quantized_layers
    from lora_llama.kernels import fused
    from lora_llama.quant import linear as quant

    counters.clear()
    layers = quantized_layers()
    for name, layer in layers.items():
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(quant._dequantize_compiled(*layer.dequantize_args(dtype)), layer.dequantize(dtype)), (
                name,
                dtype,
            )
    assert fused._broken is None and counters["stats"]["unique_graphs"] >= 2 * len(layers)  # none left eager


def test_double_quant_needs_nf4():
    from lora_llama import UserError
    from lora_llama.recipe.schema import load_recipe

    with pytest.raises(UserError, match="nf4_double_quant needs model.quantize nf4"):
        load_recipe(None, ["model.quantize=int8", "model.nf4_double_quant=true"])
    assert load_recipe(None, ["model.quantize=nf4", "model.nf4_double_quant=true"]).model.nf4_double_quant
