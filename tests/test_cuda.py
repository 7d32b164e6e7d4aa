"""The CUDA paths (skipped without a GPU): logits and LoRA gradients against transformers + peft on the GPU,
bf16-mixed training there (what `auto` picks), int8 and nf4 bases (weight-only, dequantized on the GPU), generate."""

import pytest
import torch

import helpers
from helpers import ALL, hf_model, random_lora_b, rel, token_ids
from lora_llama import LoraSettings, apply_lora, load_model, save_adapter
from lora_llama.objectives.token_losses import target_loss

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
QA = [
    ("hi", "hello"),
    ("what is the capital", "paris"),
    ("to be", "or not"),
    ("the quick", "brown fox"),
    ("how are you", "i am fine"),
    ("the lazy", "dog"),
    ("hello", "world"),
    ("that is", "the question"),
]


def ids(batch=2, seq=40, seed=1):
    return token_ids(batch, seq, seed).cuda()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_logits_match_transformers_on_cuda(tiny_ckpt, dtype, tol):
    ours = load_model(tiny_ckpt, dtype=dtype, device="cuda")
    ref = hf_model(tiny_ckpt).to("cuda", dtype)
    x = ids()
    with torch.no_grad():
        assert rel(ours(x), ref(x).logits) < tol


def test_lora_gradients_match_peft_on_cuda(tiny_ckpt, tmp_path):
    from peft import PeftModel

    model = load_model(tiny_ckpt, device="cuda")
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    random_lora_b(model, seed=0)
    save_adapter(model, tmp_path / "a")
    x = ids()
    model.train()
    loss, n = target_loss(model, x, x)
    (loss / n).backward()
    ref = PeftModel.from_pretrained(hf_model(tiny_ckpt), tmp_path / "a").cuda().train()
    for name, p in ref.named_parameters():
        p.requires_grad_("lora_" in name)
    ref(x, labels=x).loss.backward()
    ref_grads = {
        n.replace("base_model.model.", "").replace(".default", ""): p.grad
        for n, p in ref.named_parameters()
        if p.grad is not None
    }
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads) and len(grads) == 28
    for k in grads:
        assert torch.allclose(grads[k], ref_grads[k], atol=1e-5, rtol=1e-4), k


def cuda_recipe(tiny_ckpt, data, out, *extra):
    """test_precision's recipe (the overfit model, data and adapter) on the GPU; later overrides win."""
    from test_precision import recipe

    return recipe(tiny_ckpt, data, out, "auto", "model.device=cuda", *extra)


def test_auto_is_bf16_mixed_on_cuda_and_trains_to_the_float32_loss(tiny_ckpt, tmp_path):
    from lora_llama.training.from_recipe import train_from_recipe

    data = helpers.chat_file(tmp_path / "d.jsonl", QA)
    lines = {}
    # 30 steps, as test_precision's CPU run: past ~35 the overfit runs of these 8 examples turn chaotic
    steps = ("train.max_steps=30", "train.eval_every=30")
    results = {
        p: train_from_recipe(
            cuda_recipe(tiny_ckpt, data, tmp_path / p, f"train.precision={p}", *steps),
            log=lambda s, p=p: lines.setdefault(p, []).append(s),
        )
        for p in ("fp32", "auto")
    }
    start, fp32, bf16 = results["fp32"]["eval_loss_start"], results["fp32"]["eval_loss"], results["auto"]["eval_loss"]
    print(f"cuda eval loss: start {start:.4f}, fp32 {fp32:.4f}, bf16-mixed {bf16:.4f}")
    assert any("precision bf16-mixed (auto: this GPU supports bfloat16)" in s for s in lines["auto"]), lines["auto"]
    assert any("on cuda" in s for s in lines["auto"])
    assert any(s.startswith("train.compile true (auto: ") for s in lines["auto"]), lines["auto"]
    assert fp32 < 0.4 * start and bf16 < 1.01 * fp32, (start, fp32, bf16)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_bases_train_on_cuda(tiny_ckpt, tmp_path, kind):
    from lora_llama.training.from_recipe import train_from_recipe

    data = helpers.chat_file(tmp_path / "d.jsonl", QA)
    r = cuda_recipe(
        tiny_ckpt,
        data,
        tmp_path / kind,
        f"model.quantize={kind}",
        "train.max_steps=30",
        "train.eval_every=30",
        "lora.targets=[q,k,v,o,gate,up,down]",
    )
    result = train_from_recipe(r, log=lambda *_: None)
    plain = train_from_recipe(
        cuda_recipe(
            tiny_ckpt,
            data,
            tmp_path / "plain",
            "train.max_steps=30",
            "train.eval_every=30",
            "lora.targets=[q,k,v,o,gate,up,down]",
        ),
        log=lambda *_: None,
    )
    print(
        f"{kind} on cuda: eval loss {result['eval_loss_start']:.4f} -> {result['eval_loss']:.4f} "
        f"(unquantised base: {plain['eval_loss']:.4f})"
    )
    # the quantized runs train to within 5% of the unquantized one
    assert result["eval_loss"] < 0.85 * result["eval_loss_start"] and result["eval_loss"] < 1.05 * plain["eval_loss"]
    from safetensors.torch import load_file

    saved = load_file(tmp_path / kind / "adapter" / "adapter_model.safetensors")
    assert len(saved) == 2 * 7 * 2 and all(t.abs().sum() > 0 for t in saved.values())  # every A and B trained


