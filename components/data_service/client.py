"""Trainer-side client of `gemrec.v1.DataLoaderService`: iterate `Batch`es of one rank's stream.

    client = DataClient("127.0.0.1:50052", split="train", rank=rank, world_size=world, batch_size=256,
                        max_seq_len=1024, epoch=epoch, seed=0)
    for batch in client:          # gemrec.components.data_service.batch.Batch, tensors on the CPU
        ...
        save(client.cursor)       # resume later with DataClient(..., cursor=saved)

A background thread reads and decodes `prefetch` batches ahead. When the server goes away (UNAVAILABLE),
a stream deadline passes, the server cancels a stream whose reading stalled past its idle limit, or an open
stream delivers nothing for `stall_s` (a stopped or wedged server), it reconnects with exponential backoff
and continues from the cursor of the last batch it received, so no batch is lost or repeated. While the
caller waits for a batch it logs a warning every `warn_every_s`; after `wait_timeout_s` without one it
raises `DataServiceTimeout`: never a silent hang.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections.abc import Iterator

import grpc
from gemrec.components.common.grpc_channel import call_metadata, open_channel
from gemrec.proto.gemrec.v1 import data_pb2

from .batch import Batch
from .codec import BatchInfo, decode_batch

log = logging.getLogger("gemrec.data_client")
# CANCELLED by the server: it dropped a stream whose reader stalled past its idle limit.
RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
_STREAM = "/gemrec.v1.DataLoaderService/StreamBatches"
_INFO = "/gemrec.v1.DataLoaderService/GetDatasetInfo"


class DataServiceTimeout(TimeoutError):
    """No batch arrived within the client's `wait_timeout_s` (the service is down, stopped or wedged)."""


