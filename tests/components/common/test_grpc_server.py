"""The common gRPC server against hostile clients, on a real feature service on 127.0.0.1: health watches
hold no worker and are capped, the token is checked from the metadata before the body is read."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from gemrec.components.common.grpc_channel import open_channel, wait_healthy
from gemrec.components.common.grpc_server import Server, ServerOptions
from gemrec.components.feature_service.client import FeatureClient
from gemrec.components.feature_service.service import FeatureServiceCore, register
from gemrec.components.feature_service.store import MemoryStore
from gemrec.proto.gemrec.v1 import features_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

TOKEN = "s3cret-token"
SERVING = health_pb2.HealthCheckResponse.SERVING
GET_FEATURES = "/gemrec.v1.FeatureService/GetFeatures"


@pytest.fixture(scope="module")
def memory(movielens_dataset):
    return MemoryStore(movielens_dataset)


def _serve(store, **options):
    server = Server(ServerOptions(port=0, **options), register(FeatureServiceCore(store)))
    return server, f"127.0.0.1:{server.port}"


def test_unauthenticated_watch_streams_leave_calls_served(memory, tls_files):
    cert, key = tls_files
    server, address = _serve(memory, max_workers=4, tls_cert=cert, tls_key=key, auth_token=TOKEN)
    try:
        with open_channel(address, tls_ca=cert) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(16)]
            try:
                assert [next(w).status for w in watches] == [SERVING] * 16
                with FeatureClient(address, tls_ca=cert, token=TOKEN, timeout_s=5, retries=0) as client:
                    assert client.lookup("item", [1], ["item_id"])["item_id"][0].tolist() == [1]
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
            finally:
                for w in watches:
                    w.cancel()
    finally:
        server.stop(0)


@pytest.mark.parametrize(
    ("total", "per_peer", "message"), [(3, 8, "open Watch streams on this server"), (8, 3, "from")]
)
def test_watch_streams_are_capped_in_total_and_per_peer(memory, total, per_peer, message):
    server, address = _serve(memory, max_watches=total, max_streams_per_peer=per_peer)
    try:
        with open_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(3)]
            assert [next(w).status for w in watches] == [SERVING] * 3
            with pytest.raises(grpc.RpcError) as err:
                next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and message in err.value.details()
            watches.pop().cancel()
            deadline = time.monotonic() + 5
            while True:  # the slot comes back once the server has seen the cancellation
                try:
                    again = health.Watch(health_pb2.HealthCheckRequest(), timeout=10)
                    assert next(again).status == SERVING
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
            for w in [*watches, again]:
                w.cancel()
    finally:
        server.stop(0)


def test_watch_churn_does_not_deadlock_the_server(memory):
    """Watches opened and cancelled at once from several threads (grpc_health's servicer deadlocks here)."""
    server, address = _serve(memory, max_workers=6)
    try:
        with open_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def churn():
                for _ in range(40):
                    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=10)
                    next(watch)
                    watch.cancel()

            threads = [threading.Thread(target=churn) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert not any(t.is_alive() for t in threads), "watch churn hung the server"
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
    finally:
        server.stop(0)


def test_garbage_body_without_token_is_unauthenticated(memory):
    server, address = _serve(memory, auth_token=TOKEN)
    try:
        with open_channel(address) as channel:
            call = channel.unary_unary(GET_FEATURES, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                call(b"\xff\xfe garbage, not a protobuf \x00\x01", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(0)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_token_is_checked_before_a_big_body_is_read(movielens_dataset, free_port, tmp_path):
    """4 unauthenticated 64 MB requests: refused as UNAUTHENTICATED (not by size) without reading them."""
    env = {**os.environ, "GEMREC_AUTH_TOKEN": TOKEN}
    log = open(tmp_path / "server.log", "w")
    args = ["serve", "features", "--dataset", str(movielens_dataset), "--port", str(free_port)]
    proc = subprocess.Popen([sys.executable, "-m", "gemrec.cli", *args], env=env, stdout=log, stderr=log)
    try:
        address = f"127.0.0.1:{free_port}"
        with open_channel(address) as channel:
            wait_healthy(channel, timeout_s=90)
            rss_before = _rss_mb(proc.pid)
            big = features_pb2.GetFeaturesRequest(entity="item", ids=np.zeros(8 << 20, dtype="<i8").tobytes())
            call = channel.unary_unary(
                GET_FEATURES, request_serializer=features_pb2.GetFeaturesRequest.SerializeToString
            )
            codes = []

            def send():
                try:
                    call(big, timeout=30)
                except grpc.RpcError as err:
                    codes.append(err.code())

            threads = [threading.Thread(target=send) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            grown = _rss_mb(proc.pid) - rss_before
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
        assert grown < 48, f"the server grew by {grown:.0f} MB reading bodies it should have refused unread"
        with FeatureClient(address, token=TOKEN) as client:
            assert client.lookup("item", [1], ["item_id"])["item_id"][0].tolist() == [1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _server_args(*argv):
    from gemrec.cli import build_parser

    return build_parser().parse_args(["serve", "features", "--dataset", "unused", *argv])


def test_token_comes_from_a_file_or_the_environment(tmp_path, monkeypatch, capsys):
    from gemrec.cli import CLIError
    from gemrec.components.common.grpc_server import options_from_args

    monkeypatch.delenv("GEMREC_AUTH_TOKEN", raising=False)
    secret = tmp_path / "token"
    secret.write_text(f"{TOKEN}\n")
    assert options_from_args(_server_args("--auth-token-file", str(secret))).auth_token == TOKEN
    monkeypatch.setenv("GEMREC_AUTH_TOKEN", "from-env")
    assert options_from_args(_server_args()).auth_token == "from-env"
    assert "warning" not in capsys.readouterr().err
    assert options_from_args(_server_args("--auth-token", "on-the-command-line")).auth_token == "on-the-command-line"
    assert "process table" in capsys.readouterr().err
    for argv, message in [
        (["--auth-token-file", str(tmp_path / "missing")], "missing"),
        (["--auth-token-file", str(tmp_path)], "cannot read"),
        (["--auth-token-file", str(secret), "--auth-token", "x"], "not both"),
    ]:
        with pytest.raises(CLIError, match=message):
            options_from_args(_server_args(*argv))
    secret.write_text("\n")
    with pytest.raises(CLIError, match="empty"):
        options_from_args(_server_args("--auth-token-file", str(secret)))
