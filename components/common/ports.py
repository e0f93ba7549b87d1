"""Free TCP ports on 127.0.0.1 for local servers (tests, benchmarks, the local pipeline)."""

from __future__ import annotations

import contextlib
import socket

LOCALHOST = "127.0.0.1"


def free_ports(count: int) -> list[int]:
    """`count` distinct ports the OS reports free, all held bound until every one is chosen."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind((LOCALHOST, 0))
            ports.append(sock.getsockname()[1])
        return ports


def free_port() -> int:
    return free_ports(1)[0]


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOCALHOST, port))
        except OSError:
            return True
    return False
