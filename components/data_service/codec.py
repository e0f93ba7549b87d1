"""`Batch` <-> serialized `gemrec.v1.BatchMessage`, reading and writing the protobuf wire format directly.

Encoding copies each array once (into the message bytes); decoding copies nothing: every tensor is a
`torch.frombuffer` view on the received bytes. Treat decoded tensors as read-only (`.to(device)`, `.clone()`
and out-of-place ops are fine; in-place writes are not). test_service_codec checks both directions against
the generated protobuf classes.
"""

from __future__ import annotations

import struct
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gemrec.components.feature_service.wire import DTYPES

from .batch import Batch, keyed_jagged

_TORCH_DTYPES = {
    "int64": torch.int64,
    "int32": torch.int32,
    "float32": torch.float32,
    "float64": torch.float64,
    "bool": torch.bool,
    "uint8": torch.uint8,
}


_LEN, _I64, _VARINT = 2, 1, 0


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 take ten bytes, as protobuf writes them
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _message(field: int, parts: list) -> list:
    """A length-delimited field around already-encoded parts."""
    return [_key(field, _LEN), _varint(sum(len(p) for p in parts)), *parts]


def _array_parts(tensor: torch.Tensor) -> list:
    values = tensor.detach().cpu().numpy()
    name = values.dtype.name
    if name not in DTYPES:
        raise TypeError(f"dtype {name} cannot travel as a gemrec.v1.Array")
    values = np.ascontiguousarray(values, dtype=DTYPES[name])
    data = memoryview(values).cast("B") if values.size else b""
    shape = b"".join(_varint(d) for d in values.shape)
    parts = [*_message(1, [data]), *_message(2, [name.encode()])]
    return parts + _message(3, [shape]) if shape else parts


def _kjt_parts(kjt) -> list:
    parts = []
    for key in kjt.keys():
        parts += _message(1, [key.encode()])
    parts += _message(2, _array_parts(kjt.values())) + _message(3, _array_parts(kjt.lengths()))
    stride = kjt.stride()
    if stride:
        parts += [_key(4, _VARINT), _varint(stride)]
    weights = kjt.weights_or_none()
    return parts + _message(5, _array_parts(weights)) if weights is not None else parts


def serialize_batch(
    batch: Batch,
    *,
    cursor: bytes = b"",
    epoch: int = 0,
    step: int = 0,
    num_steps: int = 0,
    cost_imbalance: float = 0.0,
    tokens_imbalance: float = 0.0,
    sq_tokens_imbalance: float = 0.0,
    naive_cost_imbalance: float = 0.0,
    cpu_start: float | None = None,
) -> bytes:
    """The serialized `gemrec.v1.BatchMessage` of `batch` plus the stream bookkeeping fields. `cpu_start`: the
    building thread's `time.thread_time()` when it began the batch; `build_cpu_s` then holds the CPU seconds
    from there until the message is encoded (the final copy into one bytes object excepted)."""
    parts = []
    for field, tensor in (
        (1, batch.user_ids),
        (2, batch.item_ids),
        (3, batch.timestamps),
        (4, batch.labels),
        (5, batch.dense_features),
    ):
        parts += _message(field, _array_parts(tensor))
    parts += _message(6, _kjt_parts(batch.sparse_features))
    for field, tensor in (
        (7, batch.seq_offsets),
        (8, batch.seq_item_ids),
        (9, batch.seq_timestamps),
        (10, batch.seq_actions),
    ):
        parts += _message(field, _array_parts(tensor))
    if batch.seq_item_features is not None:
        parts += _message(11, _kjt_parts(batch.seq_item_features))
    for field, value in ((12, batch.max_seq_len), (15, epoch), (16, step), (17, num_steps)):
        if value:
            parts += [_key(field, _VARINT), _varint(int(value))]
    for name in batch.label_names:
        parts += _message(13, [name.encode()])
    if cursor:
        parts += _message(14, [cursor])
    for field, value in (
        (18, cost_imbalance),
        (19, tokens_imbalance),
        (20, sq_tokens_imbalance),
        (21, naive_cost_imbalance),
    ):
        if value:
            parts += [_key(field, _I64), struct.pack("<d", value)]
    if cpu_start is not None:
        parts += [_key(22, _I64), struct.pack("<d", time.thread_time() - cpu_start)]
    return b"".join(parts)


