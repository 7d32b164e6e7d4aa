"""LoRA on the native model against peft on transformers' LlamaForCausalLM."""

import json

import pytest
import torch

from helpers import ALL, hf_model, random_lora_b
from helpers import token_ids as ids
from lora_llama import LoraSettings, UserError, apply_lora, load_adapter, load_model, merge_lora, save_adapter
from lora_llama.lora.adapted import lora_modules
from lora_llama.objectives.token_losses import target_loss


def adapted_model(folder):
    """The tiny model with LoRA on all seven linears, A seeded and B random (so every path carries gradient)."""
    model = load_model(folder)
    torch.manual_seed(0)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    random_lora_b(model)
    return model


def peft_model(folder, adapter):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(folder), adapter).eval()


def test_zero_b_is_exactly_the_base_model(tiny_ckpt):
    x = ids()
    base = load_model(tiny_ckpt)
    with torch.no_grad():
        ref = base(x)
        summary = apply_lora(base, LoraSettings(r=4, alpha=8, targets=ALL + ["lm_head"]))
        assert torch.equal(base(x), ref)
    assert 0 < summary["trainable"] < summary["total"]
    assert all(("lora_" in n) == p.requires_grad for n, p in base.named_parameters())


@pytest.mark.parametrize("extra", [{}, {"rslora": True}, {"layers": [1]}])
def test_saved_adapter_loads_in_peft_with_same_logits(tiny_ckpt, tmp_path, extra):
    model = load_model(tiny_ckpt)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL, **extra))
    random_lora_b(model)
    save_adapter(model, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["target_modules"] == sorted(f"{t}_proj" for t in ALL)
    x = ids()
    with torch.no_grad():
        diff = (model(x) - peft_model(tiny_ckpt, tmp_path / "adapter")(x).logits).abs().max()
    assert diff < 1e-4
    # and it round-trips into a fresh native model
    again = load_model(tiny_ckpt)
    load_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def test_peft_adapter_loads_natively(tiny_ckpt, tmp_path):
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(
        hf_model(tiny_ckpt), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    peft.save_pretrained(tmp_path / "peft")
    model = load_model(tiny_ckpt)
    load_adapter(model, tmp_path / "peft")
    x = ids()
    with torch.no_grad():
        assert (model(x) - peft(x).logits).abs().max() < 1e-4


def test_merge_and_unmerge(tiny_ckpt):
    model = load_model(tiny_ckpt)
    base_w = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL + ["lm_head"]))
    random_lora_b(model)
    x = ids()
    with torch.no_grad():
        unmerged = model(x)
        for m in lora_modules(model).values():
            m.merge()
        assert (model(x) - unmerged).abs().max() < 1e-5
        for m in lora_modules(model).values():
            m.unmerge()
    for path, m in lora_modules(model).items():
        assert (m.base_layer.weight - base_w[f"{path}.weight"]).abs().max() < 1e-6
    with torch.no_grad():
        merge_lora(model)
        assert not lora_modules(model)
        assert (model(x) - unmerged).abs().max() < 1e-5
        # the tied embedding is untouched by the lm_head adapter
        assert torch.equal(model.model.embed_tokens.weight, base_w["model.embed_tokens.weight"])


@pytest.mark.parametrize("batch, seq", [(2, 24), (1, 4096)])
def test_only_lora_gets_gradients_equal_to_peft(tiny_ckpt, tmp_path, batch, seq):
    model = load_model(tiny_ckpt)
    apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
    random_lora_b(model)
    save_adapter(model, tmp_path / "a")
    x = ids(batch, seq)
    model.train()  # the training path: norms' outputs and the SwiGLU product are recomputed in backward
    loss, n = target_loss(model, x, x)
    (loss / n).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    ref = peft_model(tiny_ckpt, tmp_path / "a")
    ref.train()
    for n, p in ref.named_parameters():
        p.requires_grad_("lora_" in n)
    ref(x, labels=x).loss.backward()
    ref_grads = {
        n.replace("base_model.model.", "").replace(".default", ""): p.grad
        for n, p in ref.named_parameters()
        if p.grad is not None
    }
    assert set(ref_grads) == set(grads)
    for k in grads:
        assert (grads[k] - ref_grads[k]).abs().max() <= 1e-5 * max(1.0, float(ref_grads[k].abs().max())), k