class DataClient:
    def __init__(
        self,
        address: str,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        batch_size: int = 256,
        max_seq_len: int = 256,
        epoch: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        cursor: bytes = b"",
        *,
        prefetch: int = 4,
        stream_deadline_s: float | None = 3600.0,
        timeout_s: float = 30.0,
        max_retries: int | None = None,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        stall_s: float = 30.0,
        wait_timeout_s: float = 600.0,
        warn_every_s: float = 10.0,
        token: str | None = None,
        tls_ca: str | None = None,
        max_message_mb: int = 256,
    ):
        """`max_retries`: consecutive failed reconnects before the stream's error is raised (None: keep trying
        until `wait_timeout_s` has passed without a batch)."""
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        for name, value in (("stall_s", stall_s), ("wait_timeout_s", wait_timeout_s), ("warn_every_s", warn_every_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.address = address
        self.request = data_pb2.StreamBatchesRequest(
            split=split,
            rank=rank,
            world_size=world_size,
            batch_size=batch_size,
            max_seq_len=max_seq_len,
            epoch=epoch,
            seed=seed,
            shuffle=shuffle,
            cursor=cursor,
        )
        self.cursor = cursor  # of the last batch handed to the caller: save it to resume later
        self.prefetch = prefetch
        self.stream_deadline_s = stream_deadline_s
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stall_s = stall_s
        self.wait_timeout_s = wait_timeout_s
        self.warn_every_s = warn_every_s
        self.reconnects = 0
        self.last_info: BatchInfo | None = None  # stream bookkeeping of the last batch (step, balance, ...)
        self._metadata = call_metadata(token)
        self._tls_ca = tls_ca
        self._max_message_mb = max_message_mb
        self._stop = threading.Event()
        self._call = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._last_message = time.monotonic()  # when the open stream last delivered (or opened)
        self._stalled = False  # the open stream was cancelled for delivering nothing for stall_s

    def _channel(self) -> grpc.Channel:
        return open_channel(self.address, self._tls_ca, self._max_message_mb)

    def info(self) -> dict:
        """GetDatasetInfo: {"name", "dataset_checksum", "split_sizes", "manifest"}."""
        with self._channel() as channel:
            call = channel.unary_unary(
                _INFO,
                request_serializer=data_pb2.GetDatasetInfoRequest.SerializeToString,
                response_deserializer=data_pb2.DatasetInfo.FromString,
            )
            reply = call(data_pb2.GetDatasetInfoRequest(), timeout=self.timeout_s, metadata=self._metadata)
        return {
            "name": reply.name,
            "dataset_checksum": reply.dataset_checksum,
            "split_sizes": dict(reply.split_sizes),
            "manifest": json.loads(reply.manifest_json),
        }

    def steps_per_epoch(self) -> int:
        """Batches each rank receives per epoch (every rank gets the same number; the last may be short)."""
        examples = self.info()["split_sizes"].get(self.request.split)
        if examples is None:
            raise KeyError(f"the data service has no split {self.request.split!r}")
        return -(-examples // (self.request.batch_size * self.request.world_size))

    def _put(self, q: queue.Queue, item) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _reader(self, q: queue.Queue) -> None:
        """Background: stream, decode, enqueue; reconnect and resume after UNAVAILABLE, DEADLINE_EXCEEDED or a
        stall."""
        cursor, failures = self.request.cursor, 0
        while not self._stop.is_set():
            request = data_pb2.StreamBatchesRequest()
            request.CopyFrom(self.request)
            request.cursor = cursor
            channel = self._channel()
            try:
                stream = channel.unary_stream(
                    _STREAM,
                    request_serializer=data_pb2.StreamBatchesRequest.SerializeToString,
                    response_deserializer=None,  # raw bytes: decode_batch wraps them without copying
                )
                self._last_message, self._stalled = time.monotonic(), False
                self._call = stream(request, timeout=self.stream_deadline_s, metadata=self._metadata)
                for data in self._call:
                    self._last_message = time.monotonic()
                    batch, info = decode_batch(data)
                    cursor, failures = info.cursor, 0
                    if not self._put(q, (batch, info)):
                        return
                self._put(q, None)  # end of epoch
                return
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                stalled = self._stalled and err.code() == grpc.StatusCode.CANCELLED
                if not (stalled or err.code() in RESUMABLE) or (
                    self.max_retries is not None and failures >= self.max_retries
                ):
                    self._put(q, err)
                    return
                failures += 1
                self.reconnects += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1)) * (0.5 + random.random())
                why = f"no batch for {self.stall_s:.0f} s" if stalled else f"{err.code().name} ({err.details()})"
                log.warning("data stream from %s: %s; reconnect %d in %.2f s", self.address, why, failures, delay)
                self._stop.wait(delay)
            except Exception as err:  # a message that does not decode: surface it, do not hang
                self._put(q, err)
                return
            finally:
                channel.close()

    def _cancel_if_stalled(self) -> None:
        """Cancel the open stream when it has delivered nothing for `stall_s`; the reader reconnects."""
        call = self._call
        if call is not None and not self._stalled and time.monotonic() - self._last_message > self.stall_s:
            self._stalled = True
            call.cancel()

    def _next(self, q: queue.Queue):
        """The reader's next item; warns while it waits, raises DataServiceTimeout after `wait_timeout_s`."""
        start = warned = time.monotonic()
        poll = min(self.warn_every_s, self.stall_s)
        while True:
            try:
                return q.get(timeout=max(0.0, min(poll, start + self.wait_timeout_s - time.monotonic())))
            except queue.Empty:
                pass
            now = time.monotonic()
            if now - start >= self.wait_timeout_s:
                raise DataServiceTimeout(
                    f"no batch from the data service at {self.address} for {now - start:.0f} s (wait_timeout_s="
                    f"{self.wait_timeout_s:g}, {self.reconnects} reconnects); split {self.request.split!r}, rank "
                    f"{self.request.rank}: restart the service and resume from the last checkpoint"
                )
            self._cancel_if_stalled()
            if now - warned >= self.warn_every_s:
                warned = now
                log.warning(
                    "waiting for the data service at %s: no batch for %.0f s (%d reconnects; giving up after %.0f s)",
                    self.address,
                    now - start,
                    self.reconnects,
                    self.wait_timeout_s,
                )

    @property
    def buffered(self) -> int:
        """Batches received and decoded, not yet handed to the caller."""
        return self._queue.qsize() if self._queue is not None else 0

    def __iter__(self) -> Iterator[Batch]:
        if self._thread is not None:
            raise RuntimeError("a DataClient iterates once; make a new one (pass cursor=client.cursor to resume)")
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        self._queue = q
        self._thread = threading.Thread(target=self._reader, args=(q,), name="data-client", daemon=True)
        self._thread.start()
        try:
            while True:
                item = self._next(q)
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                batch, info = item
                self.cursor, self.last_info = info.cursor, info
                yield batch
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> DataClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
