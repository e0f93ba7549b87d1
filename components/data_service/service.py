"""`gemrec.v1.DataLoaderService`: the plain streaming core and the thin gRPC servicer around it.

An epoch of a split is a permutation of its examples (seeded by (seed, epoch), or the identity without
shuffle), cut into global batches of `world_size * batch_size`. Each global batch is partitioned across
ranks by `balance.partition`, so every example reaches exactly one rank once per epoch and ranks do
similar attention work. Every rank computes the same plan independently; its stream is the sequence
of its parts. A cursor records the next global batch, so a stream resumes exactly.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np
from gemrec.components.common.grpc_server import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    abort_on,
)
from gemrec.proto.gemrec.v1 import data_pb2

from .balance import DEFAULT_LINEAR_WEIGHT, partition
from .codec import serialize_batch
from .cursor import Cursor, CursorError, StreamKey, dataset_tag

SERVICE_NAME = data_pb2.DESCRIPTOR.services_by_name["DataLoaderService"].full_name


@dataclass
class StreamRequest:
    split: str = "train"
    rank: int = 0
    world_size: int = 1
    batch_size: int = 256
    max_seq_len: int = 256
    epoch: int = 0
    seed: int = 0
    shuffle: bool = True
    cursor: bytes = b""


@dataclass
class StreamPlan:
    key: StreamKey
    start_step: int
    num_steps: int


@dataclass
class Limits:
    max_world_size: int = 4096
    max_batch_size: int = 65536
    max_seq_len: int = 1 << 20
    max_global_batch: int = 1 << 22


class DataLoaderCore:
    """Plans epochs and produces each rank's encoded batches; no gRPC here."""

    def __init__(
        self,
        dataset,
        features=None,
        linear_weight: float = DEFAULT_LINEAR_WEIGHT,
        limits: Limits | None = None,
        prefetch: int = 2,
        workers: int = 4,
        max_message_mb: int = 256,
    ):
        self.dataset = dataset
        self.max_message_bytes = max_message_mb * 1024 * 1024
        self.features = features  # FeatureSource for non-sequence features; None: the dataset itself
        self.linear_weight = float(linear_weight)
        self.limits = limits or Limits()
        self.prefetch = max(1, prefetch)
        self.draining = threading.Event()
        self._tag = dataset_tag(dataset.manifest.get("dataset_checksum", dataset.manifest.get("name", "")))
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="collate")
        self._cache: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()

    # -- planning ----------------------------------------------------------------------------------------

    def plan(self, req: StreamRequest) -> StreamPlan:
        """Validate a request; raises InvalidArgument, NotFound or ResourceExhausted with a message."""
        lim = self.limits
        if req.split not in self.dataset.manifest["splits"]:
            raise NotFound(f"unknown split {req.split!r}; the dataset has {', '.join(self.dataset.manifest['splits'])}")
        if not 1 <= req.world_size <= lim.max_world_size:
            raise InvalidArgument(f"world_size must be in [1, {lim.max_world_size}], got {req.world_size}")
        if not 0 <= req.rank < req.world_size:
            raise InvalidArgument(f"rank must be in [0, world_size={req.world_size}), got {req.rank}")
        if req.batch_size <= 0:
            raise InvalidArgument(f"batch_size must be positive, got {req.batch_size}")
        if req.batch_size > lim.max_batch_size or req.batch_size * req.world_size > lim.max_global_batch:
            raise ResourceExhausted(
                f"batch_size {req.batch_size} x world_size {req.world_size} is above the limits "
                f"(batch_size <= {lim.max_batch_size}, global batch <= {lim.max_global_batch})"
            )
        if not 1 <= req.max_seq_len <= lim.max_seq_len:
            raise InvalidArgument(f"max_seq_len must be in [1, {lim.max_seq_len}], got {req.max_seq_len}")
        if req.epoch < 0:
            raise InvalidArgument(f"epoch must be >= 0, got {req.epoch}")
        key = StreamKey(
            self._tag,
            req.split,
            req.rank,
            req.world_size,
            req.batch_size,
            req.max_seq_len,
            req.epoch,
            req.seed,
            bool(req.shuffle),
            self.linear_weight,
        )
        global_batch = req.batch_size * req.world_size
        num_steps = -(-self.dataset.num_examples(req.split) // global_batch)
        start = 0
        if req.cursor:
            try:
                cursor = Cursor.decode(req.cursor)
                cursor.check_matches(key, num_steps)
            except CursorError as err:
                raise InvalidArgument(str(err)) from None
            start = cursor.next_step
        return StreamPlan(key, start, num_steps)

    def _cached(self, key: tuple, build: Callable[[], np.ndarray]) -> np.ndarray:
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        value = build()
        with self._cache_lock:
            self._cache[key] = value
            while len(self._cache) > 16:
                self._cache.popitem(last=False)
        return value

    def epoch_order(self, split: str, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """The epoch's example order (the same on every rank and every server)."""
        n = self.dataset.num_examples(split)

        def build():
            if not shuffle:
                return np.arange(n, dtype=np.int64)
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed % 2**64, epoch])))
            return rng.permutation(n).astype(np.int64)

        return self._cached(("order", split, epoch, seed, shuffle), build)

    def _lengths(self, split: str, max_seq_len: int) -> np.ndarray:
        return self._cached(("lengths", split, max_seq_len), lambda: self.dataset.history_lengths(split, max_seq_len))

    def step_rows(self, key: StreamKey, step: int):
        """(rows of `split` for this rank at global batch `step`, the batch's Partition)."""
        order = self.epoch_order(key.split, key.epoch, key.seed, key.shuffle)
        global_batch = key.batch_size * key.world_size
        chunk = order[step * global_batch : (step + 1) * global_batch]
        parts = partition(self._lengths(key.split, key.max_seq_len)[chunk], key.world_size, key.linear_weight)
        return chunk[parts.rows[key.rank]], parts

    # -- streaming ---------------------------------------------------------------------------------------

    def _build(self, plan: StreamPlan, step: int) -> bytes:
        cpu_start = time.thread_time()
        key = plan.key
        rows, parts = self.step_rows(key, step)
        nbytes = self.dataset.batch_nbytes(key.split, rows, key.max_seq_len)
        if nbytes > self.max_message_bytes:
            raise ResourceExhausted(
                f"batch {step} is estimated at {nbytes / 2**20:.1f} MB, over the message limit of "
                f"{self.max_message_bytes / 2**20:.0f} MB: lower batch_size {key.batch_size} or max_seq_len "
                f"{key.max_seq_len}"
            )
        batch = self.dataset.collate(key.split, rows, key.max_seq_len, self.features)
        return serialize_batch(
            batch,
            cursor=Cursor(key, step + 1).encode(),
            epoch=key.epoch,
            step=step,
            num_steps=plan.num_steps,
            cost_imbalance=parts.cost_imbalance,
            tokens_imbalance=parts.tokens_imbalance,
            sq_tokens_imbalance=parts.sq_tokens_imbalance,
            naive_cost_imbalance=parts.naive_cost_imbalance,
            cpu_start=cpu_start,
        )

    def stream(self, plan: StreamPlan, active: Callable[[], bool] = lambda: True) -> Iterator[bytes]:
        """Serialized BatchMessages from the plan's start; `prefetch` batches are built ahead in threads."""
        pending: deque[futures.Future] = deque()
        next_step = plan.start_step
        try:
            while True:
                while next_step < plan.num_steps and len(pending) < self.prefetch:
                    pending.append(self._pool.submit(self._build, plan, next_step))
                    next_step += 1
                if not pending:
                    return
                data = _result(pending.popleft())
                if self.draining.is_set():
                    raise Unavailable("server shutting down; reconnect and resume from the last cursor")
                if not active():
                    return
                yield data
        finally:
            for future in pending:
                future.cancel()

    def dataset_info(self) -> dict:
        manifest = self.dataset.manifest
        return {
            "name": manifest.get("name", ""),
            "dataset_checksum": manifest.get("dataset_checksum", ""),
            "split_sizes": {s: int(v["num_examples"]) for s, v in manifest["splits"].items()},
            "manifest_json": json.dumps(manifest),
        }