@dataclass
class BatchInfo:
    """The stream bookkeeping of one BatchMessage."""

    cursor: bytes = b""
    epoch: int = 0
    step: int = 0
    num_steps: int = 0
    cost_imbalance: float = 0.0
    tokens_imbalance: float = 0.0
    sq_tokens_imbalance: float = 0.0
    naive_cost_imbalance: float = 0.0
    build_cpu_s: float = 0.0  # the data service's CPU seconds for this batch (0: not measured)
    nbytes: int = 0  # serialized size


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, pos


def _fields(buf: memoryview):
    """(field number, value) pairs: int for varints, memoryview slices (no copy) for everything else."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        wire_type = key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire_type in (_I64, 5):
            size = 8 if wire_type == _I64 else 4
            value, pos = buf[pos : pos + size], pos + size
        elif wire_type == _LEN:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
        if pos > len(buf):
            raise ValueError("truncated message")
        yield key >> 3, value


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _tensor(buf: memoryview) -> torch.Tensor:
    data, dtype, shape = memoryview(b""), "", []
    for field, value in _fields(buf):
        if field == 1:
            data = value
        elif field == 2:
            dtype = bytes(value).decode()
        elif field == 3:
            if isinstance(value, int):  # unpacked
                shape.append(value)
            else:
                pos = 0
                while pos < len(value):
                    dim, pos = _read_varint(value, pos)
                    shape.append(dim)
    if dtype not in DTYPES:
        raise ValueError(f"unknown array dtype {dtype!r}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * DTYPES[dtype].itemsize != len(data):
        raise ValueError(f"array of shape {tuple(shape)} and dtype {dtype} does not match {len(data)} bytes")
    if count == 0:
        return torch.empty(shape, dtype=_TORCH_DTYPES[dtype])
    with warnings.catch_warnings():  # the received bytes are immutable; the tensor is a read-only view
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=_TORCH_DTYPES[dtype]).reshape(shape)


def _kjt(buf: memoryview):
    keys, parts, stride = [], {}, 0
    for field, value in _fields(buf):
        if field == 1:
            keys.append(bytes(value).decode())
        elif field in (2, 3, 5):
            parts[field] = _tensor(value)
        elif field == 4:
            stride = _int64(value)
    empty = torch.zeros(0, dtype=torch.int64)
    return keyed_jagged(keys, parts.get(2, empty), parts.get(3, empty), stride or None, parts.get(5))


_BATCH_TENSORS = {
    1: "user_ids",
    2: "item_ids",
    3: "timestamps",
    4: "labels",
    5: "dense_features",
    7: "seq_offsets",
    8: "seq_item_ids",
    9: "seq_timestamps",
    10: "seq_actions",
}
_INFO_INTS = {15: "epoch", 16: "step", 17: "num_steps"}
_INFO_DOUBLES = {
    18: "cost_imbalance",
    19: "tokens_imbalance",
    20: "sq_tokens_imbalance",
    21: "naive_cost_imbalance",
    22: "build_cpu_s",
}


def decode_batch(data: bytes) -> tuple[Batch, BatchInfo]:
    """A serialized BatchMessage as (Batch, BatchInfo). Tensors are views on `data` (no copy); raises
    ValueError on a malformed message."""
    tensors, kjts, label_names = {}, {}, []
    info, max_seq_len = BatchInfo(nbytes=len(data)), 0
    for field, value in _fields(memoryview(data)):
        if field in _BATCH_TENSORS:
            tensors[_BATCH_TENSORS[field]] = _tensor(value)
        elif field in (6, 11):
            kjts[field] = _kjt(value)
        elif field == 12:
            max_seq_len = _int64(value)
        elif field == 13:
            label_names.append(bytes(value).decode())
        elif field == 14:
            info.cursor = bytes(value)
        elif field in _INFO_INTS:
            setattr(info, _INFO_INTS[field], _int64(value))
        elif field in _INFO_DOUBLES:
            setattr(info, _INFO_DOUBLES[field], struct.unpack("<d", value)[0])
    missing = sorted(set(_BATCH_TENSORS.values()) - set(tensors)) + ([] if 6 in kjts else ["sparse_features"])
    if missing:
        raise ValueError(f"batch message without {', '.join(missing)}")
    batch = Batch(
        **tensors,
        sparse_features=kjts[6],
        seq_item_features=kjts.get(11),
        max_seq_len=max_seq_len,
        label_names=tuple(label_names),
        cursor=info.cursor,
    )
    return batch, info
