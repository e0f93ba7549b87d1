import shutil
import subprocess
import time

import pytest
from gemrec.components.common.ports import free_port


def start_redis(port: int, workdir) -> subprocess.Popen:
    """A redis-server on 127.0.0.1:port (no persistence unless told to SAVE into `workdir`), up and answering."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (make system-deps installs it)")
    import redis

    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    client = redis.Redis(port=port)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return proc
            except (redis.ConnectionError, redis.BusyLoadingError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"redis-server on port {port} did not start") from None
                time.sleep(0.05)
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_starter():
    """`start_redis(port, workdir)`, for tests that stop and restart their own redis-server."""
    return start_redis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A private redis-server on a free 127.0.0.1 port (no persistence), stopped at the end."""
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
