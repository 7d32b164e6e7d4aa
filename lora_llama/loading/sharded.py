"""fsdp's loading: the model is built on the meta device, wrapped in its adapters, sharded by FSDP2, and then
each rank reads from the checkpoint only the rows of each tensor that it owns (`safe_open(...).get_slice`),
quantizing them as it reads. No process, rank 0 included, ever holds the whole model.

FSDP2 cuts every tensor on dim 0 as `torch.chunk` does: rank r holds rows [r·c, r·c + its rows) with
c = ceil(rows / world). Quantized layers shard the same way because a format's tensors are laid out by output
row (`QuantFormat.layout`: a scale per row, blocks per row, a row of a GGUF's blocks per output row), and its
handler quantizes a rank's rows alone (`QuantFormat.quantize_rows`, which reads more where a format's scales
span rows).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from lora_llama.errors import UserError
from lora_llama.files.checkpoint_rows import CheckpointRows
from lora_llama.files.shards import aligned
from lora_llama.loading.adapters import load_adapter_weights
from lora_llama.loading.models import gguf_linear_blocks, meta_model, resolve_source
from lora_llama.lora.adapted import apply_lora
from lora_llama.quant.gguf_tensors import block_rows
from lora_llama.quant.handlers import QuantFormat, layer_format
from lora_llama.quant.linear import DECODER_LINEARS, QuantizedLinear
from lora_llama.runtime.distributed import shard_model


def sharded_adapted_model(source, lora, dtype, quantize: QuantFormat | None, device, ranks, adapter_dir=None):
    """(model, apply_lora's summary): the base sharded over the ranks from the start, its adapters on every rank
    as one process makes them (the same random draws), then cut into shards too."""
    folder = resolve_source(source)
    model = meta_model(folder)
    args = model.args
    if args.tie_word_embeddings:
        model.tie_weights()
    blocks = gguf_linear_blocks(source, args, copy=False) if quantize is not None and quantize.keeps_file_blocks else {}
    placeholders(model, quantize, blocks)
    summary = apply_lora(model, lora)
    if adapter_dir is not None:
        load_adapter_weights(model, adapter_dir)
    shard_model(model)
    fill_shards(model, CheckpointRows(folder), dtype, blocks, device, ranks)
    model.source, model.folder = str(source), folder
    return model.eval(), summary


def placeholders(model, quantize: QuantFormat | None, blocks: dict) -> None:
    """Each decoder linear to be quantized becomes a QuantizedLinear of meta tensors of its format's layout (a GGUF
    source's linears take the file's own kind)."""
    if quantize is None:
        return
    for i, block in enumerate(model.model.layers):
        for parent_name, parent in (("self_attn", block.self_attn), ("mlp", block.mlp)):
            for name in DECODER_LINEARS:
                lin, path = getattr(parent, name, None), f"model.layers.{i}.{parent_name}.{name}"
                if lin is None or quantize.keeps_file_blocks and path not in blocks:  # a GGUF type kept dequantized
                    continue
                fmt = layer_format(blocks[path][0]) if quantize.keeps_file_blocks else quantize
                setattr(parent, name, _meta_layer(lin, fmt))


def _meta_layer(lin: nn.Linear, fmt: QuantFormat) -> QuantizedLinear:
    out, inp = lin.out_features, lin.in_features
    fault = fmt.row_fault(inp)
    if fault:
        raise UserError(f"fsdp shards {fmt.name} layers by row: {fault}")
    layout = fmt.layout(out, inp)
    tensors = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in layout.items()}
    bias = lin.bias.detach() if lin.bias is not None else None
    return QuantizedLinear.from_tensors(inp, out, fmt.name, tensors, bias)


def fill_shards(model, rows: CheckpointRows, dtype, blocks: dict, device, ranks) -> None:
    """Replace every meta shard by the rows this rank owns, read from the checkpoint (a quantized layer's codes and
    scales quantized together, once); a tied weight stays tied."""
    done: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules():
        quantized = None
        for name, p in list(module._parameters.items()):
            if p is None or not _is_meta(p):
                continue
            if id(p) not in done:
                lo, hi = _owned(p, ranks)
                if isinstance(module, QuantizedLinear) and name != "bias":
                    quantized = quantized or _quantized(module, path, rows, blocks, lo, hi)
                    local = quantized[name]
                else:
                    key = f"{path.removesuffix('.base_layer')}.{name}"
                    _check_shape(rows, key, p.shape)
                    local = aligned(rows.rows(key, lo, hi).to(dtype))
                done[id(p)] = _as_shard(local.to(device), p)
            module._parameters[name] = done[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:  # GGUF's empty scales; double quantization's second level, whole
                module._buffers[name] = quantized[name].to(device)


def _is_meta(p) -> bool:
    return (p._local_tensor if hasattr(p, "_local_tensor") else p).is_meta


def _owned(p, ranks) -> tuple[int, int]:
    """The rows [lo, hi) of a dim-0 shard this rank holds."""
    lo = ranks.rank * math.ceil(p.shape[0] / ranks.world)
    return lo, lo + p._local_tensor.shape[0]


def _quantized(module: QuantizedLinear, path: str, rows: CheckpointRows, blocks: dict, lo: int, hi: int) -> dict:
    """The tensors of rows lo..hi of a layer's quantized weight, by name. A slice of a whole tensor is cloned, so
    the whole one is freed."""
    key = f"{path.removesuffix('.base_layer')}.weight"
    fmt = module.quant_format()
    if not fmt.from_float:  # a GGUF's blocks
        return {"codes": block_rows(blocks[key.removesuffix(".weight")], lo, hi), "scales": torch.empty(0)}
    _check_shape(rows, key, (module.out_features, module.in_features))
    return fmt.quantize_rows(lambda r0, r1: rows.rows(key, r0, r1), module.out_features, lo, hi)


def _check_shape(rows: CheckpointRows, key: str, shape) -> None:
    if list(rows.shape(key)) != list(shape):
        raise UserError(f"{key} has shape {tuple(rows.shape(key))}, config.json implies {tuple(shape)}")


def _as_shard(local: torch.Tensor, meta_param) -> nn.Parameter:
    """A parameter holding this rank's rows of the whole tensor `meta_param` describes."""
    from torch.distributed.tensor import DTensor

    shard = DTensor.from_local(
        local.contiguous(),
        meta_param.device_mesh,
        meta_param.placements,
        run_check=False,
        shape=meta_param.shape,
        stride=meta_param.stride(),
    )
    return nn.Parameter(shard, requires_grad=False)
