"""What a LoRA step asks of the CPU's products: the model's linear shapes, the useful FLOPs of a token, and the rate
torch's products reach at those shapes on this machine (bench.cpu's ratio to the GEMM rate).

Useful FLOPs a token: the forward and the input gradient of every frozen linear and of the vocabulary projection
(2 + 2 FLOPs per weight), the adapters' forward, input and weight gradients (6·r·(in + out) per target), and causal
attention (q·kᵀ and p·v, forward and backward: 3 x 4·d FLOPs per key seen, heads x positions / 2 keys on average
for full rows; packed rows' attention is left out, a lower bound). The step runs the vocabulary projection and the
last block's output projection and MLP only at the positions that predict a target, so those count at the data's
share of target tokens (a chat recipe's prompts take no loss). Recomputation and elementwise work are not useful.

The GEMM rate: for each shape, x·Wᵀ (forward) and gy·W (input gradient) at the step's rows, the faster of
F.linear and oneDNN's linear (lora_llama.kernels.gemm), in the run's dtype; the layers' and the head's rates
weighed by their FLOPs (a harmonic mean: the time the products alone would take)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from lora_llama.kernels import gemm

TARGET_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each decoder linear, by target name, from a config.json mapping."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {
        "q": (h, q),
        "k": (h, kv),
        "v": (h, kv),
        "o": (q, h),
        "gate": (h, inter),
        "up": (h, inter),
        "down": (inter, h),
    }


AFTER_ATTENTION = ("o", "gate", "up", "down")  # the last block's linears that run at target positions only


def useful_flops(cfg: dict, seq: int, r: int, targets, packed: bool = False, target_share: float = 1.0) -> float:
    """Useful FLOPs of one trained token (module docstring); target_share: the share of tokens that predict a
    target."""
    shapes, layers = linear_shapes(cfg), cfg["num_hidden_layers"]

    def linears(names) -> float:  # frozen forward and input gradient, and the adapters' three products
        return sum(4 * shapes[n][0] * shapes[n][1] + (6 * r * sum(shapes[n]) if n in targets else 0) for n in names)

    blocks = layers * linears(shapes) - (1 - target_share) * linears(AFTER_ATTENTION)
    head = 4 * cfg["hidden_size"] * cfg["vocab_size"] * target_share
    q_width = shapes["q"][1]
    attention = 0 if packed else layers * 3 * 4 * q_width * (seq + 1) / 2
    return blocks + head + attention


def _seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _product_seconds(rows: int, n_in: int, n_out: int, dtype: torch.dtype, repeats: int) -> float:
    """Forward plus input gradient of one (in, out) linear at `rows` rows: the faster of F.linear and oneDNN each."""
    x, w, gy = torch.randn(rows, n_in, dtype=dtype), torch.randn(n_out, n_in, dtype=dtype), torch.randn(rows, n_out)
    gy = gy.to(dtype)
    forward = min(_seconds(lambda: F.linear(x, w), repeats), _seconds(lambda: gemm.linear(x, w), repeats))
    backward = min(_seconds(lambda: F.linear(gy, w.t()), repeats), _seconds(lambda: gemm.linear(gy, w.t()), repeats))
    return forward + backward


def gemm_rate(cfg: dict, rows: int, dtype: torch.dtype, repeats: int = 3, target_share: float = 1.0) -> dict:
    """GFLOP/s of the products at the model's shapes: the layers', the head's (at the rows that predict a target, a
    chunk of at most 512 at a time, as the loss goes through them) and both weighed by their FLOPs."""
    shapes, layers = linear_shapes(cfg), cfg["num_hidden_layers"]
    layer_flops = layer_s = 0.0
    for n_in, n_out in dict.fromkeys(shapes.values()):  # k and v, gate and up share a shape
        count = sum(1 for s in shapes.values() if s == (n_in, n_out))
        layer_flops += count * 4 * rows * n_in * n_out
        layer_s += count * _product_seconds(rows, n_in, n_out, dtype, repeats)
    head_rows = max(1, round(rows * target_share))
    chunk = min(head_rows, 512)
    head_s = _product_seconds(chunk, cfg["hidden_size"], cfg["vocab_size"], dtype, repeats) * head_rows / chunk
    head_flops = 4 * head_rows * cfg["hidden_size"] * cfg["vocab_size"]
    total = layers * layer_flops + head_flops
    return {
        "layers": round(layer_flops / layer_s / 1e9),
        "head": round(head_flops / head_s / 1e9),
        "model": round(total / (layers * layer_s + head_s) / 1e9),
    }
