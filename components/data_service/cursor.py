"""Stream cursors: the resume position of one rank's stream, as opaque bytes.

A cursor names the stream it belongs to (dataset, split, rank, world size, batch size, max_seq_len, epoch,
seed, shuffle, balancing weight: everything the epoch's plan depends on) and the next global batch.
Layout: magic b"GRC", version, fixed little-endian fields, the split name, then an 8-byte BLAKE2b digest of
all of it, so a truncated or edited cursor is rejected rather than silently resuming somewhere else.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import astuple, dataclass

MAGIC = b"GRC"
VERSION = 1
_FIELDS = struct.Struct("<B8siiiiqq?dq")  # version, dataset, rank, world, batch, max_len, epoch, seed, shuffle, w, next
_DIGEST = 8


class CursorError(ValueError):
    """A cursor that is malformed or belongs to another stream."""


def dataset_tag(dataset_checksum: str) -> bytes:
    return hashlib.blake2b(dataset_checksum.encode(), digest_size=8).digest()


@dataclass(frozen=True)
class StreamKey:
    """Everything that fixes an epoch's per-rank batch sequence."""

    dataset: bytes  # dataset_tag(manifest checksum)
    split: str
    rank: int
    world_size: int
    batch_size: int
    max_seq_len: int
    epoch: int
    seed: int
    shuffle: bool
    linear_weight: float


@dataclass(frozen=True)
class Cursor:
    key: StreamKey
    next_step: int  # the global batch to send next

    def encode(self) -> bytes:
        k = self.key
        body = (
            MAGIC
            + _FIELDS.pack(
                VERSION,
                k.dataset,
                k.rank,
                k.world_size,
                k.batch_size,
                k.max_seq_len,
                k.epoch,
                k.seed,
                k.shuffle,
                k.linear_weight,
                self.next_step,
            )
            + k.split.encode()
        )
        return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()

    @classmethod
    def decode(cls, data: bytes) -> Cursor:
        if len(data) < len(MAGIC) + _FIELDS.size + _DIGEST or not data.startswith(MAGIC):
            raise CursorError(f"malformed cursor ({len(data)} bytes): not a gemrec stream cursor")
        body, digest = data[:-_DIGEST], data[-_DIGEST:]
        if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
            raise CursorError("malformed cursor: checksum mismatch (truncated or edited)")
        version, dataset, rank, world, batch, max_len, epoch, seed, shuffle, weight, next_step = _FIELDS.unpack(
            body[len(MAGIC) : len(MAGIC) + _FIELDS.size]
        )
        if version != VERSION:
            raise CursorError(f"cursor version {version} is not supported (this server reads {VERSION})")
        try:
            split = body[len(MAGIC) + _FIELDS.size :].decode()
        except UnicodeDecodeError:
            raise CursorError("malformed cursor: split name is not UTF-8") from None
        key = StreamKey(dataset, split, rank, world, batch, max_len, epoch, seed, shuffle, weight)
        return cls(key, next_step)

    def check_matches(self, expected: StreamKey, num_steps: int) -> None:
        """Raise CursorError naming the first field where this cursor's stream differs from `expected`."""
        if self.key != expected:
            names = StreamKey.__dataclass_fields__
            for name, mine, theirs in zip(names, astuple(self.key), astuple(expected)):
                if mine != theirs:
                    if name == "dataset":
                        raise CursorError("foreign cursor: issued for another dataset")
                    raise CursorError(f"foreign cursor: issued for {name}={mine!r}, the request has {theirs!r}")
        if not 0 <= self.next_step <= num_steps:
            raise CursorError(f"cursor position {self.next_step} is outside the epoch's {num_steps} batches")
