"""Decoding steps at the device's pace: one token a step for a batch of rows, over a cache of fixed shape
(`StaticKVCache`), and on CUDA each step after the first a replay of one captured CUDA graph.

An eager decoding step of a small model is a few hundred kernel launches from Python for milliseconds of GPU
work; a replayed graph is one launch. Every step of a `StaticDecoder` has the same shapes (the cache's length and
its rows are bucketed), reads its inputs from the same buffers and advances its positions on the device, so the
graph captured once serves every token of every later call of nearby batch sizes and lengths. It reads the
weights where they live: training updates the adapter in place between calls, and the graph sees the new values.
A decoder is kept per (rows, length) bucket and per state of the model's modules (their identity, an adapter
switched off or merged): a change of any captures anew.
"""

from __future__ import annotations

import warnings

import torch

from lora_llama.model.cache import KVCache

LENGTH_BUCKET = 128  # cache lengths are rounded up to a multiple: calls of nearby prompt lengths share a graph
KEPT = 2  # decoders kept per model (GRPO's sampling and its greedy eval), the oldest dropped first
_capture_failed = False  # whether a capture has failed in this process (said once)


def bucket_rows(rows: int) -> int:
    """The rows a decoder is made for: 1, 2, 4, then multiples of 8 (vLLM's CUDA graph sizes), so that calls of
    nearby batch sizes (lm-eval's last, smaller batch) share a graph; the rows past a call's own are idle."""
    return 1 << (rows - 1).bit_length() if rows <= 4 else -(-rows // 8) * 8


class StaticDecoder:
    """Decoding steps for `batch` rows over a StaticKVCache of `length` positions."""

    def __init__(self, model, batch: int, length: int):
        p = model.model.embed_tokens.weight
        self.model = model
        self.rows = batch  # the call at hand uses the first `rows` of the batch (set by load)
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
        n, rows = prompt.pos, prompt.key_mask.shape[0] * group
        self.rows = rows
        for mine, theirs in zip(self.cache.k + self.cache.v, prompt.k + prompt.v):
            mine[:rows, :, :n].unflatten(0, (-1, group)).copy_(theirs[:, None, :, :n])
        width = prompt.key_mask.shape[1]
        self.cache.key_mask.fill_(True)  # idle rows (past `rows`) attend to anything: finite, and never read
        self.cache.key_mask[:rows, :width].unflatten(0, (-1, group)).copy_(prompt.key_mask[:, None])
        self.cache.index.fill_(n)
        self.cache.pos = n
        self.position.zero_()
        self.position[:rows].copy_(next_position)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """The logits (rows, V) after `token` (rows,), the cache and positions advanced by one. On CUDA the returned
        tensor is a view of the graph's output buffer: read it before the next step."""
        self.token[: self.rows].copy_(token)
        if self.graph is not None:
            self.graph.replay()
            return self.logits[: self.rows]
        if self.graphed and self.warm:
            try:
                self._capture()
            except Exception as e:  # a capture that fails (a compile or a host sync inside it): the eager step
                self._eager_from_now_on(e)
                return self._forward()[: self.rows]
            self.graph.replay()
            return self.logits[: self.rows]
        self.warm = True  # the first step eagerly: lazy initialisations (cuBLAS, compiled kernels) stay out of graphs
        if not self.graphed:
            return self._forward()[: self.rows]
        side = torch.cuda.Stream()  # on a side stream, as CUDA graphs' warm-up must be
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._forward()
        torch.cuda.current_stream().wait_stream(side)
        return logits[: self.rows]

    def _capture(self) -> None:
        """Record one step as a CUDA graph (its kernels recorded, none run: replayed right after)."""
        pos, graph = self.cache.pos, torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.logits = self._forward()
        except BaseException:
            self.cache.pos = pos  # the host's count advanced, the device ran nothing: the step is still to run
            raise
        self.graph = graph

    def _eager_from_now_on(self, error: Exception) -> None:
        """The step's eager form for this decoder from now on, said once for the process."""
        global _capture_failed
        self.graphed, self.graph = False, None
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # whatever the failed capture left queued is done before eager steps
        if not _capture_failed:
            _capture_failed = True
            reason = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)[:200]
            warnings.warn(f"CUDA graph capture failed ({reason}); decoding steps run eagerly (slower)", stacklevel=3)

    def _forward(self) -> torch.Tensor:
        logits = self.model(self.token[:, None], position_ids=self.position[:, None], cache=self.cache)[:, -1]
        self.position += 1
        return logits


def decoder_for(model, batch: int, length: int) -> StaticDecoder:
    """The model's decoder for this batch and length (both bucketed), made or captured anew when its modules
    changed."""
    batch, length = bucket_rows(batch), -(-length // LENGTH_BUCKET) * LENGTH_BUCKET
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
