"""What a label means, for the data that writes labels and the losses that read them: IGNORE_INDEX marks a
position that takes no loss, and position t predicts labels[t + 1]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def target_mask(labels: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T-1) bool: which of labels[:, 1:] the loss takes (the one definition)."""
    keep = labels[:, 1:] != IGNORE_INDEX
    if segment_ids is not None:  # a packed row: the last token of one example does not predict the next
        keep &= segment_ids[:, 1:] == segment_ids[:, :-1]
    return keep


def where_targets(labels: torch.Tensor, segment_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """{"targets": the target ids (N,), "predicting": the flat positions of (B, T) whose outputs predict them (N,)}.
    Taken where a batch is built, on the host, they let a GPU step run without waiting to learn N."""
    keep = target_mask(labels, segment_ids)
    return {"targets": labels[:, 1:][keep], "predicting": F.pad(keep, (0, 1)).flatten().nonzero().squeeze(1)}
