"""`Batch` <-> `gemrec.v1.BatchMessage`. Decoding wraps the message's bytes without copying them.

Decoded tensors are views on immutable protobuf bytes: treat them as read-only (`.to(device)`,
`.clone()` or any out-of-place op is fine; in-place writes are not).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gemrec.components.feature_service.wire import DTYPES, to_array
from gemrec.proto.gemrec.v1 import arrays_pb2, data_pb2

from .batch import Batch

_TORCH_DTYPES = {
    "int64": torch.int64,
    "int32": torch.int32,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
    "uint8": torch.uint8,
}


def _tensor_array(tensor: torch.Tensor) -> arrays_pb2.Array:
    return to_array(tensor.detach().cpu().numpy())


def _kjt_message(kjt) -> arrays_pb2.KeyedJagged | None:
    if kjt is None:
        return None
    weights = kjt.weights_or_none()
    return arrays_pb2.KeyedJagged(
        keys=list(kjt.keys()),
        values=_tensor_array(kjt.values()),
        lengths=_tensor_array(kjt.lengths()),
        stride=kjt.stride(),
        weights=_tensor_array(weights) if weights is not None else None,
    )


def encode_batch(batch: Batch, **stream_fields) -> data_pb2.BatchMessage:
    """The wire message of `batch`; `stream_fields` fill the bookkeeping fields (cursor, step, ...)."""
    return data_pb2.BatchMessage(
        user_ids=_tensor_array(batch.user_ids),
        item_ids=_tensor_array(batch.item_ids),
        timestamps=_tensor_array(batch.timestamps),
        labels=_tensor_array(batch.labels),
        dense_features=_tensor_array(batch.dense_features),
        sparse_features=_kjt_message(batch.sparse_features),
        seq_offsets=_tensor_array(batch.seq_offsets),
        seq_item_ids=_tensor_array(batch.seq_item_ids),
        seq_timestamps=_tensor_array(batch.seq_timestamps),
        seq_actions=_tensor_array(batch.seq_actions),
        seq_item_features=_kjt_message(batch.seq_item_features),
        max_seq_len=batch.max_seq_len,
        label_names=list(batch.label_names),
        **stream_fields,
    )


def _tensor(msg: arrays_pb2.Array) -> torch.Tensor:
    if msg.dtype not in DTYPES:
        raise ValueError(f"unknown array dtype {msg.dtype!r}")
    shape = tuple(msg.shape)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * DTYPES[msg.dtype].itemsize != len(msg.data):
        raise ValueError(f"array of shape {shape} and dtype {msg.dtype} does not match {len(msg.data)} bytes")
    if count == 0:
        return torch.empty(shape, dtype=_TORCH_DTYPES[msg.dtype])
    with warnings.catch_warnings():  # protobuf bytes are immutable; the tensor is a read-only view
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(msg.data, dtype=_TORCH_DTYPES[msg.dtype]).reshape(shape)


def _kjt(msg: arrays_pb2.KeyedJagged):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=list(msg.keys),
        values=_tensor(msg.values),
        lengths=_tensor(msg.lengths),
        stride=int(msg.stride),
        weights=_tensor(msg.weights) if msg.HasField("weights") else None,
    )


def decode_batch(msg: data_pb2.BatchMessage) -> Batch:
    return Batch(
        user_ids=_tensor(msg.user_ids),
        item_ids=_tensor(msg.item_ids),
        timestamps=_tensor(msg.timestamps),
        labels=_tensor(msg.labels),
        dense_features=_tensor(msg.dense_features),
        sparse_features=_kjt(msg.sparse_features),
        seq_offsets=_tensor(msg.seq_offsets),
        seq_item_ids=_tensor(msg.seq_item_ids),
        seq_timestamps=_tensor(msg.seq_timestamps),
        seq_actions=_tensor(msg.seq_actions),
        seq_item_features=_kjt(msg.seq_item_features) if msg.HasField("seq_item_features") else None,
        max_seq_len=int(msg.max_seq_len),
        label_names=tuple(msg.label_names),
        cursor=msg.cursor,
    )