def test_generate_on_cuda_matches_transformers_greedy(tiny_ckpt):
    from lora_llama.model.generate import generate

    model = load_model(tiny_ckpt, device="cuda")
    ref = hf_model(tiny_ckpt).cuda()
    prompt = ids(1, 7)
    out = generate(model, prompt[0].tolist(), max_new_tokens=12)  # greedy, KV cache on the GPU
    want = ref.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 7:]
    assert out == want.tolist()


def test_generate_on_cuda_replays_a_graph_and_samples_as_the_growing_cache(tiny_ckpt):
    """`lora-llama generate` on a GPU: a captured decoding step, tokens read every few steps; greedy and seeded
    (top-k, top-p, the device's generator) the tokens of the eager growing cache."""
    from lora_llama.model.decoding import decoder_for
    from lora_llama.model.generate import generate

    model = load_model(tiny_ckpt, device="cuda")
    torch.manual_seed(0)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    random_lora_b(model, seed=0)
    prompt = ids(1, 7)[0].tolist()
    for settings in ({}, dict(temperature=1.0, top_k=50, top_p=0.9, seed=5)):
        assert generate(model, prompt, 21, **settings) == generate(model, prompt, 21, static=False, **settings)
    assert decoder_for(model, 1, 7 + 21).graph is not None


def test_offloaded_activations_leave_the_gpu_and_give_the_same_gradients(tiny_ckpt):
    held, grads = {}, {}
    x = torch.randint(3, 300, (4, 256), generator=torch.Generator().manual_seed(1)).cuda()
    for offload in (False, True):
        model = load_model(tiny_ckpt, device="cuda")
        torch.manual_seed(0)
        apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
        model.gradient_checkpointing, model.offload_activations = True, offload
        model.train()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        h = model(x, hidden_only=True)  # what backward will need stays allocated from here
        held[offload] = torch.cuda.memory_allocated() - before - h.numel() * h.element_size()
        h.square().mean().backward()
        grads[offload] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    print(f"saved for backward on the GPU: {held[False] / 2**20:.2f} MB, offloaded {held[True] / 2**20:.2f} MB")
    assert held[True] < 0.2 * held[False]
    assert all(torch.allclose(grads[True][k], grads[False][k], atol=1e-6) for k in grads[False])


def test_packed_rows_on_cuda_equal_separate_examples(tiny_ckpt):
    model = load_model(tiny_ckpt, device="cuda")
    a, b = ids(1, 9, seed=2), ids(1, 14, seed=3)
    pos = torch.cat([torch.arange(9), torch.arange(14)]).cuda()[None]
    seg = torch.cat([torch.zeros(9), torch.ones(14)]).long().cuda()[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), position_ids=pos, segment_ids=seg)
        alone = torch.cat([model(a), model(b)], 1)
    assert (packed - alone).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_checkpointing_on_cuda_keeps_attention(tiny_ckpt, dtype):
    """The CUDA attention kernels (flash in bf16, memory-efficient in float32) are kept, not rerun in backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lora_llama.model.llama import _ATTENTION_KERNELS

    calls = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func in _ATTENTION_KERNELS)
            return func(*args, **(kwargs or {}))

    grads, reruns = [], []
    x = ids(2, 64)
    for mode in (False, True, "selective"):
        model = load_model(tiny_ckpt, dtype=dtype, device="cuda")
        torch.manual_seed(0)
        apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
        model.gradient_checkpointing = mode
        model.train()
        loss, n = target_loss(model, x, x)
        calls.clear()
        with Count():
            (loss / n).backward()
        reruns.append(sum(calls))
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    assert reruns == [0, 2, 0], reruns  # block checkpointing reruns each layer's attention once
    for g in grads[1:]:
        assert all(torch.allclose(g[k], grads[0][k], atol=1e-6, rtol=1e-3) for k in g)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_dequantize_on_the_gpu_as_on_the_cpu(kind):
    """quantize: source dequantizes a GGUF file's blocks where they live: the same weights on either device."""
    from helpers import random_blocks
    from lora_llama.quant.gguf_blocks import dequantize_gguf

    rows = torch.from_numpy(random_blocks(kind, rows=64, in_features=512, seed=2))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(
            dequantize_gguf(kind.lower(), rows.cuda(), dtype).cpu(), dequantize_gguf(kind.lower(), rows, dtype)
        )


