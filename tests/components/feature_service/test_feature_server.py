"""The feature service over real gRPC on 127.0.0.1: lookups, histories, status codes, auth, TLS, reflection."""

import json
import logging
import threading

import grpc
import numpy as np
import pytest
from gemrec.components.common.grpc_channel import open_channel, wait_healthy
from gemrec.components.common.grpc_server import Server, ServerOptions
from gemrec.components.feature_service.client import FeatureClient
from gemrec.components.feature_service.service import SERVICE_NAME, FeatureServiceCore, register
from gemrec.components.feature_service.store import MemoryStore, RedisStore, materialize
from gemrec.proto.gemrec.v1 import features_pb2, features_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def memory(movielens_dataset):
    return MemoryStore(movielens_dataset)


def _serve(store, **options):
    server = Server(ServerOptions(port=0, **options), register(FeatureServiceCore(store, max_ids=1000)))
    return server, f"127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def server(memory):
    server, address = _serve(memory, max_message_mb=1)
    yield address
    server.stop(0)


@pytest.fixture(scope="module")
def stub(server):
    channel = open_channel(server)
    yield features_pb2_grpc.FeatureServiceStub(channel)
    channel.close()


def _ids(*ids) -> bytes:
    return np.array(ids, dtype="<i8").tobytes()


def test_list_features_gives_types(server, memory):
    with FeatureClient(server) as client:
        entities = client.list_features()
        info = client.info()
    assert entities["item"]["num_ids"] == 9742 and entities["user"]["num_ids"] == 610
    genres = entities["item"]["features"]["item_genres"]
    assert genres == {"dtype": "int64", "multi_valued": True, "num_embeddings": 19}
    assert info["store"] == "memory" and info["dataset_checksum"] == memory.schema.dataset_checksum


def test_lookup_many_ids_is_columnar_and_exact(server, memory):
    ids = np.array([3, 9741, 0, 3, 17])
    with FeatureClient(server) as client:
        got = client.lookup("item", ids)
        one = client.lookup("item", [42], ["item_tags"])
    want = memory.lookup("item", ids)
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name][0], want[name][0])
        np.testing.assert_array_equal(got[name][1], want[name][1])
    assert list(one) == ["item_tags"] and len(one["item_tags"][1]) == 1


