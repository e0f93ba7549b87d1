"""`gemrec.v1.FeatureService`: a plain core class over a store, and the thin gRPC servicer around it."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
from gemrec.components.common.grpc_server import InvalidArgument, ResourceExhausted, ServiceError, Unavailable, abort_on
from gemrec.proto.gemrec.v1 import features_pb2, features_pb2_grpc

from .store import check_history_args, history_nbytes
from .wire import ids_from_bytes, to_array

SERVICE_NAME = features_pb2.DESCRIPTOR.services_by_name["FeatureService"].full_name
log = logging.getLogger("gemrec.serve")


class StoreOutage:
    """Whether the store answers. The first Unavailable of an outage logs one line and reports the service
    NOT_SERVING; while it lasts, calls fail fast without waiting on the store, and a probe thread pings it
    every `probe_s` until it answers (one more line, SERVING again)."""

    def __init__(self, store, probe_s: float = 1.0):
        self.store = store
        self.probe_s = probe_s
        self.set_serving: Callable[[bool], None] = lambda serving: None
        self._lock = threading.Lock()
        self._down: tuple[float, str] | None = None  # (since, why)

    def check(self) -> None:
        """Raise Unavailable while an outage lasts."""
        down = self._down
        if down is not None:
            raise Unavailable(f"{down[1]} (for {time.monotonic() - down[0]:.0f} s)")

    def failed(self, err: Unavailable) -> None:
        with self._lock:
            if self._down is not None:
                return
            self._down = (time.monotonic(), str(err))
        log.warning(json.dumps({"event": "store_unreachable", "store": self.store.kind, "error": str(err)}))
        self.set_serving(False)
        threading.Thread(target=self._probe, name="store-probe", daemon=True).start()

    def _probe(self) -> None:
        while True:
            time.sleep(self.probe_s)
            try:
                self.store.ping()
                break
            except Unavailable:
                continue
        with self._lock:
            since, self._down = self._down[0], None
        log.info(
            json.dumps(
                {"event": "store_reachable", "store": self.store.kind, "down_s": round(time.monotonic() - since, 1)}
            )
        )
        self.set_serving(True)


class FeatureServiceCore:
    """Validates requests and answers them from a `MemoryStore` or `RedisStore`. The work a request asks
    for is bounded before it is done: repeated feature names count once, and the response size (for Redis
    histories: the timelines it reads) is estimated from the stored lengths and refused over the limit."""

    def __init__(
        self,
        store,
        max_ids: int = 65536,
        max_history_len: int = 65536,
        max_response_mb: int = 256,
        probe_s: float = 1.0,
    ):
        self.store = store
        self.max_ids = max_ids
        self.max_history_len = max_history_len
        self.max_response_bytes = max_response_mb * 1024 * 1024
        self.outage = StoreOutage(store, probe_s)

    def bind_health(self, set_serving: Callable[[bool], None]) -> None:
        """`Server(..., health_hook=core.bind_health)`: health follows the store's reachability."""
        self.outage.set_serving = set_serving

    def _from_store(self, call: Callable, *args):
        self.outage.check()
        try:
            return call(*args)
        except Unavailable as err:
            self.outage.failed(err)
            raise

    def _check_count(self, count: int, what: str) -> None:
        if count > self.max_ids:
            raise ResourceExhausted(f"{count} {what} in one request; the limit is {self.max_ids}")

    def _check_size(self, nbytes: int, advice: str) -> None:
        if nbytes > self.max_response_bytes:
            raise ResourceExhausted(
                f"the estimated response is {nbytes / 2**20:.1f} MB, over the limit of "
                f"{self.max_response_bytes / 2**20:.0f} MB: {advice}"
            )

    def get_features(self, entity: str, ids: np.ndarray, names: list[str]) -> dict:
        self._check_count(len(ids), "ids")
        _, names = self.store.schema.resolve(entity, ids, list(dict.fromkeys(names)))
        self._check_size(self.store.feature_nbytes(entity, ids, names), "ask for fewer ids or features")
        return self._from_store(self.store.lookup, entity, ids, names)

    def user_history(self, users: np.ndarray, before_ts: np.ndarray, max_len: int) -> dict:
        self._check_count(len(users), "users")
        if max_len > self.max_history_len:
            raise InvalidArgument(f"max_len {max_len} is above the limit {self.max_history_len}")
        check_history_args(users, before_ts, max_len, self.store.schema.entities["user"].num_ids)
        nbytes = self._from_store(history_nbytes, self.store, users, max_len)
        self._check_size(nbytes, "ask for fewer users or a smaller max_len")
        return self._from_store(self.store.user_history, users, before_ts, max_len)


def _parse_ids(data: bytes, what: str) -> np.ndarray:
    try:
        return ids_from_bytes(data, what)
    except ValueError as err:
        raise InvalidArgument(str(err)) from None


class FeatureServicer(features_pb2_grpc.FeatureServiceServicer):
    def __init__(self, core: FeatureServiceCore):
        self.core = core

    def ListFeatures(self, request, context):
        schema = self.core.store.schema
        return features_pb2.ListFeaturesResponse(
            entities=[
                features_pb2.EntityInfo(
                    name=e.name,
                    num_ids=e.num_ids,
                    features=[
                        features_pb2.FeatureInfo(
                            name=f.name, dtype=f.dtype, multi_valued=f.multi_valued, num_embeddings=f.num_embeddings
                        )
                        for f in e.features.values()
                    ],
                )
                for e in schema.entities.values()
            ],
            dataset=schema.dataset,
            dataset_checksum=schema.dataset_checksum,
            store=self.core.store.kind,
        )

    def GetFeatures(self, request, context):
        try:
            ids = _parse_ids(request.ids, "ids")
            columns = self.core.get_features(request.entity, ids, list(request.names))
        except ServiceError as err:
            abort_on(context, err)
        return features_pb2.GetFeaturesResponse(
            columns=[
                features_pb2.FeatureColumn(name=n, values=to_array(v), lengths=to_array(lengths))
                for n, (v, lengths) in columns.items()
            ],
            num_ids=len(ids),
            dataset_checksum=self.core.store.schema.dataset_checksum,
        )

    def GetUserHistory(self, request, context):
        try:
            users = _parse_ids(request.users, "users")
            before = _parse_ids(request.before_timestamps, "before_timestamps")
            history = self.core.user_history(users, before, request.max_len)
        except ServiceError as err:
            abort_on(context, err)
        return features_pb2.GetUserHistoryResponse(
            offsets=to_array(history["offsets"]),
            items=to_array(history["items"]),
            item_ids=to_array(history["item_ids"]),
            timestamps=to_array(history["timestamps"]),
            actions=to_array(history["actions"]),
            action_names=self.core.store.actions,
            dataset_checksum=self.core.store.schema.dataset_checksum,
        )


def register(core: FeatureServiceCore):
    """A `register` callback for `grpc_server.Server`."""

    def add(server) -> list[str]:
        features_pb2_grpc.add_FeatureServiceServicer_to_server(FeatureServicer(core), server)
        return [SERVICE_NAME]

    return add