def test_every_quantized_layer_dequantizes_on_the_gpu_as_on_the_cpu():
    """On CUDA a layer's weight comes from the compiled formulas (one Triton kernel per format): the CPU's eager
    weights, up to Triton contracting d·q + m into one rounding (1 float32 ulp)."""
    from helpers import quantized_layers
    from lora_llama.kernels import fused

    for name, layer in quantized_layers().items():
        cpu = layer.dequantize(torch.float32)
        gpu = layer.cuda().dequantize(torch.float32).cpu()
        torch.testing.assert_close(gpu, cpu, rtol=2**-23, atol=2**-23 * float(cpu.abs().max()), msg=name)
        bf16 = layer.dequantize(torch.bfloat16).float().cpu()
        torch.testing.assert_close(bf16, cpu.bfloat16().float(), rtol=2**-7, atol=0, msg=name)
    assert fused._broken is None


@pytest.mark.parametrize("quantize", [None, "int8", "nf4"])
def test_compiled_blocks_on_cuda_are_whole_graphs_that_train_as_eager(tiny_ckpt, quantize):
    """train.compile on a GPU: each block one Triton-compiled graph (fullgraph), bf16 base, float32 adapters; nf4
    products in bitsandbytes' kernel inside the graph's one opaque op."""
    results = []
    x = ids(2, 64)
    for compiled in (False, True):
        torch._dynamo.reset()
        model = load_model(tiny_ckpt, dtype=torch.bfloat16, device="cuda", quantize=quantize)
        torch.manual_seed(0)
        apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
        random_lora_b(model, seed=0)
        if compiled:
            model.compile_blocks(fullgraph=True)
        model.train()
        loss, n = target_loss(model, x, x)
        (loss / n).backward()
        results.append((float(loss), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    from lora_llama.kernels import fused

    assert fused._broken is None  # compiled, not the eager fallback
    (eager_loss, eager), (loss, grads) = results
    assert abs(loss - eager_loss) < 1e-2 * abs(eager_loss) and grads.keys() == eager.keys()
    assert all(rel(grads[k], eager[k]) < 5e-2 for k in grads), max((rel(grads[k], eager[k]), k) for k in grads)


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_graphed_decoding_on_cuda_gives_the_growing_cache_completions(tiny_ckpt, quantize):
    """GRPO's sampling on a GPU: a static cache, each step after the first a replayed CUDA graph; the same tokens as
    the growing cache, greedy and seeded, in groups, with padding; the graph captured once serves later calls and
    reads the adapter as training leaves it (changed in place)."""
    from lora_llama.model.decoding import decoder_for
    from lora_llama.model.generate import sample_completions

    model = load_model(tiny_ckpt, device="cuda", quantize=quantize)
    torch.manual_seed(0)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    random_lora_b(model, seed=0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 7, 5) for _ in range(2)]

    def run(static, t):
        return sample_completions(
            model, prompts, 24, eos_ids=[], pad_id=0, temperature=t, seeds=list(range(6)), group=2, static=static
        )

    for temperature in (0.0, 1.0):
        assert run(True, temperature) == run(False, temperature) == run(True, temperature)
    decoder = decoder_for(model, 6, 7 + 24)
    assert decoder.graph is not None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-2.0)
    assert run(True, 1.0) == run(False, 1.0) and decoder_for(model, 6, 7 + 24).graph is decoder.graph


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_on_cuda_runs_through_liger_and_equals_ours(dtype):
    """With liger-kernel installed, linear_cross_entropy on CUDA is liger's fused kernel: its sum and gradients
    equal ours (float32 to 1e-5; bf16 products to their rounding)."""
    from lora_llama.kernels import cross_entropy as loss

    pytest.importorskip("liger_kernel")
    torch.manual_seed(0)
    h = torch.randn(300, 64, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(1000, 64, device="cuda") * 0.2).to(dtype)
    targets = torch.randint(0, 1000, (300,), device="cuda")
    got = loss.linear_cross_entropy(h, weight, targets)
    assert not loss._liger_failed
    (g_got,) = torch.autograd.grad(got, h)
    want = loss._LinearCrossEntropy.apply(h, weight, targets, 64)
    (g_want,) = torch.autograd.grad(want, h)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(float(got) / float(want) - 1) < tol and rel(g_got.float(), g_want.float()) < tol
