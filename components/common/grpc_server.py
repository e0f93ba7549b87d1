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
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .grpc_channel import TOKEN_ENV

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
WATCH_METHOD = f"/{HEALTH_SERVICE}/Watch"
RESERVED_WORKERS = 4  # workers streams never take (half of them on smaller pools): unary calls stay served
MB = 1024 * 1024
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


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    max_message_mb: int = 256  # largest response
    max_request_mb: int = 4  # largest request; requests are ids and cursors, far smaller
    max_workers: int = 16
    max_streams: int | None = None  # open server streams at once (default: all workers but the reserved ones)
    max_streams_per_peer: int = 16  # open streams, and open health Watch streams, per client host
    max_watches: int = 256  # open health Watch streams (they hold no worker)
    stream_idle_s: float = 300.0  # cancel a stream whose client has not taken a message for this long
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None
    grace_s: float = 10.0

    def __post_init__(self):
        if self.max_streams is None:
            self.max_streams = max(1, self.max_workers - min(RESERVED_WORKERS, self.max_workers // 2))
        if not 0 < self.max_streams < self.max_workers:
            raise ValueError(
                f"max_streams must be in [1, max_workers={self.max_workers}) so that unary calls and health "
                f"checks always find a worker, got {self.max_streams}"
            )

    def grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_message_mb * MB),
            ("grpc.max_receive_message_length", self.max_request_mb * MB),
            ("grpc.keepalive_time_ms", 60_000),  # ping idle connections, drop peers that do not answer
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.max_connection_idle_ms", 600_000),
        ]


def add_server_args(parser, default_port: int, default_workers: int = 16) -> None:
    """The flags every `gemrec serve ...` command shares."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 inside a pod)")
    parser.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    parser.add_argument("--max-message-mb", type=int, default=256, help="max response message size")
    parser.add_argument("--max-request-mb", type=int, default=4, help="max request message size")
    parser.add_argument(
        "--max-workers",
        type=int,
        default=default_workers,
        help="handler threads: concurrent calls, including open streams",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        default=None,
        help=f"open server streams at once (default: max-workers - {RESERVED_WORKERS}, or half of them below "
        f"{2 * RESERVED_WORKERS}; the rest serve unary calls and health)",
    )
    parser.add_argument("--max-streams-per-peer", type=int, default=16, help="open streams per client host")
    parser.add_argument(
        "--stream-idle-s", type=float, default=300.0, help="cancel a stream whose client takes no message this long"
    )
    parser.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key serves TLS")
    parser.add_argument("--tls-key", help="PEM private key")
    add_token_args(parser, "--auth-token", "require 'authorization: Bearer TOKEN'")
    parser.add_argument("--grace-s", type=float, default=10.0, help="shutdown grace for in-flight calls")


def add_token_args(parser, flag: str, purpose: str) -> None:
    """FLAG-file (preferred) and FLAG (visible to every local user in the process table: warns)."""
    parser.add_argument(f"{flag}-file", metavar="PATH", help=f"{purpose}: the token is this file's content")
    parser.add_argument(flag, help=f"{purpose} (deprecated: visible in the process table; default: ${TOKEN_ENV})")


def token_from_args(args, flag: str) -> str | None:
    """The token of FLAG-file, else FLAG (with a warning), else $GEMREC_AUTH_TOKEN, else None."""
    import sys

    from gemrec.cli import CLIError

    dest = flag.lstrip("-").replace("-", "_")
    value, path = getattr(args, dest), getattr(args, f"{dest}_file")
    if value and path:
        raise CLIError(f"give {flag}-file or {flag}, not both")
    if path:
        try:
            token = Path(path).read_text().strip()
        except FileNotFoundError:
            raise CLIError(f"{flag}-file {path}: file not found") from None
        except OSError as err:
            raise CLIError(f"{flag}-file {path}: cannot read it ({err.strerror})") from None
        if not token:
            raise CLIError(f"{flag}-file {path} is empty")
        return token
    if value:
        print(
            f"gemrec serve: warning: {flag} puts the token in the process table, readable by every local user; "
            f"use {flag}-file or ${TOKEN_ENV}",
            file=sys.stderr,
        )
        return value
    return os.environ.get(TOKEN_ENV) or None


def options_from_args(args) -> ServerOptions:
    from gemrec.cli import CLIError

    if bool(args.tls_cert) != bool(args.tls_key):
        raise CLIError("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key):
        if path and not Path(path).is_file():
            raise CLIError(f"TLS file not found: {path}")
    if not 0 <= args.port < 65536:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("max_message_mb", "max_request_mb", "max_workers", "max_streams_per_peer", "stream_idle_s"):
        if getattr(args, flag) <= 0:
            raise CLIError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    try:
        return ServerOptions(
            host=args.host,
            port=args.port,
            max_message_mb=args.max_message_mb,
            max_request_mb=args.max_request_mb,
            max_workers=args.max_workers,
            max_streams=args.max_streams,
            max_streams_per_peer=args.max_streams_per_peer,
            stream_idle_s=args.stream_idle_s,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            auth_token=token_from_args(args, "--auth-token"),
            grace_s=args.grace_s,
        )
    except ValueError as err:
        raise CLIError(str(err).replace("max_", "--max-").replace("_", "-")) from None


def peer_host(peer: str) -> str:
    """The client host of a gRPC peer string ("ipv4:127.0.0.1:5000" -> "127.0.0.1", "ipv6:[::1]:5000" -> "[::1]")."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return address.rsplit(":", 1)[0]
    return peer


