"""gRPC client plumbing shared by the feature and data services: channels with the servers' message
limits and optional TLS, the bearer token as call metadata, and waiting for a server to be healthy."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TOKEN_ENV = "GEMREC_AUTH_TOKEN"


def channel_options(max_message_mb: int = 256) -> list[tuple[str, int]]:
    limit = max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def open_channel(address: str, tls_ca: str | None = None, max_message_mb: int = 256) -> grpc.Channel:
    """A channel to `address` (host:port); TLS when `tls_ca` (PEM file of the trusted CA/cert) is given."""
    options = channel_options(max_message_mb)
    if tls_ca:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
        return grpc.secure_channel(address, creds, options=options)
    return grpc.insecure_channel(address, options=options)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return (("authorization", f"Bearer {token}"),) if token else ()


def wait_healthy(channel: grpc.Channel, service: str = "", timeout_s: float = 30.0) -> None:
    """Block until the server reports SERVING for `service` (raises TimeoutError)."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not healthy after {timeout_s:.0f} s")
        time.sleep(0.05)