def test_shape_mismatch_names_key_and_shapes(tiny_ckpt, make_ckpt, tmp_path):
    other = make_ckpt("wide", hidden_size=96, num_attention_heads=4, num_key_value_heads=2)
    model = load_model(other)
    apply_lora(model, LoraSettings(r=4, alpha=8))
    save_adapter(model, tmp_path / "wide_adapter")
    with pytest.raises(UserError, match=r"model\.layers\.0\.self_attn\.\w_proj\.lora_\w\.weight.*\(4, 96\).*\(4, 64\)"):
        load_adapter(load_model(tiny_ckpt), tmp_path / "wide_adapter")


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"use_dora": True}, "lacks 8 tensors, first"),  # a DoRA config without its magnitudes
        ({"target_modules": ["q_proj", "conv1"]}, "unknown target module 'conv1'"),
        ({"r": 0}, "adapter_config.json: LoRA setting 'r': Input should be greater than 0"),
    ],
)
def test_bad_adapter_config(tiny_ckpt, tmp_path, capsys, patch, message):
    from lora_llama.cli import main

    model = load_model(tiny_ckpt)
    apply_lora(model, LoraSettings(r=4, alpha=8))
    folder = save_adapter(model, tmp_path / "a")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **patch}))
    with pytest.raises(UserError, match=message):
        load_adapter(load_model(tiny_ckpt), folder)
    code = main(["generate", "--model", str(tiny_ckpt), "--adapter", str(folder), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_lora_settings_validation():
    from lora_llama.lora.settings import lora_settings

    for bad in ({"r": 0}, {"targets": ["q", "xyz"]}, {"dropout": 1.5}):
        with pytest.raises(UserError):
            lora_settings(**bad)


def test_save_refuses_to_overwrite(tiny_ckpt, tmp_path):
    model = load_model(tiny_ckpt)
    apply_lora(model, LoraSettings())
    save_adapter(model, tmp_path / "a")
    with pytest.raises(UserError, match="already exists"):
        save_adapter(model, tmp_path / "a")
    save_adapter(model, tmp_path / "a", force=True)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["checkpointing", "compile", "offload"])
def test_checkpointed_or_compiled_blocks_give_the_same_gradients(tiny_ckpt, variant, monkeypatch):
    """train.gradient_checkpointing, train.compile and train.offload_activations against the plain eager step."""
    import lora_llama.model.llama

    moved = []
    if variant == "offload":  # on the CPU offloading is a no-op: run CUDA's hooks (host copies, unpinned) here

        class HostCopies(torch.autograd.graph.save_on_cpu):
            def __init__(self, pin_memory):
                super().__init__(pin_memory=False)
                pack = self.pack_hook
                self.pack_hook = lambda t: moved.append(t.shape) or pack(t)

        monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", HostCopies)
        monkeypatch.setattr(
            lora_llama.model.llama,
            "offloaded",
            lambda active, device: HostCopies(True) if active else __import__("contextlib").nullcontext(),
        )
    grads = []
    for on in (False, True):
        model = adapted_model(tiny_ckpt)
        model.gradient_checkpointing = on and variant in ("checkpointing", "offload")
        model.offload_activations = on and variant == "offload"
        if on and variant == "compile":
            model.compile_blocks()
        model.train()
        loss, n = target_loss(model, ids(), ids())
        (loss / n).backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert all((grads[0][k] - grads[1][k]).abs().max() < 1e-6 for k in grads[0])
    if variant == "offload":  # what checkpointing keeps, each block's input and the RoPE tables, went through the host
        assert [tuple(m) for m in moved] == [(2, 24, 64), (2, 1, 24, 16), (2, 1, 24, 16)] * 2, moved


def test_offloading_is_for_cuda_training_only():
    from lora_llama.model.llama import offloaded

    assert isinstance(offloaded(True, torch.device("cuda", 0)), torch.autograd.graph.save_on_cpu)
    for active, device in [(True, "cpu"), (False, "cuda")]:
        assert not isinstance(offloaded(active, torch.device(device)), torch.autograd.graph.save_on_cpu)


def test_adapters_disabled_gives_exactly_the_base_logits(tiny_ckpt):
    from lora_llama.lora.adapted import adapters_disabled

    x = ids()
    model = load_model(tiny_ckpt)
    with torch.no_grad():
        base = model(x)
        apply_lora(model, LoraSettings(r=4, alpha=8, targets=ALL))
        random_lora_b(model)
        adapted = model(x)
        with adapters_disabled(model):
            assert torch.equal(model(x), base)
        assert torch.equal(model(x), adapted) and (adapted - base).abs().max() > 1e-3
    model.train()  # the fused training path honours it too: the base loss, and no graph (nothing trainable took part)
    with adapters_disabled(model):
        loss, n = target_loss(model, x, x)
    base_model = load_model(tiny_ckpt).train()
    for p in base_model.parameters():
        p.requires_grad_(False)
    assert not loss.requires_grad and torch.allclose(loss, target_loss(base_model, x, x)[0], rtol=1e-6)
    for m in lora_modules(model).values():
        m.merge()
    with pytest.raises(UserError, match="merged"):
        with adapters_disabled(model):
            pass


@pytest.mark.parametrize(
    "settings",
    [
        dict(r=4, alpha=8, targets=["v", "q", "lm_head"], layers=[1]),
        dict(r=2, alpha=3, dropout=0.1, rslora=True, targets=["down"]),
    ],
)
def test_saved_settings_are_read_off_the_layers(tiny_ckpt, tmp_path, settings):
    from lora_llama.loading.adapters import read_adapter_config

    model = load_model(tiny_ckpt)
    apply_lora(model, LoraSettings(**settings))
    save_adapter(model, tmp_path / "a")
    back, cfg = read_adapter_config(tmp_path / "a")
    want = LoraSettings(**settings)
    assert (back.r, back.alpha, back.dropout, back.rslora, back.layers) == (
        want.r,
        want.alpha,
        want.dropout,
        want.rslora,
        want.layers,
    )
    assert sorted(back.targets) == sorted(want.targets)
    assert cfg["base_model_name_or_path"] == str(tiny_ckpt)


@pytest.mark.parametrize("mode, reruns", [(True, 2), ("block", 2), ("selective", 0)])
def test_selective_checkpointing_keeps_attention_and_recomputes_the_rest(tiny_ckpt, mode, reruns):
    """train.gradient_checkpointing: selective keeps the attention kernel's output (its forward is not rerun in
    backward, where per-block checkpointing reruns it once per layer); the gradients are the plain step's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    kernel = torch.ops.lora_llama.causal_attention.default  # the CPU training attention's forward
    calls = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func == kernel)
            return func(*args, **(kwargs or {}))

    grads = []
    for checkpointing in (False, mode):
        model = adapted_model(tiny_ckpt)
        model.gradient_checkpointing = checkpointing
        model.train()
        loss, n = target_loss(model, ids(), ids())
        calls.clear()
        with Count():
            (loss / n).backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    assert sum(calls) == reruns and len(calls) > 100  # the rest of each block was recomputed (and counted)
    assert all((grads[0][k] - grads[1][k]).abs().max() < 1e-6 for k in grads[0])


@pytest.mark.parametrize("base", ["float32", "bfloat16", "int8", "nf4", "float32 with dropout, eval mode"])
def test_a_layer_without_gradients_gives_the_autograd_nodes_output(base):
    """Decoding and evals run no autograd: each LoRA layer's plain products (LoRALinear._plain) give what the
    fused node gives with gradients on, and W0·x + scale·B·A·x by hand (the dequantized weight for a quantized
    base; bf16 input with float32 A and B as bf16-mixed has them; dropout switched off by eval mode, while in
    training mode it still drops under no_grad)."""
    from helpers import quantized_layers
    from lora_llama.lora.layer import LoRALinear, dense_weight

    dtype = torch.bfloat16 if base == "bfloat16" else torch.float32
    if base in ("int8", "nf4"):
        frozen = quantized_layers(rows=48, in_features=64)[base]
    else:
        frozen = torch.nn.Linear(64, 48, bias=True, dtype=dtype).requires_grad_(False)
    torch.manual_seed(0)
    layer = LoRALinear(frozen, r=4, alpha=8, dropout=0.5 if "dropout" in base else 0.0).eval()
    torch.nn.init.normal_(layer.lora_B.weight, std=0.1)
    x = torch.randn(5, 64, dtype=dtype)
    with torch.inference_mode():
        plain = layer(x)
    with torch.enable_grad():
        node = layer(x.requires_grad_())
    w0 = dense_weight(frozen, torch.float32).float()
    bias = 0 if frozen.bias is None else frozen.bias.float()
    a, b = layer.lora_A.weight.to(dtype).float(), layer.lora_B.weight.to(dtype).float()
    by_hand = x.detach().float() @ w0.t() + bias + 2.0 * (x.detach().float() @ a.t()) @ b.t()
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert plain.dtype == node.dtype == dtype
    assert (plain.float() - node.detach().float()).abs().max() <= tol * by_hand.abs().max()
    assert (plain.float() - by_hand).abs().max() <= tol * by_hand.abs().max()
    if "dropout" in base:
        with torch.no_grad():
            assert (layer.train()(x) - plain).abs().max() > 1e-3