def _result(future: futures.Future) -> bytes:
    """A built batch; failures of the feature service or the dataset become status-coded errors."""
    try:
        return future.result()
    except ServiceError:
        raise
    except grpc.RpcError as err:  # the feature service behind --features: only its outages are worth a retry
        transient = err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        raise (Unavailable if transient else ServiceError)(
            f"feature service: {err.code().name}: {err.details()}"
        ) from None
    except Exception as err:
        raise ServiceError(f"building a batch failed: {type(err).__name__}: {err}") from err


class DataLoaderServicer:
    """Thin adapter: proto request -> core, core errors -> status codes."""

    def __init__(self, core: DataLoaderCore):
        self.core = core

    def StreamBatches(self, request, context):
        req = StreamRequest(
            split=request.split,
            rank=request.rank,
            world_size=request.world_size,
            batch_size=request.batch_size,
            max_seq_len=request.max_seq_len,
            epoch=request.epoch,
            seed=request.seed,
            shuffle=request.shuffle,
            cursor=request.cursor,
        )
        try:
            plan = self.core.plan(req)
            yield from self.core.stream(plan, context.is_active)
        except ServiceError as err:
            abort_on(context, err)

    def GetDatasetInfo(self, request, context):
        return data_pb2.DatasetInfo(**self.core.dataset_info())


def register(core: DataLoaderCore):
    """A `register` callback for `grpc_server.Server`. Batches are serialized in the collate threads, so the
    stream handler sends bytes as they are."""

    def add(server) -> list[str]:
        servicer = DataLoaderServicer(core)
        handlers = {
            "StreamBatches": grpc.unary_stream_rpc_method_handler(
                servicer.StreamBatches,
                request_deserializer=data_pb2.StreamBatchesRequest.FromString,
                response_serializer=bytes,
            ),
            "GetDatasetInfo": grpc.unary_unary_rpc_method_handler(
                servicer.GetDatasetInfo,
                request_deserializer=data_pb2.GetDatasetInfoRequest.FromString,
                response_serializer=data_pb2.DatasetInfo.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        return [SERVICE_NAME]

    return add
