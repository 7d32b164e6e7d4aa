"""`adapted_model`: a base with LoRA adapters, built one way for every caller (a run, `generate`, `eval`): the
base loaded (or, under fsdp, each rank's rows of it), the adapters applied, and their weights read from a PEFT
folder when one is given."""

from __future__ import annotations

import torch

from lora_llama.loading.adapters import load_adapter, load_adapter_weights
from lora_llama.loading.models import load_model
from lora_llama.loading.sharded import sharded_adapted_model
from lora_llama.lora.adapted import apply_lora
from lora_llama.lora.init import moves_w0
from lora_llama.quant.experts import quantize_loaded_experts
from lora_llama.quant.handlers import QuantFormat, quant_format
from lora_llama.quant.linear import quantize_loaded_linears


def loads_by_rows(lora) -> bool:
    """Whether fsdp can load the base row by row: DoRA's magnitude and PiSSA / OLoRA's split need whole weights."""
    return not lora.use_dora and not moves_w0(lora.init_lora_weights)


def adapted_model(
    source,
    lora=None,
    adapter=None,
    dtype=torch.float32,
    quantize: str | QuantFormat | None = None,
    device="cpu",
    ranks=None,
):
    """(model, apply_lora's summary). lora: the adapters' settings (None: those of `adapter`, a PEFT folder);
    adapter: the folder their weights start from (None: fresh adapters). ranks: under fsdp, each rank builds
    only its shards of the base (when `loads_by_rows`). The frozen base is quantized in the format `quantize` (a
    handler or its name); under PiSSA / OLoRA the residual their start leaves is what gets quantized."""
    quantize = quant_format(quantize)
    if lora is None:
        model = load_model(source, dtype, quantize, device)
        return model, load_adapter(model, adapter)
    if ranks is not None and ranks.world > 1 and loads_by_rows(lora):
        return sharded_adapted_model(source, lora, dtype, quantize, device, ranks, adapter)
    principal = moves_w0(lora.init_lora_weights)
    model = load_model(source, dtype, None if principal else quantize, device)
    summary = apply_lora(model, lora)
    if principal and quantize:
        quantize_loaded_linears(model, quantize)
        quantize_loaded_experts(model, quantize)
    if adapter is not None:
        load_adapter_weights(model, adapter)
    return model, summary
