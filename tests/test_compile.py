"""train.compile: each decoder block one torch.compile graph (fullgraph=True: no graph break) that trains as the eager
hand-written kernels do, on plain and quantized bases; the quantized product stays one op that saves nothing
weight-sized; nf4 through bitsandbytes' own kernel; the loss's target positions taken on the host."""

import pytest
import torch
import torch.nn.functional as F

from helpers import ALL, random_lora_b, rel
from helpers import token_ids as ids
from lora_llama import LoraSettings, apply_lora, load_model
from lora_llama.kernels import fused
from lora_llama.labels import where_targets
from lora_llama.objectives.token_losses import target_loss


@pytest.fixture(autouse=True)
def compiling_works(monkeypatch):
    """Each test starts with compiling deemed to work (a failure falls back to eager for the whole process)."""
    monkeypatch.setattr(fused, "_broken", None)


def adapted(tiny_ckpt, quantize=None, dtype=torch.float32):
    model = load_model(tiny_ckpt, dtype=dtype, quantize=quantize)
    torch.manual_seed(0)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    random_lora_b(model)
    return model.train()


def loss_and_grads(model, labels=None):
    x = ids()
    labels = x.clone() if labels is None else labels
    loss, n = target_loss(model, x, labels)
    (loss / n).backward()
    return float(loss), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "quantize,dtype,backend",
    [
        (None, torch.float32, "inductor"),  # what runs on a GPU, with the CPU's inductor: Triton there, C++ here
        ("int8", torch.float32, "aot_eager"),  # the graph and its autograd without code generation (seconds)
        (None, torch.bfloat16, "aot_eager"),
        pytest.param("nf4", torch.float32, "inductor", marks=pytest.mark.slow),
        pytest.param("int8", torch.bfloat16, "inductor", marks=pytest.mark.slow),
    ],
)
def test_compiled_blocks_are_whole_graphs_that_train_as_the_eager_kernels(tiny_ckpt, quantize, dtype, backend):
    torch._dynamo.reset()
    labels = ids()
    labels[:, :9] = -100  # a prompt: the last block runs at the target positions only
    eager_loss, eager = loss_and_grads(adapted(tiny_ckpt, quantize, dtype), labels)
    model = adapted(tiny_ckpt, quantize, dtype)
    model.compile_blocks(fullgraph=True, backend=backend)  # a graph break raises: the blocks would fall back to eager
    loss, grads = loss_and_grads(model, labels)
    assert fused._broken is None
    assert grads.keys() == eager.keys() and len(grads) == 2 * 7 * 2
    tol = 1e-5 if dtype == torch.float32 else 5e-2  # bf16: products rounded to 8 bits, in another order
    assert abs(loss - eager_loss) <= tol * abs(eager_loss)
    assert all(rel(grads[k], eager[k]) < tol for k in grads), max((rel(grads[k], eager[k]), k) for k in grads)


def test_a_backward_that_fails_to_compile_falls_back_in_the_forward(tiny_ckpt):
    """Inductor compiles a backward lazily, inside backward(), where nothing could fall back: the blocks compile it
    with the forward, so its failure is one warning in the forward and the step trains as the eager blocks do."""
    from torch._dynamo.backends.common import aot_autograd

    def broken_backward(gm, example_inputs):
        raise RuntimeError("backward lowering failed (injected)")

    torch._dynamo.reset()
    eager_loss, eager = loss_and_grads(adapted(tiny_ckpt))
    model = adapted(tiny_ckpt)
    model.compile_blocks(backend=aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=broken_backward))
    with pytest.warns(UserWarning, match="torch.compile unavailable .*injected.*decoder blocks run eager") as said:
        loss, grads = loss_and_grads(model)
    assert len([w for w in said if "torch.compile" in str(w.message)]) == 1
    assert fused._broken and loss == eager_loss and all(torch.equal(grads[k], eager[k]) for k in eager)


