"""The data service over real gRPC on 127.0.0.1: exact epochs across ranks, balance, resume, bad input."""

import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest
import torch
from gemrec.components.common.grpc_channel import open_channel
from gemrec.components.common.grpc_server import Server, ServerOptions
from gemrec.components.data_service.balance import rank_sizes
from gemrec.components.data_service.client import DataClient
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.service import DataLoaderCore, StreamRequest, register
from gemrec.components.feature_service.client import FeatureClient
from gemrec.components.feature_service.service import FeatureServiceCore
from gemrec.components.feature_service.service import register as register_features
from gemrec.components.feature_service.store import MemoryStore
from gemrec.proto.gemrec.v1 import data_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SPLIT = "eval"


@pytest.fixture(scope="module")
def ds(movielens_dataset):
    return Dataset.open(movielens_dataset)


@pytest.fixture(scope="module")
def core(ds):
    return DataLoaderCore(ds)


@pytest.fixture(scope="module")
def address(core):
    server = Server(ServerOptions(port=0, max_workers=8), register(core), on_drain=core.draining.set)
    yield f"127.0.0.1:{server.port}"
    server.stop(0)


def example_keys(batch) -> list[tuple[int, int, int]]:
    """(user, target timestamp, target item) names one example of a dataset."""
    return list(zip(batch.user_ids.tolist(), batch.timestamps.tolist(), batch.item_ids.tolist()))


@pytest.fixture(scope="module")
def split_keys(ds):
    return Counter(example_keys(ds.collate(SPLIT, np.arange(ds.num_examples(SPLIT)), 1)))


