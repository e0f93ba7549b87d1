"""What the model reads and returns: `ModelInput` and `ModelOutput` (and `JaggedFeatures`, from `gemrec.jagged`).

`ModelInput` mirrors the data layer's `Batch` field for field (the trainer adapts one to the other), so
neither package imports the other. Sparse features are a torchrec `KeyedJaggedTensor` or a
`gemrec.jagged.JaggedFeatures`, a small class with the same read API that needs no torchrec (the GPU machine lacks
it). Jagged layout: per key, `lengths` has `stride` entries; `values` holds all keys' values key after key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from gemrec.jagged import JaggedFeatures

__all__ = ["JaggedFeatures", "ModelInput", "ModelOutput"]


@dataclass
class ModelInput:
    """One batch as the model sees it. B examples, T history tokens in total."""

    sparse_features: Any  # KeyedJaggedTensor | JaggedFeatures, stride B: user / target-item / context ids
    dense_features: torch.Tensor  # (B, num_dense) float32, may have 0 columns
    seq_offsets: torch.Tensor  # (B+1,) int64
    seq_item_ids: torch.Tensor  # (T,) int64: history tokens, oldest first
    seq_timestamps: torch.Tensor  # (T,) int64 unix seconds
    seq_actions: torch.Tensor  # (T, num_actions) float32
    seq_item_features: Any  # KeyedJaggedTensor | JaggedFeatures | None, stride T
    max_seq_len: int  # host-side max history length in this batch
    timestamps: torch.Tensor  # (B,) int64 unix seconds of the target events
    # Not in Batch: (B,) int64 index of each example's history when examples share histories (H of them, in
    # the seq_* fields, seq_offsets (H+1,)): several candidates scored for one request. None: one per example.
    history_index: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.timestamps.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.seq_item_ids.shape[0])

    @property
    def num_histories(self) -> int:
        return int(self.seq_offsets.shape[0]) - 1

    def seq_lengths(self) -> torch.Tensor:
        """History lengths, one per history (per example unless `history_index` shares them)."""
        return self.seq_offsets[1:] - self.seq_offsets[:-1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ModelInput:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and hasattr(value, "to") and not isinstance(value, int):
                value = value.to(device, non_blocking=non_blocking)
            moved[f.name] = value
        return replace(self, **moved)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, num_tasks)
    aux_loss: torch.Tensor  # scalar: weighted mixture-of-experts load-balancing loss (0 without MoE)
