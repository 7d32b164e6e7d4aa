"""Decoding steps at the device's pace: one token a step for a batch of rows, over a cache of fixed shape
(`StaticKVCache`), and on CUDA each step after the first a replay of one captured CUDA graph.

An eager decoding step of a small model is a few hundred kernel launches from Python for milliseconds of GPU
work; a replayed graph is one launch. Every step of a `StaticDecoder` has the same shapes (the cache's length is
bucketed), reads its inputs from the same buffers and advances its positions on the device, so the graph
captured once serves every token of every later call of the same batch and length. It reads the weights where
they live: training updates the adapter in place between calls, and the graph sees the new values. A decoder is
kept per (batch, length) and per state of the model's modules (their identity, an adapter switched off or
merged): a change of any captures anew.
"""

from __future__ import annotations

import torch

from lora_llama.model.llama import KVCache

LENGTH_BUCKET = 128  # cache lengths are rounded up to a multiple: calls of nearby prompt lengths share a graph
KEPT = 2  # decoders kept per model (GRPO's sampling and its greedy eval), the oldest dropped first


class StaticDecoder:
    """Decoding steps for `batch` rows over a StaticKVCache of `length` positions."""

    def __init__(self, model, batch: int, length: int):
        p = model.model.embed_tokens.weight
        self.model = model
        self.cache = model.new_cache(
            batch, length, torch.ones(batch, length, dtype=torch.bool, device=p.device), static=True
        )
        self.token = torch.zeros(batch, dtype=torch.long, device=p.device)  # the step's input, (B,)
        self.position = torch.zeros(batch, dtype=torch.long, device=p.device)  # its RoPE position, (B,)
        self.graphed = p.is_cuda
        self.graph, self.logits, self.warm = None, None, False

    def load(self, prompt: KVCache, group: int, next_position: torch.Tensor) -> None:
        """Take a prefilled cache's keys and values (each of its rows `group` times in a row), its key mask and the
        rows' next positions (B,)."""
        n = prompt.pos
        for mine, theirs in zip(self.cache.k + self.cache.v, prompt.k + prompt.v):
            mine[:, :, :n].unflatten(0, (-1, group)).copy_(theirs[:, None, :, :n])
        width = prompt.key_mask.shape[1]
        self.cache.key_mask[:, width:] = True
        self.cache.key_mask[:, :width].unflatten(0, (-1, group)).copy_(prompt.key_mask[:, None])
        self.cache.index.fill_(n)
        self.cache.pos = n
        self.position.copy_(next_position)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """The logits (B, V) after `token` (B,), the cache and positions advanced by one. On CUDA the returned
        tensor is the graph's output buffer: read it before the next step."""
        self.token.copy_(token)
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        if self.graphed and self.warm:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records the step's kernels, runs none: replayed right after
                self.logits = self._forward()
            self.graph.replay()
            return self.logits
        self.warm = True  # the first step eagerly: lazy initialisations (cuBLAS, compiled kernels) stay out of graphs
        if not self.graphed:
            return self._forward()
        side = torch.cuda.Stream()  # on a side stream, as CUDA graphs' warm-up must be
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._forward()
        torch.cuda.current_stream().wait_stream(side)
        return logits

    def _forward(self) -> torch.Tensor:
        logits = self.model(self.token[:, None], position_ids=self.position[:, None], cache=self.cache)[:, -1]
        self.position += 1
        return logits


def decoder_for(model, batch: int, length: int) -> StaticDecoder:
    """The model's decoder for this batch and (bucketed) length, made or captured anew when its modules changed."""
    length = -(-length // LENGTH_BUCKET) * LENGTH_BUCKET
    key = (
        batch,
        length,
        tuple((id(m), getattr(m, "disabled", None), getattr(m, "merged", None)) for m in model.modules()),
    )
    kept = model.__dict__.setdefault("_static_decoders", {})
    if key not in kept:
        while len(kept) >= KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = StaticDecoder(model, batch, length)
    return kept[key]