def test_user_history_is_jagged(server, memory):
    users, before = np.array([0, 1, 2]), np.array([1_000_000_000, 1_500_000_000, 2_000_000_000])
    with FeatureClient(server) as client:
        got = client.user_history(users, before, max_len=25)
    want = memory.user_history(users, before, 25)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    assert got["offsets"][-1] == len(got["item_ids"]) and np.all(np.diff(got["offsets"]) <= 25)


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (features_pb2.GetFeaturesRequest(entity="movie", ids=_ids(1)), grpc.StatusCode.NOT_FOUND, "movie"),
        (
            features_pb2.GetFeaturesRequest(entity="item", ids=_ids(1), names=["nope"]),
            grpc.StatusCode.NOT_FOUND,
            "nope",
        ),
        (features_pb2.GetFeaturesRequest(entity="item", ids=_ids(99999)), grpc.StatusCode.NOT_FOUND, "99999"),
        (
            features_pb2.GetFeaturesRequest(entity="item", ids=b"\x01\x02\x03"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "multiple of 8",
        ),
        (
            features_pb2.GetFeaturesRequest(entity="item", ids=_ids(*range(1001))),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "limit is 1000",
        ),
        (features_pb2.GetFeaturesRequest(entity="item", ids=b"\0" * (2 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ],
)
def test_bad_requests_get_status_codes(stub, request_, code, message, caplog):
    with caplog.at_level(logging.INFO, logger="gemrec.serve"), pytest.raises(grpc.RpcError) as err:
        stub.GetFeatures(request_, timeout=10)
    assert err.value.code() == code and message in err.value.details()
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED or message:  # size-limit rejections never reach the handler
        records = [json.loads(r.getMessage()) for r in caplog.records if r.getMessage().startswith("{")]
        assert any(r["method"].endswith("/GetFeatures") and r["code"] == code.name for r in records)
    assert stub.GetFeatures(features_pb2.GetFeaturesRequest(entity="user", ids=_ids(1)), timeout=10).num_ids == 1


def test_history_bad_input(stub):
    bad = features_pb2.GetUserHistoryRequest(users=_ids(1, 2), before_timestamps=_ids(5, 6, 7), max_len=3)
    with pytest.raises(grpc.RpcError) as err:
        stub.GetUserHistory(bad, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "3 timestamps for 2 users" in err.value.details()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entity=st.sampled_from(["user", "item", "", "movie", "item\x00"]),
    ids=st.one_of(st.binary(max_size=64), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=8)),
    names=st.lists(st.sampled_from(["item_genres", "user_id", "item_id", "", "x" * 50]), max_size=3),
    max_len=st.integers(-(2**31), 2**31 - 1),
)
def test_fuzzed_requests_never_break_the_server(stub, entity, ids, names, max_len):
    raw = ids if isinstance(ids, bytes) else np.array(ids, dtype="<i8").tobytes()
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
    for call, request in (
        (stub.GetFeatures, features_pb2.GetFeaturesRequest(entity=entity, ids=raw, names=names)),
        (stub.GetUserHistory, features_pb2.GetUserHistoryRequest(users=raw, before_timestamps=raw, max_len=max_len)),
    ):
        try:
            call(request, timeout=10)
        except grpc.RpcError as err:
            assert err.code() in allowed, (err.code(), err.details())
            assert err.details()
    assert stub.GetFeatures(features_pb2.GetFeaturesRequest(entity="item", ids=_ids(7)), timeout=10).num_ids == 1


def test_health_and_reflection(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with open_channel(server) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services


def test_bearer_token_over_tls(memory, tls_files):
    cert, key = tls_files
    server, address = _serve(memory, tls_cert=cert, tls_key=key, auth_token=TOKEN)
    try:
        with open_channel(address, tls_ca=cert) as channel:
            wait_healthy(channel, timeout_s=10)  # health checks need no token
        for token in ("", "wrong"):
            with (
                FeatureClient(address, tls_ca=cert, token=token, retries=0) as client,
                pytest.raises(grpc.RpcError) as err,
            ):
                client.lookup("item", [1])
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in err.value.details()
        with FeatureClient(address, tls_ca=cert, token=TOKEN) as client:
            assert client.lookup("item", [1], ["item_id"])["item_id"][0].tolist() == [1]
        with FeatureClient(address, token=TOKEN, retries=0, timeout_s=2) as plaintext, pytest.raises(grpc.RpcError):
            plaintext.lookup("item", [1])
    finally:
        server.stop(0)


def test_redis_backed_server_answers_like_memory(memory, redis_url):
    materialize(memory, redis_url, progress=False)
    store = RedisStore(redis_url, memory.schema.dataset_checksum)
    server, address = _serve(store)
    try:
        ids = np.arange(0, 9742, 97)
        with FeatureClient(address) as client:
            got = client.lookup("item", ids)
            assert client.info()["store"] == "redis"
        for name, (values, lengths) in memory.lookup("item", ids).items():
            np.testing.assert_array_equal(got[name][0], values)
            np.testing.assert_array_equal(got[name][1], lengths)
    finally:
        server.stop(0)
        store.close()


class _GatedStore(MemoryStore):
    """The real store, whose item lookups wait for `gate` once `hold` is set: a call stays in flight on demand."""

    def __init__(self, dataset):
        super().__init__(dataset)
        self.hold, self.entered, self.gate = threading.Event(), threading.Event(), threading.Event()

    def lookup(self, entity, ids, names=None):
        if self.hold.is_set():
            self.entered.set()
            self.gate.wait(30)
        return super().lookup(entity, ids, names)


def test_a_call_in_flight_when_the_server_stops_is_retried_on_its_restart(movielens_dataset, memory, free_port):
    gated = _GatedStore(movielens_dataset)
    gated.hold.set()
    address = f"127.0.0.1:{free_port}"
    first = Server(ServerOptions(port=free_port), register(FeatureServiceCore(gated)))
    second = None
    result: dict = {}
    try:
        with FeatureClient(address, timeout_s=20) as client:
            caller = threading.Thread(target=lambda: result.update(client.lookup("item", np.array([1, 2]))))
            caller.start()
            assert gated.entered.wait(20)
            first.stop(0)  # cancels the call in flight: the client sees CANCELLED
            second = Server(ServerOptions(port=free_port), register(FeatureServiceCore(memory)))
            caller.join(30)
            assert not caller.is_alive()
        want = memory.lookup("item", np.array([1, 2]))
        assert sorted(result) == sorted(want)
        for name, (values, lengths) in want.items():
            assert np.array_equal(result[name][0], values) and np.array_equal(result[name][1], lengths)
    finally:
        gated.gate.set()
        first.stop(0)
        if second is not None:
            second.stop(0)
