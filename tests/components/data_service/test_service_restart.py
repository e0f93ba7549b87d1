"""`gemrec serve data` as a real process: SIGKILL it mid-stream, restart it on the same port, and the client's
epoch is still exactly the split (no example lost, none repeated); SIGSTOP it, and the client waits visibly,
then resumes exactly after SIGCONT or fails with a clear timeout. Graceful drains are in test_service_stream."""

import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
from gemrec.components.common.grpc_channel import open_channel, wait_healthy
from gemrec.components.common.ports import free_port
from gemrec.components.data_service.client import DataClient, DataServiceTimeout
from gemrec.components.data_service.dataset import Dataset

SPLIT = "eval"


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
    port = free_port()
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


def _client(port: int, **kw) -> DataClient:
    return DataClient(f"127.0.0.1:{port}", SPLIT, batch_size=200, max_seq_len=128, seed=4, prefetch=1, **kw)


def test_stopped_server_is_waited_for_visibly_and_resumed_exactly(movielens_dataset, split_keys, tmp_path, caplog):
    """SIGSTOP at batch 3 (a wedged server: connections stay open, nothing arrives): the client warns while it
    waits, cancels the stalled stream, keeps reconnecting; after SIGCONT it resumes from its cursor."""
    port = free_port()
    with open(tmp_path / "server.log", "w") as log:
        proc = _start(movielens_dataset, port, log)
        client = _client(port, stall_s=1.0, warn_every_s=0.5, wait_timeout_s=60, max_backoff_s=0.5)
        seen: Counter = Counter()
        timer = threading.Timer(4.0, proc.send_signal, (signal.SIGCONT,))
        try:
            with caplog.at_level("WARNING", logger="gemrec.data_client"):
                for i, batch in enumerate(client):
                    seen.update(_keys(batch))
                    if i == 3:
                        proc.send_signal(signal.SIGSTOP)
                        timer.start()
        finally:
            timer.join()
            client.close()
            proc.terminate()
            proc.wait(timeout=30)
    assert seen == split_keys
    assert client.reconnects >= 1
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"waiting for the data service at 127.0.0.1:{port}: no batch for") for m in messages)
    assert any("no batch for 1 s; reconnect" in m for m in messages), messages


def test_stopped_server_fails_the_client_after_its_timeout(movielens_dataset, tmp_path):
    """A server that never comes back: a clear DataServiceTimeout after wait_timeout_s, not a hang."""
    port = free_port()
    with open(tmp_path / "server.log", "w") as log:
        proc = _start(movielens_dataset, port, log)
        client = _client(port, stall_s=0.5, warn_every_s=0.5, wait_timeout_s=3.0, max_backoff_s=0.2)
        try:
            batches = iter(client)
            next(batches)
            proc.send_signal(signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(DataServiceTimeout, match=rf"data service at 127.0.0.1:{port} for [34] s"):
                for _ in batches:
                    pass
            assert time.monotonic() - start < 10
        finally:
            client.close()
            proc.kill()
            proc.wait(timeout=30)
