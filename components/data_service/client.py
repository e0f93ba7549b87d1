"""Trainer-side client of `gemrec.v1.DataLoaderService`: iterate `Batch`es of one rank's stream.

    client = DataClient("127.0.0.1:50052", split="train", rank=rank, world_size=world, batch_size=256,
                        max_seq_len=1024, epoch=epoch, seed=0)
    for batch in client:          # gemrec.components.data_service.batch.Batch, tensors on the CPU
        ...
        save(client.cursor)       # resume later with DataClient(..., cursor=saved)

A background thread reads and decodes `prefetch` batches ahead. When the server goes away (UNAVAILABLE)
or a stream deadline passes, it reconnects with exponential backoff and continues from the cursor of the
last batch it received, so no batch is lost or repeated.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
from collections.abc import Iterator

import grpc
from gemrec.components.common.grpc_channel import call_metadata, open_channel
from gemrec.proto.gemrec.v1 import data_pb2

from .batch import Batch
from .codec import BatchInfo, decode_batch

log = logging.getLogger("gemrec.data_client")
RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_STREAM = "/gemrec.v1.DataLoaderService/StreamBatches"
_INFO = "/gemrec.v1.DataLoaderService/GetDatasetInfo"


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
        max_retries: int = 8,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        token: str | None = None,
        tls_ca: str | None = None,
        max_message_mb: int = 256,
    ):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
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
        self.reconnects = 0
        self.last_info: BatchInfo | None = None  # stream bookkeeping of the last batch (step, balance, ...)
        self._metadata = call_metadata(token)
        self._tls_ca = tls_ca
        self._max_message_mb = max_message_mb
        self._stop = threading.Event()
        self._call = None
        self._thread: threading.Thread | None = None

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
        """Background: stream, decode, enqueue; reconnect and resume on UNAVAILABLE/DEADLINE_EXCEEDED."""
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
                self._call = stream(request, timeout=self.stream_deadline_s, metadata=self._metadata)
                for data in self._call:
                    batch, info = decode_batch(data)
                    cursor, failures = info.cursor, 0
                    if not self._put(q, (batch, info)):
                        return
                self._put(q, None)  # end of epoch
                return
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                if err.code() not in RESUMABLE or failures >= self.max_retries:
                    self._put(q, err)
                    return
                failures += 1
                self.reconnects += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1)) * (0.5 + random.random())
                log.warning("stream %s (%s); reconnect %d in %.2f s", err.code().name, err.details(), failures, delay)
                self._stop.wait(delay)
            except Exception as err:  # a message that does not decode: surface it, do not hang
                self._put(q, err)
                return
            finally:
                channel.close()

    def __iter__(self) -> Iterator[Batch]:
        if self._thread is not None:
            raise RuntimeError("a DataClient iterates once; make a new one (pass cursor=client.cursor to resume)")
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._reader, args=(q,), name="data-client", daemon=True)
        self._thread.start()
        try:
            while True:
                item = q.get()
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