def test_a_recompile_past_the_limit_says_so_once_and_runs_eager(monkeypatch):
    """Past dynamo's recompile limit a new shape runs the eager formula, with one warning for the process; the
    shapes compiled before keep their graphs."""
    monkeypatch.setattr(fused, "_past_limit_said", False)
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.append(tuple(example_inputs[0].shape))
        return gm.forward

    formula = fused.compiled(lambda t: t * 2 + 1, "slower", graphs=2, dynamic=False, backend=backend)
    with pytest.warns(UserWarning, match="recompile limit") as said:
        for n in (3, 4, 5, 3, 6):
            assert torch.equal(formula(torch.ones(n)), torch.full((n,), 3.0))
    assert len([w for w in said if "recompile limit" in str(w.message)]) == 1
    assert seen == [(3,), (4,)] and fused._broken is None  # 5 and 6 ran eager; 3 replayed its graph


def test_decoding_and_eval_keep_the_eager_blocks(tiny_ckpt):
    """A KV cache's growing length would make each token a new graph, and no-grad graphs would compile again beside
    the training ones: generation and passes without gradients run the eager blocks."""
    from lora_llama.model.generate import generate

    torch._dynamo.reset()
    model = adapted(tiny_ckpt).eval()
    want = generate(model, ids(1, 5)[0].tolist(), max_new_tokens=6)
    calls = []
    model.compile_blocks(backend=lambda gm, inputs: calls.append(gm) or gm.forward)
    assert generate(model, ids(1, 5)[0].tolist(), max_new_tokens=6) == want and not calls
    with torch.no_grad():
        model(ids())
    assert not calls
    model(ids())
    assert calls  # the same model's training passes do run compiled


@pytest.mark.parametrize(
    "kind,traced", [("nf4", False), ("int8", False), ("int8", True)], ids=["nf4-op", "int8-op", "int8-traced-formula"]
)
def test_a_compiled_quantized_product_saves_no_weight_for_backward(tiny_ckpt, monkeypatch, kind, traced):
    """The dequantized weight is made again in backward, never kept: only the plain formula traced into the graph
    (the variant, so this check can fail) saves (out, in) float weights."""
    from lora_llama.quant.linear import QuantizedLinear

    if traced:
        monkeypatch.setattr(
            QuantizedLinear, "forward", lambda self, x: F.linear(x, self.dequantize(x.dtype), self.bias)
        )
    torch._dynamo.reset()
    model = adapted(tiny_ckpt, kind)
    model.compile_blocks(fullgraph=True, backend="aot_eager")
    weights = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, QuantizedLinear)}
    saved = []

    def pack(t):
        if t.is_floating_point():  # the codes and scales are inputs: saving them costs nothing
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, n = target_loss(model, ids(), ids())
    assert fused._broken is None  # the compiled graph ran, not the eager fallback
    kept_weights = [s for s in saved if s in weights or s[::-1] in weights]
    assert saved and (kept_weights if traced else not kept_weights), kept_weights


def test_every_quantized_layer_kind_compiles_whole_with_the_eager_product():
    """int8, nf4 (with double quantization) and every GGUF block format: one op in a full graph, the same output and
    input gradient as the eager layer."""
    from helpers import quantized_layers

    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3))
    for kind, layer in quantized_layers().items():
        torch._dynamo.reset()  # a graph per kind, more than dynamo's recompile limit for one function
        compiled = torch.compile(lambda t, layer=layer: layer(t).square().sum(), fullgraph=True, backend="aot_eager")
        results = []
        for fn in (lambda t: layer(t).square().sum(), compiled):
            t = x.clone().requires_grad_()
            loss = fn(t)
            loss.backward()
            results.append((loss.detach(), t.grad))
        (want, want_grad), (got, got_grad) = results
        assert torch.allclose(got, want, rtol=1e-6) and torch.allclose(got_grad, want_grad, rtol=1e-5, atol=1e-7), kind


def test_nf4_through_bitsandbytes_kernel_equals_ours():
    """On CUDA nf4 weights dequantize in bitsandbytes' own op (here its CPU implementation of the same op)."""
    pytest.importorskip("bitsandbytes")
    from lora_llama.quant.formats import (
        dequantize_absmax,
        dequantize_nf4,
        nf4_by_bitsandbytes,
        quantize_absmax,
        quantize_nf4,
    )

    for shape in [(96, 128), (5, 50)]:  # rows of blocks, and a flat layout with a last partial block
        w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        codes, absmax = quantize_nf4(w)
        for absmax_used in (absmax, dequantize_absmax(*quantize_absmax(absmax))):  # plain, double quantization
            for dtype in (torch.float32, torch.bfloat16):
                got = nf4_by_bitsandbytes(codes, absmax_used, shape, dtype)
                assert got.dtype == dtype and torch.equal(got, dequantize_nf4(codes, absmax_used, shape, dtype))


