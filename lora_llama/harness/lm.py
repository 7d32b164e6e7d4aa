"""The native model as an lm-evaluation-harness model: `NativeLM` is lm-eval's own `HFLM` with the model call and the
generation replaced, so requests are tokenized, truncated, batched (length-sorted) and scored exactly as
`lm_eval --model hf` does them, while the logits come from the native model (adapters active, in its precision,
quantized base and device) and generations from its decoding loop (model/generate.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from lora_llama.model.generate import sample_completions


class _AsTransformersModel(nn.Module):
    """What HFLM reads of a transformers model: `config`, `device`, `tie_weights`, and `model(ids).logits`."""

    def __init__(self, model, config):
        super().__init__()
        self.native, self.config = model, config

    @property
    def device(self) -> torch.device:
        return next(self.native.parameters()).device

    def tie_weights(self) -> None:  # the native model ties its own
        pass

    def forward(self, input_ids, **_):
        return SimpleNamespace(logits=self.native(input_ids))


def generation_eos_ids(folder) -> list[int]:
    """The ids transformers' generate stops at for this checkpoint: generation_config.json's eos_token_id, else
    config.json's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:
        eos = GenerationConfig.from_model_config(_config(folder)).eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def native_lm(model, tokenizer, batch_size: int = 8, max_length: int | None = None):
    """An lm-eval model (lm_eval.api.model.LM) over the native `model` and an HF `tokenizer`."""
    from lm_eval.models.huggingface import HFLM

    class NativeLM(HFLM):
        def __init__(self):
            super().__init__(
                pretrained=_AsTransformersModel(model, _config(model.folder)),
                tokenizer=tokenizer,
                backend="causal",
                batch_size=batch_size,
                max_length=max_length,
            )
            self.eos_ids = generation_eos_ids(model.folder)

        def _model_generate(self, context, max_length, stop, **kwargs):
            """context (B, P) left-padded with its attention_mask; returns (B, P + new) as transformers' generate
            does: the context, then each row's tokens, padding after its EOS or stop string."""
            mask = kwargs.get("attention_mask")
            mask = torch.ones_like(context) if mask is None else mask
            rows = [c[m.bool()].tolist() for c, m in zip(context, mask)]
            temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
            pad = self.tokenizer.pad_token_id

            def stopped(tokens: torch.Tensor) -> torch.Tensor:
                texts = self.tokenizer.batch_decode(tokens.tolist())
                return torch.tensor([any(s in t for s in stop) for t in texts])

            new = sample_completions(
                model,
                rows,
                max_length - context.shape[1],
                self.eos_ids,
                pad,
                temperature=temperature,
                seeds=list(range(len(rows))) if temperature else None,
                stopped=stopped if stop else None,
            )
            out = torch.full((len(rows), max_length), pad, dtype=torch.long)
            out[:, : context.shape[1]] = context.cpu()
            for i, tokens in enumerate(new):
                out[i, context.shape[1] : context.shape[1] + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            return out

        def get_model_info(self) -> dict:
            return {"model": str(model.source), "model_num_parameters": sum(p.numel() for p in model.parameters())}

    return NativeLM()
