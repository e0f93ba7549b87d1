"""The data service against hostile and careless clients: streams that are never read are capped per peer
and cancelled when idle (the client resumes from its cursor), unary calls and health stay served; a batch
over the message limit is refused from its estimated size, before it is built."""

import time

import grpc
import numpy as np
import pytest
from gemrec.components.common.grpc_channel import open_channel
from gemrec.components.common.grpc_server import ResourceExhausted, Server, ServerOptions
from gemrec.components.data_service.client import DataClient
from gemrec.components.data_service.codec import serialize_batch
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.service import DataLoaderCore, StreamRequest, register
from gemrec.proto.gemrec.v1 import data_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

STREAM = "/gemrec.v1.DataLoaderService/StreamBatches"
INFO = "/gemrec.v1.DataLoaderService/GetDatasetInfo"
# ~4 MB per batch: far more than the HTTP/2 windows, so a server sending to a client that never reads blocks.
BIG = data_pb2.StreamBatchesRequest(split="train", world_size=1, batch_size=2048, max_seq_len=512, seed=1)


@pytest.fixture(scope="module")
def ds(movielens_dataset):
    return Dataset.open(movielens_dataset)


def _open_stream(channel):
    call = channel.unary_stream(
        STREAM, request_serializer=data_pb2.StreamBatchesRequest.SerializeToString, response_deserializer=None
    )
    return call(BIG, timeout=60)


def test_streams_that_are_never_read_are_capped_and_cancelled(ds):
    options = ServerOptions(port=0, max_workers=6, max_streams=4, max_streams_per_peer=2, stream_idle_s=1.0)
    server = Server(options, register(DataLoaderCore(ds, prefetch=1, workers=1)))
    address = f"127.0.0.1:{server.port}"
    try:
        with open_channel(address) as channel:
            stalled = [_open_stream(channel) for _ in range(2)]
            for stream in stalled:
                next(stream)  # accepted; never read again
            with pytest.raises(grpc.RpcError) as err:
                next(_open_stream(channel))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "127.0.0.1" in err.value.details()

            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
            info = channel.unary_unary(
                INFO,
                request_serializer=data_pb2.GetDatasetInfoRequest.SerializeToString,
                response_deserializer=data_pb2.DatasetInfo.FromString,
            )
            assert info(data_pb2.GetDatasetInfoRequest(), timeout=5).name

            deadline, fresh = time.monotonic() + 30, []
            while len(fresh) < 2:  # the idle streams get cancelled, both slots come back
                try:
                    stream = _open_stream(channel)
                    next(stream)
                    fresh.append(stream)
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert time.monotonic() < deadline, "idle streams were never cancelled"
                    time.sleep(0.2)
            for stream in stalled:
                with pytest.raises(grpc.RpcError) as err:
                    for _ in stream:
                        pass
                assert err.value.code() == grpc.StatusCode.CANCELLED
            for stream in fresh:
                stream.cancel()
    finally:
        server.stop(0)


def test_client_resumes_after_its_idle_stream_was_cancelled(ds):
    """A trainer that pauses longer than the idle limit loses no example: it reconnects from its cursor."""
    options = ServerOptions(port=0, stream_idle_s=0.5)
    server = Server(options, register(DataLoaderCore(ds, prefetch=1, workers=1)))
    try:
        client = DataClient(
            f"127.0.0.1:{server.port}", "eval", batch_size=2048, max_seq_len=512, shuffle=False, prefetch=1
        )
        rows = 0
        for i, batch in enumerate(client):
            rows += batch.batch_size
            if i == 0:
                time.sleep(3)  # the server cancels the stream meanwhile
        assert rows == ds.num_examples("eval") and client.reconnects >= 1
    finally:
        server.stop(0)


@pytest.mark.parametrize("dataset", ["movielens_dataset", "synth_dataset"])
def test_batch_size_estimate_matches_the_message(request, dataset):
    ds = Dataset.open(request.getfixturevalue(dataset))
    rows = np.random.default_rng(0).choice(ds.num_examples("train"), size=300, replace=False)
    for max_seq_len in (1, 64, 4096):
        sent = len(serialize_batch(ds.collate("train", rows, max_seq_len), cursor=b"c" * 64))
        assert 0.97 * sent <= ds.batch_nbytes("train", rows, max_seq_len) <= sent


def test_batch_over_the_message_limit_is_refused_before_it_is_built(ds):
    core = DataLoaderCore(ds, max_message_mb=1)
    plan = core.plan(StreamRequest("train", 0, 1, 2048, 512, 0, 0, True))
    with pytest.raises(ResourceExhausted, match="estimated .* batch_size 2048 .* max_seq_len 512"):
        next(core.stream(plan))
    small = core.plan(StreamRequest("train", 0, 1, 16, 8, 0, 0, True))
    assert len(next(core.stream(small))) < 2**20
