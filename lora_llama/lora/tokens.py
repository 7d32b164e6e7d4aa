"""Training the embedding and lm_head beside LoRA, as peft does: `SavedModule` (peft's modules_to_save: a trained
copy of the whole module) and `TrainableTokens` (peft's trainable_token_indices: only the listed rows trained).
Both keep the frozen original, which answers while the adapters are switched off (a DPO reference, `--compare`).

Parameter names follow peft's (`embed_tokens.modules_to_save.weight`, `embed_tokens.trainable_tokens_delta`), so
the adapter file's keys are peft's after `loading/adapters.py` maps them."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from lora_llama.errors import UserError

# peft's module names -> their paths in the model
EMBEDDING_PATHS = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}


class SavedModule(nn.Module):
    """A float32 trained copy of an nn.Embedding or nn.Linear beside its frozen original (peft's
    ModulesToSaveWrapper). Outputs keep the original's dtype, so bf16 activations stay bf16."""

    def __init__(self, original: nn.Module):
        super().__init__()
        if type(original) not in (nn.Embedding, nn.Linear):
            raise UserError(f"modules_to_save needs a plain embedding or linear, not {type(original).__name__}")
        self.original_module = original
        trained = copy.deepcopy(original).float()
        trained.requires_grad_(True)
        self.modules_to_save = trained
        self.disabled = False

    @property
    def active(self) -> nn.Module:
        return self.original_module if self.disabled else self.modules_to_save

    @property
    def weight(self) -> torch.Tensor:  # the frozen original's: its dtype and device are the model's
        return self.original_module.weight

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.active, nn.Embedding):
            return self.active(x).to(self.weight.dtype)
        return self.active(x.to(self.active.weight.dtype))

    def merged_module(self) -> nn.Module:
        """The trained copy in the model's dtype, frozen: what the model holds after a merge."""
        return self.modules_to_save.to(self.weight.dtype).requires_grad_(False)


class TrainableTokens(nn.Module):
    """The rows `token_indices` of an nn.Embedding or nn.Linear trained, the others the frozen base's (peft's
    TrainableTokensLayer). `trainable_tokens_delta` holds the rows' values themselves (peft's name); a tied lm_head
    reads the embedding's (`tied_to`)."""

    def __init__(self, base_layer: nn.Module, indices: list[int], tied_to: TrainableTokens | None = None):
        super().__init__()
        if type(base_layer) not in (nn.Embedding, nn.Linear):
            raise UserError(
                f"trainable_token_indices needs a plain embedding or linear, not {type(base_layer).__name__}"
            )
        vocab = base_layer.weight.shape[0]
        if any(not 0 <= i < vocab for i in indices):
            raise UserError(
                f"lora.trainable_token_indices: token {max(indices)} is past the vocabulary (0..{vocab - 1})"
            )
        self.base_layer = base_layer
        self.indices = list(indices)
        self.register_buffer("token_indices", torch.tensor(indices, device=base_layer.weight.device), persistent=False)
        # slot[token] = the token's row in the delta, -1 for the base's rows
        slot = torch.full((vocab,), -1, dtype=torch.long, device=base_layer.weight.device)
        slot[self.token_indices] = torch.arange(len(indices), device=slot.device)
        self.register_buffer("slot", slot, persistent=False)
        self._tied = [tied_to] if tied_to is not None else []  # a list: not registered as a submodule twice
        if tied_to is None:
            rows = base_layer.weight.detach()[self.token_indices].float().clone()
            self.trainable_tokens_delta = nn.Parameter(rows)
        self.disabled = False

    @property
    def delta(self) -> torch.Tensor:
        return self._tied[0].trainable_tokens_delta if self._tied else self.trainable_tokens_delta

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self.disabled:
            return out
        if isinstance(self.base_layer, nn.Embedding):
            hit = self.slot[x]
            rows = self.delta[hit.clamp(min=0)].to(out.dtype)
            return torch.where((hit >= 0)[..., None], rows, out)
        return out.index_copy(-1, self.token_indices, F.linear(x, self.delta.to(x.dtype)).to(out.dtype))

    def merged_module(self) -> nn.Module:
        """The base module with the trained rows written in (a tied lm_head's weight is the embedding's)."""
        with torch.no_grad():
            if not self._tied:
                self.base_layer.weight[self.token_indices] = self.delta.to(self.base_layer.weight.dtype)
        return self.base_layer


def wrap_embeddings(model, modules_to_save: list[str] | None, by_module: dict[str, list[int]]) -> None:
    """Wrap the modules the settings name (by_module: LoraSettings.trainable_rows); call with every parameter
    already frozen. A tied lm_head is untied for modules_to_save (peft's copy of one leaves the other as it was)
    and shares the embedding's trained rows."""
    if modules_to_save:
        model.untie_weights()
        for name in modules_to_save:
            _replace(model, EMBEDDING_PATHS[name], SavedModule(model.get_submodule(EMBEDDING_PATHS[name])))
    if not by_module:
        return
    tied = model.args.tie_word_embeddings
    if tied and "lm_head" in by_module:
        raise UserError(
            "lora.trainable_token_indices names lm_head, which shares the embedding's rows in this model: "
            "list the rows under embed_tokens"
        )
    for name, indices in by_module.items():
        _replace(model, EMBEDDING_PATHS[name], TrainableTokens(model.get_submodule(EMBEDDING_PATHS[name]), indices))
    if tied and "embed_tokens" in by_module:
        model.lm_head = TrainableTokens(model.lm_head, by_module["embed_tokens"], tied_to=model.model.embed_tokens)


def _replace(model, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def embedding_wrappers(model) -> dict[str, SavedModule | TrainableTokens]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (SavedModule, TrainableTokens))}


def embedding_settings(model) -> dict:
    """{"modules_to_save": ..., "trainable_token_indices": ...} as the wrappers were made (None where unused)."""
    wrappers = embedding_wrappers(model)
    by_path = {path: name for name, path in EMBEDDING_PATHS.items()}
    saved = [by_path[p] for p, m in wrappers.items() if isinstance(m, SavedModule)]
    rows = {by_path[p]: m.indices for p, m in wrappers.items() if isinstance(m, TrainableTokens) and not m._tied}
    return {
        "modules_to_save": saved or None,
        "trainable_token_indices": (rows["embed_tokens"] if list(rows) == ["embed_tokens"] else rows) or None,
    }


def merge_embeddings(model) -> None:
    """Replace every wrapper by its merged module (the tied lm_head after the embedding it reads)."""
    for path, m in sorted(embedding_wrappers(model).items(), key=lambda item: item[0] == "lm_head"):
        _replace(model, path, m.merged_module())
