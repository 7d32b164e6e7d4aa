"""Native LLaMA vs transformers: forward latency and greedy decode tokens/s, one run.

SmolLM2-135M shapes, random weights, float32, 2 threads. Prints a table and, last,
one JSON line with native time / transformers time ratios (< 1 means native is faster).
"""

import argparse

import torch

from bench.common import cpu_line, median_time, random_checkpoint, record
from lora_llama import load_model
from lora_llama.model.generate import generate


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    from transformers import LlamaForCausalLM

    folder = random_checkpoint()
    native = load_model(folder)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    figures = {}
    print(cpu_line())
    print(f"{'case':<28}{'native':>12}{'transformers':>14}{'ratio':>8}")
    fwd = []
    for batch in (1, 4):
        x = torch.randint(3, 49152, (batch, a.seq))
        tn = median_time(lambda: native(x), a.repeat)
        th = median_time(lambda: hf(x, use_cache=False).logits, a.repeat)
        fwd.append(tn / th)
        figures[f"forward_b{batch}_ms"] = {
            "lora_llama": round(tn * 1e3, 1),
            "transformers": round(th * 1e3, 1),
            "time_ratio": round(tn / th, 3),
        }
        print(f"{f'forward b={batch} T={a.seq} (ms)':<28}{tn * 1e3:>12.1f}{th * 1e3:>14.1f}{tn / th:>8.2f}")
    prompt = torch.randint(3, 49152, (1, 32))
    tn = median_time(lambda: generate(native, prompt[0].tolist(), a.new_tokens), 3)
    th = median_time(
        lambda: hf.generate(
            prompt, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=2
        ),
        3,
    )
    print(f"{'greedy decode (tokens/s)':<28}{a.new_tokens / tn:>12.1f}{a.new_tokens / th:>14.1f}{tn / th:>8.2f}")
    figures["decode_tokens_per_s"] = {
        "lora_llama": round(a.new_tokens / tn, 1),
        "transformers": round(a.new_tokens / th, 1),
        "time_ratio": round(tn / th, 3),
    }
    record("forward", figures)


if __name__ == "__main__":
    main()
