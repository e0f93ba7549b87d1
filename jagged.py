"""`JaggedFeatures`: keyed jagged ids with the read API of torchrec's `KeyedJaggedTensor`, without torchrec.

The one torchrec-free form of keyed jagged features: the model takes it as input, and the data layer's `Batch`
carries it where torchrec is not installed (the GPU machine), so the dataset reader, the data service, its client
and the trainer's GPU path run there. Like `gemrec.config`, this module imports nothing from gemrec, so every
layer can use it. Layout: per key, `lengths` has `stride` entries; `values` holds all keys' values key after key.
"""

from __future__ import annotations

from typing import Any

import torch


class JaggedFeatures:
    """Keyed jagged ids with the read API of torchrec's `KeyedJaggedTensor` (no torchrec needed).

    `values` holds every key's values, key after key; `lengths` has `len(keys) * stride` entries; `weights`, when
    given, one per value.
    """

    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        stride: int | None = None,
        weights: torch.Tensor | None = None,
    ):
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
        self._weights = weights

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
        return cls(list(kjt.keys()), kjt.values(), kjt.lengths(), kjt.stride(), kjt.weights_or_none())

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

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def _map(self, fn) -> JaggedFeatures:
        weights = None if self._weights is None else fn(self._weights)
        return JaggedFeatures(self._keys, fn(self._values), fn(self._lengths), self._stride, weights)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedFeatures:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

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