class _OpenStreams:
    """Counts open streams of one kind, in total and per client host, and cancels streams whose client has
    not taken a message for `idle_s` (a watchdog thread; stalled sends hold a worker and built batches)."""

    def __init__(self, kind: str, total: int, per_peer: int, idle_s: float | None):
        self.kind, self.total, self.per_peer, self.idle_s = kind, total, per_peer, idle_s
        self._lock = threading.Lock()
        self._per_host: dict[str, int] = {}
        self._count = 0
        self._waiting: dict[int, tuple[float, grpc.ServicerContext]] = {}  # stream id -> (yielded at, context)
        self._closed = threading.Event()
        if idle_s is not None:
            threading.Thread(target=self._watch_idle, name="idle-streams", daemon=True).start()

    def acquire(self, host: str) -> str | None:
        """None when a slot was taken, else why the stream is refused."""
        with self._lock:
            if self._count >= self.total:
                return f"{self._count} open {self.kind} on this server (limit {self.total}); retry later"
            if self._per_host.get(host, 0) >= self.per_peer:
                return f"{self.per_peer} open {self.kind} from {host} (limit per client host); retry later"
            self._count += 1
            self._per_host[host] = self._per_host.get(host, 0) + 1
            return None

    def release(self, host: str) -> None:
        with self._lock:
            self._count -= 1
            self._per_host[host] -= 1
            if not self._per_host[host]:
                del self._per_host[host]

    def sending(self, stream: int, context) -> None:
        with self._lock:
            self._waiting[stream] = (time.monotonic(), context)

    def sent(self, stream: int) -> None:
        with self._lock:
            self._waiting.pop(stream, None)

    def close(self) -> None:
        self._closed.set()

    def _watch_idle(self) -> None:
        while not self._closed.wait(min(1.0, self.idle_s / 4)):
            now = time.monotonic()
            with self._lock:
                stalled = [(s, c) for s, (t, c) in self._waiting.items() if now - t > self.idle_s]
                for stream, _ in stalled:
                    del self._waiting[stream]
            for _, context in stalled:
                log.info(json.dumps({"event": "idle_stream_cancelled", "peer": context.peer(), "idle_s": self.idle_s}))
                context.cancel()


