"""What the model reads and returns: `ModelInput`, `ModelOutput` and `JaggedFeatures`.

`ModelInput` mirrors the data layer's `Batch` field for field (the trainer adapts one to the other), so
neither package imports the other. Sparse features are a torchrec `KeyedJaggedTensor` or a
`JaggedFeatures`, a small class with the same read API that needs no torchrec (the GPU machine lacks it).
Jagged layout: per key, `lengths` has `stride` entries; `values` holds all keys' values key after key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch


class JaggedFeatures:
    """Keyed jagged ids with the read API of torchrec's `KeyedJaggedTensor` (no torchrec needed).

    `values` holds every key's values, key after key; `lengths` has `len(keys) * stride` entries.
    """

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, stride: int | None = None):
        keys = list(keys)
        if len(set(keys)) != len(keys):
            raise ValueError(f"JaggedFeatures: duplicate keys in {keys}")
        if values.dim() != 1 or lengths.dim() != 1:
            raise ValueError(
                f"JaggedFeatures: values and lengths must be 1-D, got {tuple(values.shape)} and {tuple(lengths.shape)}"
            )
        if stride is None:
            if not keys:
                raise ValueError("JaggedFeatures: stride is required when there are no keys")
            if lengths.numel() % len(keys):
                raise ValueError(f"JaggedFeatures: {lengths.numel()} lengths do not split over {len(keys)} keys")
            stride = lengths.numel() // len(keys)
        if lengths.numel() != len(keys) * stride:
            raise ValueError(
                f"JaggedFeatures: expected {len(keys)} keys x stride {stride} lengths, got {lengths.numel()}"
            )
        self._keys = keys
        self._values = values
        self._lengths = lengths
        self._stride = int(stride)

    @classmethod
    def from_dict(cls, features: dict[str, tuple[torch.Tensor, torch.Tensor]], stride: int | None = None):
        """Build from `{key: (values, lengths)}`; every key must have the same number of rows."""
        keys = list(features)
        if not keys:
            if stride is None:
                raise ValueError("JaggedFeatures.from_dict: stride is required when there are no keys")
            return cls([], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), stride)
        values = torch.cat([torch.as_tensor(features[k][0]).reshape(-1).long() for k in keys])
        lengths = torch.cat([torch.as_tensor(features[k][1]).reshape(-1).long() for k in keys])
        return cls(keys, values, lengths, stride)

    @classmethod
    def from_kjt(cls, kjt: Any) -> JaggedFeatures:
        return cls(list(kjt.keys()), kjt.values(), kjt.lengths(), kjt.stride())

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return torch.nn.functional.pad(torch.cumsum(self._lengths, 0), (1, 0))

    def stride(self) -> int:
        return self._stride

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedFeatures:
        return JaggedFeatures(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            self._stride,
        )

    def __getitem__(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`(values, lengths)` of one key (a host sync: for inspection and tests, not the forward)."""
        if key not in self._keys:
            raise KeyError(f"JaggedFeatures has no key {key!r} (keys: {self._keys})")
        i = self._keys.index(key)
        per_key = self._lengths.view(len(self._keys), self._stride).sum(1).tolist()
        start = sum(per_key[:i])
        lengths = self._lengths[i * self._stride : (i + 1) * self._stride]
        return self._values[start : start + per_key[i]], lengths

    def __repr__(self) -> str:
        return f"JaggedFeatures(keys={self._keys}, stride={self._stride}, num_values={self._values.numel()})"


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
