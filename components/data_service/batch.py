"""The unit of training data: one batch of examples with jagged user histories.

Shared contract between the dataset layer, the data service (which ships it over gRPC) and the trainer
(which adapts it to the model's input). Jagged sequences follow the project convention: `values` of
shape (total_tokens, ...) plus `offsets` of shape (B+1,), int64, and a host-side `max_seq_len`.

Keyed jagged features are torchrec `KeyedJaggedTensor`s where torchrec is installed, and
`gemrec.jagged.JaggedFeatures` (the same read API, also what the model takes) where it is not: the GPU machine
has no torchrec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from gemrec.jagged import JaggedFeatures

try:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
except ImportError:  # the GPU machine: batches carry JaggedFeatures
    KeyedJaggedTensor = None


def keyed_jagged(keys, values, lengths, stride=None, weights=None):
    """A torchrec KeyedJaggedTensor where torchrec is installed, else a JaggedFeatures."""
    if KeyedJaggedTensor is None:
        return JaggedFeatures(keys, values, lengths, stride, weights)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=stride, weights=weights)


_MOVABLE = (torch.Tensor, JaggedFeatures) + (() if KeyedJaggedTensor is None else (KeyedJaggedTensor,))


@dataclass
class Batch:
    # Per example (B rows).
    user_ids: torch.Tensor  # (B,) int64 user_id embedding id (the dense user index unless hashed)
    item_ids: torch.Tensor  # (B,) int64 item_id embedding id of the target item (dense index unless hashed)
    timestamps: torch.Tensor  # (B,) int64 unix seconds of the target event
    labels: torch.Tensor  # (B, num_labels) float32 in {0, 1}
    dense_features: torch.Tensor  # (B, num_dense) float32, may have 0 columns
    sparse_features: KeyedJaggedTensor | JaggedFeatures  # stride B: non-sequence features (user, target item, context)
    # Jagged history: the user's events strictly before `timestamps`, oldest first, most recent max_seq_len.
    seq_offsets: torch.Tensor  # (B+1,) int64
    seq_item_ids: torch.Tensor  # (T,) int64
    seq_timestamps: torch.Tensor  # (T,) int64
    seq_actions: torch.Tensor  # (T, num_actions) float32: labels/event columns of past events
    seq_item_features: KeyedJaggedTensor | JaggedFeatures | None  # stride T: item side features of history tokens
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

    def _map(self, fn) -> Batch:
        """A copy with `fn` applied to every tensor and keyed jagged feature."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, _MOVABLE):
                value = fn(value)
            moved[f.name] = value
        return replace(self, **moved)

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch, keyed jagged features' values, lengths and weights included, in a fixed order."""
        out: list[torch.Tensor] = []
        self._map_tensors(lambda t: out.append(t) or t)
        return out

    def _map_tensors(self, fn) -> Batch:
        """A copy with `fn` applied to every tensor, in `_tensors`' order."""

        def apply(value):
            if isinstance(value, torch.Tensor):
                return fn(value)
            values, lengths, weights = fn(value.values()), fn(value.lengths()), value.weights_or_none()
            weights = None if weights is None else fn(weights)
            if isinstance(value, JaggedFeatures):
                return JaggedFeatures(value.keys(), values, lengths, value.stride(), weights)
            return KeyedJaggedTensor(
                keys=value.keys(), values=values, lengths=lengths, stride=value.stride(), weights=weights
            )

        return self._map(apply)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._map(lambda value: value.to(device, non_blocking=non_blocking))

    def packed(self, pin: bool = False) -> PackedBatch:
        """This batch copied into one contiguous byte buffer (page-locked when `pin`): moving it to the GPU is then
        one asynchronous copy and one allocation, not one per tensor (`PackedBatch.to`)."""
        tensors = self._tensors()
        layout, size = [], 0
        for t in tensors:
            layout.append((size, t.dtype, tuple(t.shape)))
            size += -(-t.numel() * t.element_size() // _PACK_ALIGN) * _PACK_ALIGN
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        views = _views(buffer, layout)
        for view, t in zip(views, tensors, strict=True):
            view.copy_(t)
        it = iter(views)
        return PackedBatch(self._map_tensors(lambda _: next(it)), buffer, tuple(layout))


_PACK_ALIGN = 16  # bytes: every packed tensor starts aligned for any dtype and for vectorized loads


def _views(buffer: torch.Tensor, layout) -> list[torch.Tensor]:
    out = []
    for offset, dtype, shape in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(buffer[offset : offset + nbytes].view(dtype).view(shape))
    return out


@dataclass
class PackedBatch:
    """A batch whose tensors are views into one byte buffer (`Batch.packed`)."""

    batch: Batch  # views into `buffer`
    buffer: torch.Tensor  # uint8
    layout: tuple[tuple[int, torch.dtype, tuple[int, ...]], ...]  # per tensor of `Batch._tensors`: offset, dtype, shape

    def to(self, device: torch.device | str, non_blocking: bool = False) -> tuple[Batch, torch.Tensor]:
        """The batch on `device` through one copy of the buffer, and that copy (its storage holds every tensor:
        `record_stream` on it covers the batch)."""
        buffer = self.buffer.to(device, non_blocking=non_blocking)
        it = iter(_views(buffer, self.layout))
        return self.batch._map_tensors(lambda _: next(it)), buffer
