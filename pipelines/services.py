"""Local service processes for the pipeline's train step: start, health-check, stop (never orphaned).

Every child runs in its own session (process group), so stopping it also stops what it spawned
(torchrun's worker ranks); `ProcessGroup` stops all of them on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gemrec.components.common.ports import LOCALHOST, free_ports, port_in_use


class ServiceError(RuntimeError):
    """A local service could not start or died: the message names it and quotes its log."""


def claim_ports(wanted: Sequence[tuple[int, str]]) -> list[int]:
    """Each (port, what) pair's port, or for 0 a free one; all distinct. ServiceError names a taken or shared port."""
    given = {port for port, _ in wanted if port}
    spare = iter(port for port in free_ports(len(wanted)) if port not in given)  # enough: <= len(given) dropped
    claimed: dict[int, str] = {}
    for port, what in wanted:
        if port == 0:
            port = next(spare)
        elif port in claimed:
            raise ServiceError(f"the {claimed[port]} and the {what} cannot share port {port}")
        elif port_in_use(port):
            raise ServiceError(f"port {port} on {LOCALHOST} is already in use (wanted by the {what})")
        claimed[port] = what
    return list(claimed)


def claim_port(port: int, what: str) -> int:
    """`port`, or a free one when 0; raise ServiceError naming `what` when it is taken."""
    return claim_ports([(port, what)])[0]


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


def gemrec_executable() -> str:
    """The `gemrec` console script of this interpreter's environment (no reliance on PATH)."""
    script = Path(sys.executable).parent / "gemrec"
    return str(script) if script.is_file() else shutil.which("gemrec") or "gemrec"


def gemrec_command(*args: str) -> list[str]:
    return [gemrec_executable(), *args]


class Process:
    """A child process in its own session with its output in a log file."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        log_path: Path | None,
        env: dict[str, str] | None = None,
        echo: bool = False,
    ):
        """`log_path` None: the child writes to our stdout and stderr directly."""
        self.name, self.command, self.log_path = name, list(command), log_path
        self._log = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log_path, "ab")  # closed in stop()
        self.popen = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE if echo else self._log,
            stderr=subprocess.STDOUT if self._log or echo else None,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stream(self, progress_every_s: float = 5.0) -> int:
        """Copy the child's output to our stdout (and its log) until it exits; return its exit code.

        Progress bars redraw a line with carriage returns; through a pipe that would be one endless
        line, so every `progress_every_s` the current state is printed as a line of its own.
        """
        assert self.popen.stdout is not None
        pending, last_progress = b"", 0.0
        while chunk := self.popen.stdout.read1(65536):
            if self._log:
                self._log.write(chunk)
            pending += chunk.replace(b"\r\n", b"\n")
            while (cut := min((i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0), default=-1)) >= 0:
                line, separator, pending = pending[:cut], pending[cut : cut + 1], pending[cut + 1 :]
                if separator == b"\n":
                    self._echo(line)
                elif line.strip() and time.monotonic() - last_progress >= progress_every_s:
                    self._echo(line)
                    last_progress = time.monotonic()
        if pending.strip():
            self._echo(pending)
        if self._log:
            self._log.flush()
        return self.popen.wait()

    @staticmethod
    def _echo(line: bytes) -> None:
        sys.stdout.buffer.write(line + b"\n")
        sys.stdout.flush()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the whole process group (graceful shutdown), SIGKILL after `grace_s`."""
        self.terminate()
        self.finish(time.monotonic() + grace_s)

    def terminate(self) -> None:
        if self.alive():
            self._signal(signal.SIGTERM)

    def finish(self, deadline: float) -> None:
        """Wait for the exit until `deadline` (monotonic), then SIGKILL what is left of the group."""
        try:
            self.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.popen.wait(timeout=10)
        # The leader may be gone while children of its group linger.
        self._signal(signal.SIGKILL)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        if self._log:
            self._log.close()

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)


def wait_serving(process: Process, address: str, timeout_s: float = 120.0) -> None:
    """Block until the gRPC server at `address` reports SERVING; fail fast if its process dies."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if not process.alive():
                raise ServiceError(
                    f"the {process.name} exited with code {process.popen.returncode} before "
                    f"serving on {address}; last lines of {process.log_path}:\n"
                    f"{tail(process.log_path)}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"the {process.name} did not serve on {address} within {timeout_s:.0f} s; "
                    f"last lines of {process.log_path}:\n{tail(process.log_path)}"
                )
            time.sleep(0.1)


class ProcessGroup(contextlib.AbstractContextManager):
    """Owns child processes; leaving the block stops them all, whatever happened."""

    def __init__(self, grace_s: float = 10.0):
        self.processes: list[Process] = []
        self.grace_s = grace_s
        self._previous_sigterm = None

    def __enter__(self) -> ProcessGroup:
        # A SIGTERM to this step (pipeline cancelled) must still run the cleanup below.
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        return self

    def start(
        self,
        name: str,
        command: Sequence[str],
        log_path: Path | None,
        env: dict[str, str] | None = None,
        echo: bool = False,
    ) -> Process:
        process = Process(name, command, log_path, env=env, echo=echo)
        self.processes.append(process)
        return process

    def start_service(
        self, name: str, command: Sequence[str], address: str, log_path: Path, timeout_s: float = 120.0
    ) -> Process:
        process = self.start(name, command, log_path)
        wait_serving(process, address, timeout_s=timeout_s)
        return process

    def stop_all(self) -> None:
        """SIGTERM to all at once (they shut down in parallel), then wait, newest first."""
        for process in reversed(self.processes):
            process.terminate()
        deadline = time.monotonic() + self.grace_s
        while self.processes:
            self.processes.pop().finish(deadline)

    def __exit__(self, *exc) -> None:
        self.stop_all()
        signal.signal(signal.SIGTERM, self._previous_sigterm or signal.SIG_DFL)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