def test_target_positions_taken_on_the_host_give_the_same_loss(tiny_ckpt):
    """SFT batches carry where_targets' ids and flat positions (no GPU wait to learn their number); the loss and
    its gradients equal those from the labels alone, also for packed rows."""
    model = adapted(tiny_ckpt)
    x, labels = ids(), ids()
    labels[0, :7], labels[1, 20:] = -100, -100
    segments = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    positions = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.arange(24)])
    for extra in ({}, {"segment_ids": segments, "position_ids": positions}):
        want, n = target_loss(model, x, labels, **extra)
        where = where_targets(labels, extra.get("segment_ids"))
        assert where["targets"].numel() == n and where["predicting"].dtype == torch.long
        got, m = target_loss(model, x, labels, **extra, **where)
        assert m == n and torch.equal(got, want)


def test_compile_auto_is_on_for_gpus_unless_fsdp_shards():
    from lora_llama.runtime.auto import resolve_compile

    assert resolve_compile("auto", "cuda", sharded=False)[0] is True
    assert resolve_compile("auto", "cuda:1", sharded=False)[0] is True
    assert resolve_compile("auto", "cuda", sharded=True)[0] is False
    assert resolve_compile("auto", "cpu", sharded=False)[0] is False
    assert resolve_compile(True, "cpu", sharded=False) == (True, "set in the recipe")
    assert resolve_compile(False, "cuda", sharded=False) == (False, "set in the recipe")


def test_compiled_rows_are_padded_to_a_few_lengths_and_lose_nothing(tiny_ckpt, tmp_path):
    """Under train.compile a micro-batch's rows are padded to the next power of two from 64 (at most
    data.max_seq_len): the loss and its gradients are those of the unpadded rows (padding is never a target), and
    the run's log names the lengths it compiles for."""
    from test_train import chat_file

    from lora_llama.objectives.base import bucket_lengths, bucketed_length
    from lora_llama.objectives.sft import SFT
    from lora_llama.recipe.schema import load_recipe
    from lora_llama.training.from_recipe import train_from_recipe

    assert [bucketed_length(n, 256) for n in (1, 64, 65, 129, 256, 300)] == [64, 64, 128, 256, 256, 300]
    assert (
        bucketed_length(50, 96) == 64 and bucketed_length(80, 96) == 96 and bucket_lengths(300) == [64, 128, 256, 300]
    )
    model = adapted(tiny_ckpt)
    examples = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (9, 23)]
    bucketed = SFT()
    bucketed.row_length = lambda n: bucketed_length(n, 256)
    results = []
    for objective in (SFT(), bucketed):
        batch = objective.collate(examples, 0)
        model.zero_grad()
        (loss,), _ = objective.terms(model, batch)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((batch["input_ids"].shape[1], float(loss), grads))
    (t_plain, loss_plain, grads_plain), (t_bucketed, loss_bucketed, grads_bucketed) = results
    assert (t_plain, t_bucketed) == (23, 64)
    assert abs(loss_bucketed - loss_plain) < 1e-5 * abs(loss_plain)
    assert all(rel(a, b) < 1e-5 for a, b in zip(grads_bucketed, grads_plain))
    overrides = [f"model.source={tiny_ckpt}", f"data.source={chat_file(tmp_path / 'd.jsonl')}", "data.max_seq_len=128"]
    overrides += ["train.compile=true", "train.max_steps=2", "train.eval_every=100", f"output.dir={tmp_path / 'run'}"]
    lines = []
    train_from_recipe(load_recipe(None, overrides), log=lines.append)
    assert any("rows padded to 64, 128 tokens" in line for line in lines), lines


def test_a_small_models_compiled_blocks_replay_as_cuda_graphs_on_a_gpu_only():
    from lora_llama.runtime.auto import SMALL_MODEL, compile_options

    assert compile_options(135_000_000, "cuda", False) == {"mode": "reduce-overhead"}
    assert compile_options(135_000_000, "cuda:1", False) == {"mode": "reduce-overhead"}
    assert compile_options(135_000_000, "cuda", True) == {}  # checkpointing recomputes outside the graphs
    assert compile_options(SMALL_MODEL, "cuda", False) == {} and compile_options(135_000_000, "cpu", False) == {}
