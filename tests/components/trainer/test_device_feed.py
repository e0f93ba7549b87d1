"""DeviceFeed on the CPU: every batch once, in order, with its stream state; errors after the batches before
them; read-ahead bounded by depth; the time the consumer waited. (The overlap of copies with steps is
measured on the GPU: infra/bench/h200_session.sh, part `services`.)"""

import threading
import time

import pytest
import torch
from gemrec.components.data_service.batch import Batch, KeyedJagged
from gemrec.components.trainer.data import DeviceFeed


def make_batch(i: int) -> Batch:
    ids = torch.full((2,), i, dtype=torch.long)
    return Batch(
        user_ids=ids,
        item_ids=ids,
        timestamps=ids,
        labels=torch.zeros(2, 1),
        dense_features=torch.zeros(2, 0),
        sparse_features=KeyedJagged(["user_id"], ids, torch.ones(2, dtype=torch.long)),
        seq_offsets=torch.tensor([0, 1, 2]),
        seq_item_ids=ids,
        seq_timestamps=ids,
        seq_actions=torch.zeros(2, 1),
        seq_item_features=None,
        max_seq_len=1,
    )


def source(n: int, reads: list | None = None, delay_s: float = 0.0, fail_at: int | None = None):
    for i in range(n):
        if i == fail_at:
            raise RuntimeError(f"source broke at {i}")
        if delay_s:
            time.sleep(delay_s)
        if reads is not None:
            reads.append(i)
        yield make_batch(i), {"position": i + 1}


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_every_batch_once_in_order_with_its_state(depth):
    feed = DeviceFeed(source(23), "cpu", depth=depth)
    got = [(int(host.user_ids[0]), int(dev.user_ids[0]), state["position"]) for host, dev, state in feed]
    assert got == [(i, i, i + 1) for i in range(23)]
    assert len(feed.waits) == 23 and all(w >= 0 for w in feed.waits)
    with pytest.raises(StopIteration):
        next(feed)
    feed.close()


def test_source_error_arrives_after_the_batches_before_it():
    feed = DeviceFeed(source(10, fail_at=6), "cpu", depth=3)
    seen = []
    with pytest.raises(RuntimeError, match="source broke at 6"):
        for host, _, _ in feed:
            seen.append(int(host.user_ids[0]))
    assert seen == list(range(6))
    feed.close()


def test_read_ahead_is_bounded_by_depth():
    reads: list[int] = []
    feed = DeviceFeed(source(50, reads), "cpu", depth=3)
    next(feed)
    time.sleep(0.3)  # the reader fills what it may
    # handed out 1; up to depth copying and depth pinned; one more held by the reader, waiting for room
    assert 1 + 3 <= len(reads) <= 1 + 2 * 3 + 1
    feed.close()
    assert not any(t.name == "device-feed" and t.is_alive() for t in threading.enumerate())


def test_waits_measure_a_slow_source():
    feed = DeviceFeed(source(6, delay_s=0.05), "cpu", depth=2)
    list(feed)
    assert min(feed.waits[1:]) > 0.02  # the consumer outruns the source: each batch is waited for
    fast = DeviceFeed(source(6), "cpu", depth=2)
    next(fast)
    time.sleep(0.1)  # the rest is read ahead
    for _ in fast:
        pass
    assert max(fast.waits[1:3]) < 0.02
    feed.close()
    fast.close()


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        DeviceFeed(source(1), "cpu", depth=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_are_the_pinned_batches_in_order():
    feed = DeviceFeed(source(12), "cuda", depth=3)
    for i, (host, on_device, state) in enumerate(feed):
        assert host.user_ids.is_pinned() and on_device.user_ids.is_cuda and state["position"] == i + 1
        assert on_device.sparse_features.values().is_cuda
        assert int(on_device.user_ids.sum()) == 2 * i  # read on the compute stream, after the copy
    feed.close()