class _Interceptor(grpc.ServerInterceptor):
    """Checks the bearer token from the metadata before the request body is read (health stays open), caps
    open streams, and logs every call as one JSON line."""

    def __init__(self, options: ServerOptions):
        self._expected = f"Bearer {options.auth_token}".encode() if options.auth_token else None
        self._streams = _OpenStreams(
            "streams", options.max_streams, options.max_streams_per_peer, options.stream_idle_s
        )
        self._watches = _OpenStreams("Watch streams", options.max_watches, options.max_streams_per_peer, None)

    def close(self) -> None:
        self._streams.close()

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if self._expected is None or details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return True
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return False

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if not self._authorized(handler_call_details):
            return _deny(method)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            def unary_unary(request, context):
                start, raised = time.perf_counter(), True
                try:
                    reply = behavior(request, context)
                    raised = False
                    return reply
                finally:
                    _log_call(method, context, start, 1, raised)

            return handler._replace(unary_unary=unary_unary)
        if method == WATCH_METHOD:
            return handler._replace(unary_stream=self._watch(handler.unary_stream))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(method, handler.unary_stream))
        if handler.stream_stream is not None:  # reflection
            return handler._replace(stream_stream=self._stream(method, handler.stream_stream))
        return handler

    def _watch(self, behavior):
        """Health Watch stays non-blocking (no worker per stream), with a cap on open watches."""
        streams = self._watches

        def watch(request, context, send_response_callback=None):
            host = peer_host(context.peer())
            refused = streams.acquire(host)
            if refused:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            context.add_callback(lambda: streams.release(host))
            return behavior(request, context, send_response_callback=send_response_callback)

        watch.experimental_non_blocking = True
        watch.experimental_thread_pool = None
        return watch

    def _stream(self, method: str, behavior):
        streams = self._streams

        def stream(request, context):
            start, sent, raised, host = time.perf_counter(), 0, True, peer_host(context.peer())
            refused = streams.acquire(host)
            if refused:
                _log_call(method, context, start, 0, False, grpc.StatusCode.RESOURCE_EXHAUSTED)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            key = id(context)
            try:
                for message in behavior(request, context):
                    streams.sending(key, context)
                    yield message
                    streams.sent(key)
                    sent += 1
                raised = False
            except GeneratorExit:  # the client went away, or the stream was cancelled as idle
                raised = False
                raise
            finally:
                streams.sent(key)
                streams.release(host)
                _log_call(method, context, start, sent, raised)

        return stream


def _deny(method: str) -> grpc.RpcMethodHandler:
    """A handler that refuses the call without reading its request: request-streaming, so the server never
    posts a read, whatever the method's real shape (the client sees only the status)."""

    def refuse(request_iterator, context):
        _log_call(method, context, time.perf_counter(), 0, False, grpc.StatusCode.UNAUTHENTICATED)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    return grpc.stream_stream_rpc_method_handler(refuse)


def _log_call(method: str, context, start: float, messages: int, raised: bool, code=None) -> None:
    if code is None:
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


class Health(health_pb2_grpc.HealthServicer):
    """grpc.health.v1.Health. Watch holds no worker (it registers a send callback and returns), and no lock
    is held while sending: grpc_health's servicer sends under its lock, which deadlocks the server when a
    Watch is cancelled while another one starts."""

    def __init__(self):
        self._lock = threading.Lock()
        self._status: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._watchers: dict[str, set[Callable]] = {}
        self._draining = False

    def Check(self, request, context):
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request, context, send_response_callback=None):
        service, send = request.service, send_response_callback
        with self._lock:
            status = self._status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            self._watchers.setdefault(service, set()).add(send)
        context.add_callback(lambda: self._forget(service, send))
        send(health_pb2.HealthCheckResponse(status=status))

    Watch.experimental_non_blocking = True
    Watch.experimental_thread_pool = None

    def _forget(self, service: str, send: Callable) -> None:
        with self._lock:
            self._watchers.get(service, set()).discard(send)

    def set(self, service: str, status: int) -> None:
        with self._lock:
            if self._draining:
                return
            self._status[service] = status
            watchers = list(self._watchers.get(service, ()))
        for send in watchers:
            send(health_pb2.HealthCheckResponse(status=status))

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every service, for good."""
        with self._lock:
            services = list(self._status)
        for service in services:
            self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        with self._lock:
            self._draining = True


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
        health_hook: Callable[[Callable[[bool], None]], None] | None = None,
    ):
        """`health_hook(set_serving)` hands the core a function that reports every service (NOT_)SERVING,
        e.g. while a store behind it is unreachable."""
        self.options = options
        self._on_drain = on_drain
        self._stopped = threading.Event()
        self._interceptor = _Interceptor(options)
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=options.max_workers),
            interceptors=[self._interceptor],
            options=options.grpc_options(),
        )
        service_names = list(register(self.grpc_server))
        self.health = Health()
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
        self.service_names = service_names
        self.set_serving(True)
        if health_hook is not None:
            health_hook(self.set_serving)
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

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def stop(self, grace_s: float | None = None) -> None:
        """Graceful: report NOT_SERVING, let streams end after their current message, wait for in-flight calls."""
        if self._stopped.is_set():
            return
        self.health.enter_graceful_shutdown()
        if self._on_drain is not None:
            self._on_drain()
        grace = self.options.grace_s if grace_s is None else grace_s
        self.grpc_server.stop(grace).wait()
        self._interceptor.close()
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
