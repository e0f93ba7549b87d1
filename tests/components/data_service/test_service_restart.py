"""`gemrec serve data` as a real process: SIGKILL it mid-stream, restart it on the same port, and the client's
epoch is still exactly the split (no example lost, none repeated). Graceful drains are in test_service_stream."""

import signal
import socket
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest
from gemrec.components.common.grpc_channel import open_channel, wait_healthy
from gemrec.components.data_service.client import DataClient
from gemrec.components.data_service.dataset import Dataset

SPLIT = "eval"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(dataset, port: int, log) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gemrec.cli",
            "serve",
            "data",
            "--dataset",
            str(dataset),
            "--port",
            str(port),
            "--grace-s",
            "5",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    with open_channel(f"127.0.0.1:{port}") as channel:
        try:
            wait_healthy(channel, timeout_s=90)
        except TimeoutError:
            proc.kill()
            raise
    return proc


def _keys(batch):
    return list(zip(batch.user_ids.tolist(), batch.timestamps.tolist(), batch.item_ids.tolist()))


@pytest.fixture(scope="module")
def split_keys(movielens_dataset):
    ds = Dataset.open(movielens_dataset)
    return Counter(_keys(ds.collate(SPLIT, np.arange(ds.num_examples(SPLIT)), 1)))


def test_server_dies_mid_stream_and_client_resumes_exactly(movielens_dataset, split_keys, tmp_path):
    """SIGKILL at batch 5; a new server starts on the same port while the client keeps iterating."""
    port = _free_port()
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115
    procs = [_start(movielens_dataset, port, log)]
    exits = []

    def restart(sig):
        procs[-1].send_signal(sig)
        exits.append(procs[-1].wait(timeout=30))
        procs.append(_start(movielens_dataset, port, log))

    seen: Counter = Counter()
    client = DataClient(
        f"127.0.0.1:{port}",
        SPLIT,
        rank=0,
        world_size=1,
        batch_size=200,
        max_seq_len=128,
        epoch=0,
        seed=4,
        prefetch=1,
        max_retries=40,
        max_backoff_s=1.0,
    )
    try:
        for i, batch in enumerate(client):
            seen.update(_keys(batch))
            if i == 5:
                restarter = threading.Thread(target=restart, args=(signal.SIGKILL,))
                restarter.start()
        restarter.join()
    finally:
        client.close()
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        log.close()
    assert exits == [-signal.SIGKILL] and len(procs) == 2
    assert procs[-1].returncode == 0  # SIGTERM: graceful stop, logged
    assert '"event": "stopped"' in (tmp_path / "server.log").read_text()
    assert client.reconnects >= 1
    assert seen == split_keys
