"""Python client of `gemrec.v1.FeatureService`; implements the `FeatureSource` protocol.

with FeatureClient("127.0.0.1:50051") as features:
    features.list_features()                      # {"user": {...}, "item": {"item_genres": {...}}}
    cols = features.lookup("item", np.array([1, 2, 3]), ["item_genres"])
    values, lengths = cols["item_genres"]         # values of all ids concatenated, one length per id
    hist = features.user_history(np.array([0, 1]), before_ts=np.array([1.5e9, 1.6e9]), max_len=50)
"""

from __future__ import annotations

import random
import time

import grpc
import numpy as np
from gemrec.components.common.grpc_channel import call_metadata, open_channel
from gemrec.components.common.grpc_server import FailedPrecondition
from gemrec.proto.gemrec.v1 import features_pb2, features_pb2_grpc

from .wire import from_array

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


class DatasetMismatch(FailedPrecondition):
    """The feature service answered from another dataset than the client expects (FAILED_PRECONDITION)."""


class FeatureClient:
    """Blocking client; every call has a deadline and idempotent calls retry UNAVAILABLE with backoff, and CANCELLED
    unless this client closed its channel (a server that stops cancels the calls in flight: an outage too)."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        timeout_s: float = 10.0,
        retries: int = 3,
        max_message_mb: int = 256,
        expect_checksum: str | None = None,
    ):
        """With `expect_checksum`, every lookup checks the dataset checksum its answer carries and raises
        DatasetMismatch on another one (a feature service restarted on another dataset), never wrong data."""
        self.address = address
        self.expect_checksum = expect_checksum
        self.timeout_s = timeout_s
        self.retries = retries
        self._metadata = call_metadata(token)
        self._closed = False
        self._channel = open_channel(address, tls_ca, max_message_mb)
        self._stub = features_pb2_grpc.FeatureServiceStub(self._channel)

    def _checked(self, reply):
        if self.expect_checksum is not None and reply.dataset_checksum != self.expect_checksum:
            raise DatasetMismatch(
                f"the feature service at {self.address} answers from another dataset "
                f"({reply.dataset_checksum or 'no checksum: an older server'}) than this one ({self.expect_checksum})"
            )
        return reply

    def _call(self, method, request):
        for attempt in range(self.retries + 1):
            try:
                return method(request, timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:
                restarted = err.code() == grpc.StatusCode.CANCELLED and not self._closed
                if not (err.code() in RETRYABLE or restarted) or attempt == self.retries:
                    raise
                time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def info(self) -> dict:
        """{"dataset", "dataset_checksum", "store", "entities": list_features()}."""
        reply = self._call(self._stub.ListFeatures, features_pb2.ListFeaturesRequest())
        return {
            "dataset": reply.dataset,
            "dataset_checksum": reply.dataset_checksum,
            "store": reply.store,
            "entities": self._entities(reply),
        }

    def list_features(self) -> dict[str, dict]:
        """{entity: {"num_ids": n, "features": {name: {"dtype", "multi_valued", "num_embeddings"}}}}."""
        return self._entities(self._call(self._stub.ListFeatures, features_pb2.ListFeaturesRequest()))

    @staticmethod
    def _entities(reply) -> dict[str, dict]:
        return {
            e.name: {
                "num_ids": e.num_ids,
                "features": {
                    f.name: {"dtype": f.dtype, "multi_valued": f.multi_valued, "num_embeddings": f.num_embeddings}
                    for f in e.features
                },
            }
            for e in reply.entities
        }

    def lookup(self, entity: str, ids, names: list[str] | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{name: (values, lengths)} for `ids` (dense indices); all features when `names` is empty."""
        ids = np.ascontiguousarray(ids, dtype="<i8")
        reply = self._checked(
            self._call(
                self._stub.GetFeatures,
                features_pb2.GetFeaturesRequest(entity=entity, ids=ids.tobytes(), names=list(names or [])),
            )
        )
        return {c.name: (from_array(c.values), from_array(c.lengths)) for c in reply.columns}

    def user_history(self, users, before_ts, max_len: int) -> dict[str, np.ndarray]:
        """Jagged histories, oldest first: offsets (B+1), items, item_ids, timestamps (T), actions (T, A)."""
        users = np.ascontiguousarray(users, dtype="<i8")
        before_ts = np.ascontiguousarray(np.reshape(before_ts, -1), dtype="<i8")
        reply = self._checked(
            self._call(
                self._stub.GetUserHistory,
                features_pb2.GetUserHistoryRequest(
                    users=users.tobytes(), before_timestamps=before_ts.tobytes(), max_len=max_len
                ),
            )
        )
        return {
            "offsets": from_array(reply.offsets),
            "items": from_array(reply.items),
            "item_ids": from_array(reply.item_ids),
            "timestamps": from_array(reply.timestamps),
            "actions": from_array(reply.actions),
        }

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def __enter__(self) -> FeatureClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
