"""Next-item retrieval losses over a model's `sequence_vectors` and `item_vectors` (GEMModel, SASRec).

`hidden` are sequence vectors at the positions that predict an item, `(P, d)`; items are scored by the dot
product. Three losses:
- `softmax_loss`: cross-entropy of the target against every item of the catalog (full softmax);
- `sampled_softmax_loss`: cross-entropy of the target against K sampled negatives shared by the batch
  (uniform sampling, so the log-Q correction is a constant and dropped); negatives equal to a row's target
  are masked out of that row;
- `bce_loss`: binary cross-entropy of the target against one negative per position (SASRec's paper loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSSES = ("softmax", "sampled", "bce")


def softmax_loss(hidden: torch.Tensor, item_vectors: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`item_vectors` (N, d) of the whole catalog, `targets` (P,) indices into it."""
    return F.cross_entropy(hidden @ item_vectors.t(), targets)


def sampled_softmax_loss(
    hidden: torch.Tensor,
    target_vectors: torch.Tensor,
    negative_vectors: torch.Tensor,
    accidental_hits: torch.Tensor,
) -> torch.Tensor:
    """`target_vectors` (P, d), `negative_vectors` (K, d), `accidental_hits` (P, K) True where a negative is
    the row's target."""
    positive = (hidden * target_vectors).sum(-1, keepdim=True)
    negative = (hidden @ negative_vectors.t()).masked_fill(accidental_hits, float("-inf"))
    logits = torch.cat([positive, negative], dim=1)
    return F.cross_entropy(logits, torch.zeros(len(hidden), dtype=torch.long, device=hidden.device))


def bce_loss(hidden: torch.Tensor, target_vectors: torch.Tensor, negative_vectors: torch.Tensor) -> torch.Tensor:
    """`target_vectors` and `negative_vectors` (P, d): one negative per position."""
    positive = (hidden * target_vectors).sum(-1)
    negative = (hidden * negative_vectors).sum(-1)
    return F.softplus(-positive).mean() + F.softplus(negative).mean()
