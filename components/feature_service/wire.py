"""numpy arrays <-> `gemrec.v1.Array` (raw little-endian bytes, dtype, shape)."""

from __future__ import annotations

import numpy as np
from gemrec.proto.gemrec.v1 import arrays_pb2

DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ("int64", "int32", "float32", "float64", "bool", "uint8")}


def to_array(values: np.ndarray) -> arrays_pb2.Array:
    values = np.asarray(values)
    name = values.dtype.name
    if name not in DTYPES:
        raise TypeError(f"dtype {name} cannot travel as a gemrec.v1.Array (allowed: {', '.join(DTYPES)})")
    data = np.ascontiguousarray(values, dtype=DTYPES[name]).tobytes()
    return arrays_pb2.Array(data=data, dtype=name, shape=values.shape)


def from_array(msg: arrays_pb2.Array) -> np.ndarray:
    """A read-only view on the message bytes (no copy); ValueError on an inconsistent array."""
    if msg.dtype not in DTYPES:
        raise ValueError(f"unknown array dtype {msg.dtype!r}")
    dtype = DTYPES[msg.dtype]
    shape = tuple(msg.shape)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if any(d < 0 for d in shape) or count * dtype.itemsize != len(msg.data):
        raise ValueError(f"array of shape {shape} and dtype {msg.dtype} does not match {len(msg.data)} bytes")
    return np.frombuffer(msg.data, dtype=dtype).reshape(shape)


def ids_from_bytes(data: bytes, what: str = "ids") -> np.ndarray:
    """int64 little-endian ids from a raw bytes field; ValueError when the length is not a multiple of 8."""
    if len(data) % 8:
        raise ValueError(f"{what} must be int64 little-endian bytes: {len(data)} bytes is not a multiple of 8")
    return np.frombuffer(data, dtype="<i8")
