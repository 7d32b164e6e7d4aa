"""The KV cache of incremental decoding: keys and values stored as they are computed, one pair of tensors per
layer, with a mask of the positions that are keys (a row's left padding is not); and its static form, whose
decoding steps all have one shape for a CUDA graph."""

from __future__ import annotations

import torch

from lora_llama.model.config import ModelArgs


class KVCache:
    """Pre-allocated keys and values for incremental decoding, one pair per layer."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device, dtype, key_mask: torch.Tensor | None = None):
        shape = (batch, args.n_kv_heads, max_len, args.head_dim)
        # (batch, max_len) bool, False at a row's left padding: rows of several prompt lengths decode together
        self.key_mask = key_mask
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.pos = 0  # number of positions already stored

    def repeat_rows(self, times: int) -> None:
        """Each row `times` times in a row: prompts run once, continued by several samples each."""
        self.k = [k.repeat_interleave(times, 0) for k in self.k]
        self.v = [v.repeat_interleave(times, 0) for v in self.v]
        if self.key_mask is not None:
            self.key_mask = self.key_mask.repeat_interleave(times, 0)

    def make_room(self, n: int) -> None:
        """At least n more positions free (the keys and values copied into longer tensors when there are not): a
        conversation's turns add what no one can size up front. New positions are keys once written."""
        short = self.pos + n - self.k[0].shape[2]
        if short <= 0:
            return
        grown = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], short, t.shape[3])], 2)  # noqa: E731
        self.k, self.v = [grown(k) for k in self.k], [grown(v) for v in self.v]
        if self.key_mask is not None:
            self.key_mask = torch.cat([self.key_mask, self.key_mask.new_ones(self.key_mask.shape[0], short)], 1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        end = self.pos + k.shape[2]
        self.k[layer][:, :, self.pos : end] = k
        self.v[layer][:, :, self.pos : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.pos += n


class StaticKVCache(KVCache):
    """A cache whose decoding steps all have the same shapes, so that one can be captured as a CUDA graph and
    replayed: a new token's keys and values go in at `index`, a device tensor, and attention reads the whole
    length with a mask made on the device (positions past `index` unseen). The prompt is written as KVCache does;
    `index` then points past it."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device, dtype, key_mask: torch.Tensor):
        super().__init__(args, batch, max_len, device, dtype, key_mask)
        self.index = torch.zeros(1, dtype=torch.long, device=device)  # the column the next token's keys go to
        self.key_pos = torch.arange(max_len, device=device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if k.shape[2] > 1:
            return super().update(layer, k, v)
        self.k[layer].index_copy_(2, self.index, k)
        self.v[layer].index_copy_(2, self.index, v)
        return self.k[layer], self.v[layer]

    def step_mask(self, window: int | None) -> torch.Tensor:
        """(B, 1, 1, max_len) bool: the keys one new token sees, made on the device."""
        seen = self.key_pos <= self.index
        if window is not None:
            seen &= self.key_pos > self.index - window
        return (self.key_mask & seen)[:, None, None]

    def advance(self, n: int) -> None:
        super().advance(n)
        self.index += n  # in place: a captured step advances it each replay
