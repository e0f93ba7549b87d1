"""The unit of training data: one batch of examples with jagged user histories.

Shared contract between the dataset layer, the data service (which ships it over gRPC) and the trainer
(which adapts it to the model's input). Jagged sequences follow the project convention: `values` of
shape (total_tokens, ...) plus `offsets` of shape (B+1,), int64, and a host-side `max_seq_len`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class Batch:
    # Per example (B rows).
    user_ids: torch.Tensor  # (B,) int64 user_id embedding id (the dense user index unless hashed)
    item_ids: torch.Tensor  # (B,) int64 item_id embedding id of the target item (dense index unless hashed)
    timestamps: torch.Tensor  # (B,) int64 unix seconds of the target event
    labels: torch.Tensor  # (B, num_labels) float32 in {0, 1}
    dense_features: torch.Tensor  # (B, num_dense) float32, may have 0 columns
    sparse_features: KeyedJaggedTensor  # stride B: non-sequence categorical features (user, target item, context)
    # Jagged history: the user's events strictly before `timestamps`, oldest first, most recent max_seq_len.
    seq_offsets: torch.Tensor  # (B+1,) int64
    seq_item_ids: torch.Tensor  # (T,) int64
    seq_timestamps: torch.Tensor  # (T,) int64
    seq_actions: torch.Tensor  # (T, num_actions) float32: labels/event columns of past events
    seq_item_features: KeyedJaggedTensor | None  # stride T: item side features of history tokens
    max_seq_len: int  # host-side max of the lengths in this batch
    label_names: tuple[str, ...] = ()
    cursor: bytes = b""  # resume position of the stream that produced this batch (data service)

    @property
    def batch_size(self) -> int:
        return int(self.user_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.seq_item_ids.shape[0])

    def seq_lengths(self) -> torch.Tensor:
        return self.seq_offsets[1:] - self.seq_offsets[:-1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (torch.Tensor, KeyedJaggedTensor)):
                value = value.to(device, non_blocking=non_blocking)
            moved[f.name] = value
        return replace(self, **moved)
