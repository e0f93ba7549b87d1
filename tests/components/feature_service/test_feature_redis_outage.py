"""Redis going away under a serving feature service: UNAVAILABLE (which clients retry), health NOT_SERVING
while it is unreachable, one log line per outage, and back to SERVING when it returns."""

import json
import logging
import time

import grpc
import pytest
from gemrec.components.common.grpc_channel import open_channel
from gemrec.components.common.grpc_server import Server, ServerOptions
from gemrec.components.feature_service.client import FeatureClient
from gemrec.components.feature_service.service import SERVICE_NAME, FeatureServiceCore, register
from gemrec.components.feature_service.store import MemoryStore, RedisStore, materialize
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _status(channel) -> int:
    return (
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status
    )


def _until(condition, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_redis_outage_is_unavailable_and_not_serving(movielens_dataset, redis_starter, free_port, tmp_path, caplog):
    memory = MemoryStore(movielens_dataset)
    redis_proc = redis_starter(free_port, tmp_path)
    url = f"redis://127.0.0.1:{free_port}/0"
    store = server = None
    try:
        materialize(memory, url, progress=False)
        store = RedisStore(url, memory.schema.dataset_checksum)
        store.client.save()  # a dump the restarted redis loads
        core = FeatureServiceCore(store, probe_s=0.2)
        server = Server(ServerOptions(port=0), register(core), health_hook=core.bind_health)
        address = f"127.0.0.1:{server.port}"
        with caplog.at_level(logging.INFO, logger="gemrec"), open_channel(address) as channel:
            with FeatureClient(address, retries=0, timeout_s=10) as client:
                assert client.lookup("item", [1], ["item_id"])["item_id"][0].tolist() == [1]
                redis_proc.terminate()
                redis_proc.wait(timeout=10)
                for _ in range(5):
                    with pytest.raises(grpc.RpcError) as err:
                        client.lookup("item", [1], ["item_id"])
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "redis" in err.value.details()
                assert _status(channel) == NOT_SERVING
                redis_proc = redis_starter(free_port, tmp_path)
                _until(lambda: _status(channel) == SERVING)
                assert client.lookup("item", [1], ["item_id"])["item_id"][0].tolist() == [1]
        events = [json.loads(r.getMessage()).get("event") for r in caplog.records if r.getMessage().startswith("{")]
        assert events.count("store_unreachable") == 1 and events.count("store_reachable") == 1
        assert not [r for r in caplog.records if r.exc_info], "no tracebacks for an outage"
    finally:
        if server is not None:
            server.stop(0)
        if store is not None:
            store.close()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
