"""Where training batches come from, and the adapter from the data layer's `Batch` to `ModelInput`.

- `DatasetStream`: in-process from a dataset directory. Deterministic shuffled epochs: the global batch
  g is a slice of the permutation of epoch g // batches_per_epoch (seeded by (seed, epoch)); rank r takes
  its block of every global batch. The cursor is the number of global batches consumed, so a resumed
  run continues exactly where the checkpoint stopped.
- `RemoteStream`: batches from the gRPC data service (`--data-addr`); the cursor is the opaque
  `Batch.cursor` of the last batch consumed, handed back to the service on resume.
- `DeviceFeed`: the host->device pipeline between either stream and the step: each batch packed into one pinned
  buffer in a background thread, copied to the GPU (one copy) on a side stream ahead of use, and the time the step
  waited for each.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gemrec.components.data_service.batch import Batch, PackedBatch
from gemrec.model import ModelInput

TRAIN_SPLIT = "train"
EVAL_SPLIT = "eval"
VALID_SPLIT = "valid"  # the end of the train period, for validation and early stopping


def to_model_input(batch: Batch) -> ModelInput:
    return ModelInput(
        sparse_features=batch.sparse_features,
        dense_features=batch.dense_features,
        seq_offsets=batch.seq_offsets,
        seq_item_ids=batch.seq_item_ids,
        seq_timestamps=batch.seq_timestamps,
        seq_actions=batch.seq_actions,
        seq_item_features=batch.seq_item_features,
        max_seq_len=batch.max_seq_len,
        timestamps=batch.timestamps,
    )


def _put(q: queue.Queue, item, stop: threading.Event) -> None:
    """Put `item` into the bounded queue `q`, waiting for room until `stop` is set."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


class Prefetcher:
    """Runs `produce(i)` for i = start, start+1, ... in a background thread, `depth` ahead."""

    def __init__(self, produce: Callable[[int], object], start: int, depth: int):
        self.produce = produce
        self.next_index = start
        self.depth = depth
        if depth > 0:
            self.queue: queue.Queue = queue.Queue(maxsize=depth)
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._run, args=(start,), daemon=True)
            self.thread.start()

    def _run(self, index: int) -> None:
        while not self.stop.is_set():
            item: tuple[int, object, Exception | None]
            try:
                item = (index, self.produce(index), None)
            except Exception as err:  # noqa: BLE001 - handed to the consumer, re-raised there
                item = (index, None, err)
            _put(self.queue, item, self.stop)
            if item[2] is not None:
                return
            index += 1

    def get(self):
        if self.depth == 0:
            value = self.produce(self.next_index)
        else:
            index, value, err = self.queue.get()
            if err is not None:
                raise err
            assert index == self.next_index
        self.next_index += 1
        return value

    def close(self) -> None:
        if self.depth > 0:
            self.stop.set()
            self.thread.join(timeout=5)


class DatasetStream:
    """Training batches of one rank from a `Dataset`, resumable at a global batch index."""

    kind = "dataset"

    def __init__(
        self,
        dataset,
        batch_size: int,
        max_seq_len: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
        split: str = TRAIN_SPLIT,
    ):
        self.dataset = dataset
        self.split = split
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.prefetch = prefetch
        self.num_examples = dataset.num_examples(split)
        self.global_batch = batch_size * world_size
        self.batches_per_epoch = self.num_examples // self.global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"split {split!r} has {self.num_examples} examples, fewer than one global batch "
                f"({batch_size} x {world_size} ranks)"
            )
        self.position = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None
        self._prefetcher: Prefetcher | None = None

    def rows(self, global_batch: int) -> np.ndarray:
        epoch, index = divmod(global_batch, self.batches_per_epoch)
        if self._perm is None or epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._perm_epoch = epoch
        start = index * self.global_batch + self.rank * self.batch_size
        return self._perm[start : start + self.batch_size]

    def _collate(self, global_batch: int) -> Batch:
        return self.dataset.collate(self.split, self.rows(global_batch), self.max_seq_len)

    def __iter__(self) -> Iterator[Batch]:
        self._prefetcher = Prefetcher(self._collate, self.position, self.prefetch)
        try:
            while True:
                batch = self._prefetcher.get()
                self.position += 1
                yield batch
        finally:
            self._prefetcher.close()

    def state(self) -> dict:
        return {"kind": self.kind, "position": self.position}

    def load_state(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"checkpoint data cursor is for a {state.get('kind')!r} stream, not {self.kind!r}")
        self.position = int(state["position"])


