"""gRPC server plumbing shared by the feature and data services.

Health checking, reflection, message-size limits, optional TLS, a bearer-token check, one JSON log line
per call, and graceful shutdown on SIGTERM. Core classes raise `ServiceError`s; `abort_on` maps them to
status codes. The client side (channels, token metadata) is `grpc_channel`.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .grpc_channel import TOKEN_ENV

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
log = logging.getLogger("gemrec.serve")


class ServiceError(Exception):
    """An error that maps to a gRPC status code; raised by the plain core classes."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError, KeyError):
    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    max_message_mb: int = 256
    max_workers: int = 16
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None
    grace_s: float = 10.0

    def grpc_options(self) -> list[tuple[str, int]]:
        limit = self.max_message_mb * 1024 * 1024
        return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def add_server_args(parser, default_port: int, default_workers: int = 16) -> None:
    """The flags every `gemrec serve ...` command shares."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 inside a pod)")
    parser.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    parser.add_argument("--max-message-mb", type=int, default=256, help="max send/receive message size")
    parser.add_argument(
        "--max-workers",
        type=int,
        default=default_workers,
        help="handler threads: concurrent calls, including open streams",
    )
    parser.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key serves TLS")
    parser.add_argument("--tls-key", help="PEM private key")
    parser.add_argument("--auth-token", help=f"require 'authorization: Bearer TOKEN' (default: ${TOKEN_ENV})")
    parser.add_argument("--grace-s", type=float, default=10.0, help="shutdown grace for in-flight calls")


def options_from_args(args) -> ServerOptions:
    from gemrec.cli import CLIError

    if bool(args.tls_cert) != bool(args.tls_key):
        raise CLIError("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key):
        if path and not Path(path).is_file():
            raise CLIError(f"TLS file not found: {path}")
    if not 0 <= args.port < 65536:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_message_mb <= 0:
        raise CLIError(f"--max-message-mb must be positive, got {args.max_message_mb}")
    return ServerOptions(
        host=args.host,
        port=args.port,
        max_message_mb=args.max_message_mb,
        max_workers=args.max_workers,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_token=args.auth_token or os.environ.get(TOKEN_ENV) or None,
        grace_s=args.grace_s,
    )


class _AuthAndLogInterceptor(grpc.ServerInterceptor):
    """Rejects calls without the bearer token (health checks stay open) and logs every call as JSON."""

    def __init__(self, token: str | None):
        self._expected = f"Bearer {token}".encode() if token else None

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if self._expected is None or details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return True
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return False

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        authorized = self._authorized(handler_call_details)

        def finish(context, start: float, messages: int, raised: bool) -> None:
            code = context.code()
            if code is None:  # not set by abort: a handler bug, a cancelled stream, or success
                code = grpc.StatusCode.UNKNOWN if raised else grpc.StatusCode.OK
                code = grpc.StatusCode.CANCELLED if not context.is_active() and not raised else code
            record = {
                "event": "rpc",
                "method": method,
                "peer": context.peer(),
                "code": code.name if isinstance(code, grpc.StatusCode) else str(code),
                "ms": round((time.perf_counter() - start) * 1e3, 3),
                "messages": messages,
            }
            details = context.details()
            if code != grpc.StatusCode.OK and details:
                record["details"] = details.decode(errors="replace") if isinstance(details, bytes) else details
            log.info(json.dumps(record))

        def deny(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            def unary_unary(request, context):
                start, raised = time.perf_counter(), True
                try:
                    if not authorized:
                        deny(context)
                    reply = behavior(request, context)
                    raised = False
                    return reply
                finally:
                    finish(context, start, 1, raised)

            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream is not None:
            behavior = handler.unary_stream

            def unary_stream(request, context):
                start, sent, raised = time.perf_counter(), 0, True
                try:
                    if not authorized:
                        deny(context)
                    for message in behavior(request, context):
                        sent += 1
                        yield message
                    raised = False
                except GeneratorExit:  # the client went away
                    raised = False
                    raise
                finally:
                    finish(context, start, sent, raised)

            return handler._replace(unary_stream=unary_stream)
        if handler.stream_stream is not None:  # reflection
            behavior = handler.stream_stream

            def stream_stream(request_iterator, context):
                if not authorized:
                    deny(context)
                yield from behavior(request_iterator, context)

            return handler._replace(stream_stream=stream_stream)
        return handler


def abort_on(context: grpc.ServicerContext, err: ServiceError):
    """Map a core error to its status code (raises)."""
    context.abort(err.code, str(err))


class Server:
    """A started gRPC server with health and reflection; `wait()` blocks until SIGTERM/SIGINT."""

    def __init__(
        self,
        options: ServerOptions,
        register: Callable[[grpc.Server], Sequence[str]],
        on_drain: Callable[[], None] | None = None,
    ):
        self.options = options
        self._on_drain = on_drain
        self._stopped = threading.Event()
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=options.max_workers),
            interceptors=[_AuthAndLogInterceptor(options.auth_token)],
            options=options.grpc_options(),
        )
        service_names = list(register(self.grpc_server))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection([*service_names, HEALTH_SERVICE, reflection.SERVICE_NAME], self.grpc_server)
        address = f"{options.host}:{options.port}"
        if options.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(Path(options.tls_key).read_bytes(), Path(options.tls_cert).read_bytes())]
            )
            self.port = self.grpc_server.add_secure_port(address, creds)
        else:
            self.port = self.grpc_server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind {address}")
        self.grpc_server.start()
        for name in ["", *service_names]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.service_names = service_names
        log.info(
            json.dumps(
                {
                    "event": "listening",
                    "address": f"{options.host}:{self.port}",
                    "services": service_names,
                    "tls": bool(options.tls_cert),
                    "auth": bool(options.auth_token),
                }
            )
        )

    def stop(self, grace_s: float | None = None) -> None:
        """Graceful: report NOT_SERVING, let streams end after their current message, wait for in-flight calls."""
        if self._stopped.is_set():
            return
        self.health.enter_graceful_shutdown()
        if self._on_drain is not None:
            self._on_drain()
        grace = self.options.grace_s if grace_s is None else grace_s
        self.grpc_server.stop(grace).wait()
        self._stopped.set()
        log.info(json.dumps({"event": "stopped", "port": self.port}))

    def wait(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop gracefully (call from the main thread)."""
        requested = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: requested.set())
        while not requested.wait(0.5):
            pass
        self.stop()