def assert_same_batch(got, want):
    for name in (
        "user_ids",
        "item_ids",
        "timestamps",
        "labels",
        "dense_features",
        "seq_offsets",
        "seq_item_ids",
        "seq_timestamps",
        "seq_actions",
    ):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("sparse_features", "seq_item_features"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.keys() == b.keys() and torch.equal(a.values(), b.values()) and torch.equal(a.lengths(), b.lengths())
    assert got.max_seq_len == want.max_seq_len and got.label_names == want.label_names


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_example_once_per_epoch_across_ranks(address, split_keys, world_size):
    seen, steps = Counter(), []
    for rank in range(world_size):
        client = DataClient(address, SPLIT, rank, world_size, batch_size=300, max_seq_len=64, epoch=2, seed=11)
        batches = 0
        for batch in client:
            seen.update(example_keys(batch))
            info = client.last_info
            assert info.step == batches
            remainder = sum(split_keys.values()) - info.step * 300 * world_size
            assert batch.batch_size == rank_sizes(min(remainder, 300 * world_size), world_size)[rank]
            assert 1.0 <= info.cost_imbalance <= info.naive_cost_imbalance + 1e-9
            assert int(batch.seq_lengths().max()) <= 64 and batch.cursor == info.cursor
            batches += 1
        steps.append(batches)
    assert seen == split_keys
    assert len(set(steps)) == 1 and steps[0] == -(-sum(split_keys.values()) // (300 * world_size))
    assert client.steps_per_epoch() == steps[0]


def test_batches_are_the_collated_rows_of_the_plan(address, core, ds):
    client = DataClient(address, SPLIT, 1, 3, batch_size=128, max_seq_len=200, epoch=0, seed=5)
    plan = core.plan(StreamRequest(SPLIT, 1, 3, 128, 200, 0, 5, True))
    for step, batch in zip(range(3), client):
        rows, parts = core.step_rows(plan.key, step)
        assert_same_batch(batch, ds.collate(SPLIT, rows, 200))
        assert client.last_info.cost_imbalance == pytest.approx(parts.cost_imbalance)
    client.close()


def test_shuffle_is_deterministic_per_seed_and_epoch(core):
    order = core.epoch_order(SPLIT, epoch=1, seed=3, shuffle=True)
    assert np.array_equal(order, core.epoch_order(SPLIT, 1, 3, True))
    assert not np.array_equal(order, core.epoch_order(SPLIT, 2, 3, True))
    assert not np.array_equal(order, core.epoch_order(SPLIT, 1, 4, True))
    np.testing.assert_array_equal(core.epoch_order(SPLIT, 1, 3, False), np.arange(len(order)))
    np.testing.assert_array_equal(np.sort(order), np.arange(len(order)))


def test_restart_from_saved_cursor_is_exact(address):
    def stream(**kw):
        return DataClient(address, SPLIT, 0, 2, batch_size=400, max_seq_len=32, epoch=1, seed=9, prefetch=2, **kw)

    full = [example_keys(b) for b in stream()]
    first = stream()
    head = [example_keys(b) for _, b in zip(range(5), first)]
    saved = first.cursor
    first.close()
    tail = [example_keys(b) for b in stream(cursor=saved)]
    assert head + tail == full
    last = stream(cursor=saved)
    assert len(list(last)) == len(full) - 5 and list(stream(cursor=last.cursor)) == []


def test_features_from_the_feature_service_give_the_same_batches(ds, movielens_dataset, address):
    feature_server = Server(
        ServerOptions(port=0), register_features(FeatureServiceCore(MemoryStore(movielens_dataset)))
    )
    features = FeatureClient(f"127.0.0.1:{feature_server.port}")
    remote = DataLoaderCore(ds, features)
    server = Server(ServerOptions(port=0), register(remote))
    try:
        args = dict(split=SPLIT, rank=0, world_size=2, batch_size=64, max_seq_len=50, epoch=0, seed=1)
        pairs = zip(DataClient(f"127.0.0.1:{server.port}", **args), DataClient(address, **args))
        for _, (got, want) in zip(range(4), pairs):
            assert_same_batch(got, want)
    finally:
        server.stop(0)
        features.close()
        feature_server.stop(0)


def test_feature_service_rejections_fail_the_stream_at_once(movielens_dataset, synth_dataset):
    """A feature service that rejects the lookups (here: another dataset's, which lacks these features) is no
    outage: the stream fails with INTERNAL naming it, without the client retrying until its timeout."""
    feature_server = Server(
        ServerOptions(port=0), register_features(FeatureServiceCore(MemoryStore(movielens_dataset)))
    )
    features = FeatureClient(f"127.0.0.1:{feature_server.port}")
    server = Server(ServerOptions(port=0), register(DataLoaderCore(Dataset.open(synth_dataset), features)))
    try:
        client = DataClient(f"127.0.0.1:{server.port}", "train", batch_size=16, max_seq_len=8, wait_timeout_s=60)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            next(iter(client))
        assert err.value.code() == grpc.StatusCode.INTERNAL and "feature service: " in err.value.details()
        assert client.reconnects == 0 and time.monotonic() - start < 30
    finally:
        server.stop(0)
        features.close()
        feature_server.stop(0)


def test_dataset_info(address, ds):
    info = DataClient(address).info()
    assert info["split_sizes"] == {s: ds.num_examples(s) for s in ds.splits}
    assert info["manifest"] == ds.manifest and info["dataset_checksum"] == ds.manifest["dataset_checksum"]


GOOD = dict(split=SPLIT, rank=0, world_size=1, batch_size=8, max_seq_len=16, epoch=0, seed=0, shuffle=True)


def _first(stub, **fields) -> data_pb2.BatchMessage:
    call = stub(data_pb2.StreamBatchesRequest(**{**GOOD, **fields}), timeout=20)
    try:
        return next(call)
    finally:
        call.cancel()


@pytest.fixture(scope="module")
def stream_stub(address):
    channel = open_channel(address)
    yield channel.unary_stream(
        "/gemrec.v1.DataLoaderService/StreamBatches",
        request_serializer=data_pb2.StreamBatchesRequest.SerializeToString,
        response_deserializer=data_pb2.BatchMessage.FromString,
    )
    channel.close()


def _foreign_cursor(stub) -> bytes:
    return _first(stub, rank=1, world_size=2).cursor


@pytest.mark.parametrize(
    ("fields", "code", "message"),
    [
        ({"split": "test"}, grpc.StatusCode.NOT_FOUND, "unknown split 'test'"),
        ({"rank": 2, "world_size": 2}, grpc.StatusCode.INVALID_ARGUMENT, "rank must be in [0, world_size=2)"),
        ({"rank": -1}, grpc.StatusCode.INVALID_ARGUMENT, "rank"),
        ({"world_size": 0}, grpc.StatusCode.INVALID_ARGUMENT, "world_size"),
        ({"batch_size": 0}, grpc.StatusCode.INVALID_ARGUMENT, "batch_size must be positive"),
        ({"batch_size": 10**6}, grpc.StatusCode.RESOURCE_EXHAUSTED, "above the limits"),
        ({"max_seq_len": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_seq_len"),
        ({"epoch": -1}, grpc.StatusCode.INVALID_ARGUMENT, "epoch"),
        ({"cursor": b"not a cursor"}, grpc.StatusCode.INVALID_ARGUMENT, "malformed cursor"),
        ({"cursor": "FOREIGN"}, grpc.StatusCode.INVALID_ARGUMENT, "foreign cursor: issued for rank=1"),
    ],
)
def test_bad_requests_get_status_codes(stream_stub, fields, code, message):
    if fields.get("cursor") == "FOREIGN":
        fields = {"cursor": _foreign_cursor(stream_stub)}
    with pytest.raises(grpc.RpcError) as err:
        _first(stream_stub, **fields)
    assert err.value.code() == code and message in err.value.details()
    assert _first(stream_stub).step == 0  # still serving


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    split=st.sampled_from(["train", "eval", "", "x" * 300]),
    rank=st.integers(-(2**31), 2**31 - 1),
    world_size=st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(1, 4)),
    batch_size=st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(1, 16)),
    max_seq_len=st.integers(-(2**31), 2**31 - 1),
    epoch=st.integers(-(2**63), 2**63 - 1),
    seed=st.integers(-(2**63), 2**63 - 1),
    cursor=st.binary(max_size=80),
)
def test_fuzzed_requests_never_break_the_server(
    stream_stub, split, rank, world_size, batch_size, max_seq_len, epoch, seed, cursor
):
    fields = dict(
        split=split,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        max_seq_len=max_seq_len,
        epoch=epoch,
        seed=seed,
        cursor=cursor,
    )
    try:
        _first(stream_stub, **fields)
    except grpc.RpcError as err:
        allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert err.code() in allowed, (err.code(), err.details())
        assert err.details()
    assert _first(stream_stub).step == 0


def test_bearer_token_required(ds):
    core = DataLoaderCore(ds)
    server = Server(ServerOptions(port=0, auth_token="t0k"), register(core))
    try:
        address = f"127.0.0.1:{server.port}"
        with pytest.raises(grpc.RpcError) as err:
            next(iter(DataClient(address, SPLIT, batch_size=4, token="")))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert next(iter(DataClient(address, SPLIT, batch_size=4, token="t0k"))).batch_size == 4
    finally:
        server.stop(0)


def test_graceful_stop_ends_streams_and_client_resumes_on_a_new_server(ds, split_keys, free_port):
    """Server.stop (what SIGTERM runs): NOT_SERVING, streams end after their current message with
    UNAVAILABLE; the client backs off, reconnects to the replacement and resumes from its cursor."""

    def start():
        core = DataLoaderCore(ds)
        return Server(ServerOptions(port=free_port, grace_s=5), register(core), on_drain=core.draining.set)

    servers = [start()]

    def replace_server():
        servers[-1].stop()
        servers.append(start())

    client = DataClient(
        f"127.0.0.1:{free_port}", SPLIT, batch_size=500, max_seq_len=16, seed=2, prefetch=1, max_backoff_s=0.5
    )
    seen, swapper = Counter(), threading.Thread(target=replace_server)
    try:
        for i, batch in enumerate(client):
            seen.update(example_keys(batch))
            if i == 3:
                swapper.start()
        swapper.join()
    finally:
        client.close()
        for server in servers:
            server.stop(0)
    assert len(servers) == 2 and client.reconnects >= 1
    assert seen == split_keys


def test_three_ranks_on_synthetic_heavy_tailed_data(synth_dataset):
    ds = Dataset.open(synth_dataset)
    core = DataLoaderCore(ds)
    server = Server(ServerOptions(port=0), register(core))
    try:
        seen, ratios = Counter(), []
        for rank in range(3):
            client = DataClient(f"127.0.0.1:{server.port}", "train", rank, 3, batch_size=128, max_seq_len=512, seed=1)
            for batch in client:
                seen.update(example_keys(batch))
                ratios.append((client.last_info.cost_imbalance, client.last_info.naive_cost_imbalance))
                assert client.last_info.build_cpu_s > 0  # measured by the service on the building thread
        assert seen == Counter(example_keys(ds.collate("train", np.arange(ds.num_examples("train")), 1)))
        balanced, naive = np.mean(ratios, axis=0)
        assert balanced < naive and balanced < 1.1
    finally:
        server.stop(0)


def test_stream_deadline_resumes_transparently(address, split_keys):
    client = DataClient(address, SPLIT, batch_size=2000, max_seq_len=8, seed=6, prefetch=1, stream_deadline_s=0.4)
    seen = Counter()
    for batch in client:
        seen.update(example_keys(batch))
        time.sleep(0.15)  # a slow consumer: the stream outlives its deadline
    assert client.reconnects >= 1 and seen == split_keys


def test_client_gives_up_when_no_server_comes_back(free_port):
    client = DataClient(f"127.0.0.1:{free_port}", SPLIT, max_retries=2, backoff_s=0.01, max_backoff_s=0.02)
    with pytest.raises(grpc.RpcError) as err:
        next(iter(client))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and client.reconnects == 2