def eval_row_chunks(num_examples: int, max_examples: int, batch_size: int, rank: int, world_size: int):
    """This rank's eval rows in batches; every rank gets the same number of batches."""
    if 0 < max_examples < num_examples:  # a fixed random subset, not the first users only
        n = max_examples
        rows = np.sort(np.random.default_rng(0).choice(num_examples, n, replace=False)).astype(np.int64)
    else:
        n = num_examples
        rows = np.arange(n, dtype=np.int64)
    num_batches = max(1, -(-n // (batch_size * world_size)))
    chunks = np.array_split(rows, num_batches * world_size)
    return [c for i, c in enumerate(chunks) if i % world_size == rank]


class RemoteStream:
    """Training batches of one rank from the gRPC data service, epoch after epoch, resumable by cursor.

    As `DatasetStream`, an epoch is its full global batches: the short last one is left out (the same on every
    rank), so every step has the recipe's batch size. `client_options` go to each `DataClient` (stall and
    wait timeouts); `last_info` is the stream bookkeeping of the last batch (`build_cpu_s`, ...)."""

    kind = "remote"

    def __init__(
        self,
        address: str,
        batch_size: int,
        max_seq_len: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        token: str | None = None,
        client_options: dict | None = None,
    ):
        from gemrec.components.data_service.client import DataClient

        self.address = address
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.token = token
        self.client_options = dict(client_options or {})
        self._client_cls = DataClient
        info = self._client(TRAIN_SPLIT, epoch=0, shuffle=True).info()
        self.manifest = info["manifest"]
        sizes = info["split_sizes"]
        for split in (TRAIN_SPLIT, EVAL_SPLIT):
            if split not in sizes:
                raise ValueError(f"the data service at {address} has no {split!r} split (has {sorted(sizes)})")
        self.batches_per_epoch = sizes[TRAIN_SPLIT] // (batch_size * world_size)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"split {TRAIN_SPLIT!r} has {sizes[TRAIN_SPLIT]} examples, fewer than one global batch "
                f"({batch_size} x {world_size} ranks)"
            )
        self.split_sizes = dict(sizes)
        self.epoch = 0
        self.cursor = b""
        self.last_info = None

    def _client(self, split: str, epoch: int, shuffle: bool, cursor: bytes = b"", batch_size: int | None = None):
        return self._client_cls(
            self.address,
            split=split,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=batch_size or self.batch_size,
            max_seq_len=self.max_seq_len,
            epoch=epoch,
            seed=self.seed,
            shuffle=shuffle,
            cursor=cursor,
            token=self.token,
            **self.client_options,
        )

    def __iter__(self) -> Iterator[Batch]:
        while True:
            client = self._client(TRAIN_SPLIT, self.epoch, shuffle=True, cursor=self.cursor)
            try:
                for batch in client:
                    if client.last_info.step >= self.batches_per_epoch:  # the short last global batch
                        break
                    self.cursor, self.last_info = client.cursor, client.last_info
                    yield batch
            finally:
                client.close()
            self.epoch += 1
            self.cursor = b""

    def split_batches(self, split: str, batch_size: int, max_examples: int) -> Iterator[Batch]:
        """This rank's share of `split` (eval, valid) in order (every rank gets the same number of batches); the
        first `max_examples` of it when > 0."""
        limit = -(-max_examples // self.world_size) if max_examples > 0 else None
        seen = 0
        for batch in self._client(split, epoch=0, shuffle=False, batch_size=batch_size):
            yield batch
            seen += batch.batch_size
            if limit is not None and seen >= limit:
                return

    def state(self) -> dict:
        return {"kind": self.kind, "epoch": self.epoch, "cursor": bytes(self.cursor)}

    def load_state(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"checkpoint data cursor is for a {state.get('kind')!r} stream, not {self.kind!r}")
        self.epoch = int(state["epoch"])
        self.cursor = bytes(state["cursor"])


@dataclass
class TrainingInput:
    """One batch as the train loop takes it (`parallel.pipeline.training_inputs`)."""

    batch: Batch  # on the host
    host: ModelInput  # on the host: FLOP counts read its lengths without a device sync
    device: ModelInput  # on the device
    labels: torch.Tensor  # on the device
    state: dict  # the stream's resume state right after this batch (what a checkpoint after it holds)
    build_cpu_s: float = 0.0  # the data service's CPU seconds for this batch (0 when read in process)
    in_flight: int = 0  # batches read ahead (pinned or copying) when this one was handed out


class DeviceFeed:
    """`(host_batch, device_batch, state)` for each `(batch, state)` of `source`, in order, each once.

    A background thread reads `source` and packs each batch into one page-locked buffer, up to `2 * depth` batches
    ahead. On CUDA the consumer issues the host->device copies (one per batch) of up to `depth` batches on a side
    stream before it hands out the oldest, so each copy overlaps the steps queued before it; the compute stream
    waits for the copy on the device, never the host. On the CPU, batches pass through (the device batch is the
    host batch).
    `waits` holds the seconds each `next` blocked for a batch (what the step waited for data); `in_flight`
    the batches read ahead (pinned or copying) when the last one was handed out.
    """

    def __init__(self, source: Iterable[tuple[Batch, object]], device: torch.device, depth: int = 2):
        if depth < 1:
            raise ValueError(f"DeviceFeed: depth must be >= 1, got {depth}")
        self.device = torch.device(device)
        self.depth = depth
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.waits: list[float] = []
        self.in_flight = 0
        # Read-ahead (packed, or copying) is bounded by `2 * depth` batches. A handed-out batch frees its room at the
        # end of `next`, so the reader wakes as the step starts, not while `next` still needs the GIL.
        self._room = threading.Semaphore(2 * depth)
        self._pinned: queue.Queue = queue.Queue()
        self._copies: deque = deque()  # (host, device, device buffer, state, copied event), oldest first
        self._done = False
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(iter(source),), name="device-feed", daemon=True)
        self._thread.start()

    def _read(self, source: Iterator) -> None:
        """Background: read and pack (pinned); the end of `source` is None, its error the exception itself."""
        while not self._stop.is_set():
            if not self._room.acquire(timeout=0.1):
                continue
            item: tuple[Any, Any] | Exception | None
            try:
                batch, state = next(source)
                item = (batch.packed(pin=True) if self.cuda else batch, state)
            except StopIteration:
                item = None
            except Exception as err:  # noqa: BLE001 - handed to the consumer, re-raised there
                item = err
            self._pinned.put(item)
            if not isinstance(item, tuple):
                return

    def _take(self, block: bool):
        """The next pinned item, or None when none is ready (`block=False`) or `source` ended or failed."""
        if self._done:
            return None
        try:
            item = self._pinned.get(block=block)
        except queue.Empty:
            return None
        if not isinstance(item, tuple):  # the end, or the source's error (raised after the batches before it)
            self._done, self._error = True, item
            return None
        return item

    def _start_copy(self, host: Batch | PackedBatch, state) -> None:
        if not isinstance(host, PackedBatch):
            self._copies.append((host, host, None, state, None))
            return
        with torch.cuda.stream(self.copy_stream):
            on_device, buffer = host.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        self._copies.append((host.batch, on_device, buffer, state, copied))

    def __iter__(self) -> DeviceFeed:
        return self

    def __next__(self) -> tuple[Batch, Batch, object]:
        start = time.perf_counter()
        if not self._copies:
            item = self._take(block=True)
            if item is None:
                if self._error is not None:
                    raise self._error
                raise StopIteration
            self._start_copy(*item)
        waited = time.perf_counter() - start
        while len(self._copies) < self.depth:  # queue the copies of what is already pinned
            item = self._take(block=False)
            if item is None:
                break
            self._start_copy(*item)
        host, on_device, buffer, state, copied = self._copies.popleft()
        if copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copied)
            buffer.record_stream(compute)  # the batch's memory is not reused before the step is done with it
        self.waits.append(waited)
        self.in_flight = len(self._copies) + self._pinned.qsize()
        self._room.release()
        return host, on_device, state

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
