"""The trainer's data path on the CPU. DeviceFeed: every batch once, in order, with its stream state; errors after
the batches before them; read-ahead bounded by depth; the time the consumer waited (the overlap of copies with
steps is measured on the GPU: infra/bench/h200_session.sh, part `services`). RemoteStream: full global batches
only, epoch after epoch, resumable from its state, through DeviceFeed from a real data service."""

import threading
import time

import pytest
import torch
from gemrec.components.data_service.batch import Batch
from gemrec.components.trainer.data import DeviceFeed
from gemrec.jagged import JaggedFeatures


def make_batch(i: int) -> Batch:
    ids = torch.full((2,), i, dtype=torch.long)
    return Batch(
        user_ids=ids,
        item_ids=ids,
        timestamps=ids,
        labels=torch.zeros(2, 1),
        dense_features=torch.zeros(2, 0),
        sparse_features=JaggedFeatures(["user_id"], ids, torch.ones(2, dtype=torch.long)),
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
    # handed out 1; then up to 2 x depth read ahead (copying, or packed and waiting)
    assert 1 + 3 <= len(reads) <= 1 + 2 * 3
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


def test_remote_stream_through_the_feed_gives_full_batches_once_per_epoch_and_resumes(synth_dataset):
    from collections import Counter

    from gemrec.components.common.grpc_server import Server, ServerOptions
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.data_service.service import DataLoaderCore, register
    from gemrec.components.trainer.data import DatasetStream, RemoteStream

    ds = Dataset.open(synth_dataset)
    core = DataLoaderCore(ds)
    server = Server(ServerOptions(port=0, max_workers=8), register(core))

    def keys(b):
        return Counter(zip(b.user_ids.tolist(), b.timestamps.tolist(), b.item_ids.tolist()))

    try:
        address, batch = f"127.0.0.1:{server.port}", 700
        stream = RemoteStream(address, batch, 32, seed=5)
        per_epoch = ds.num_examples("train") // batch
        assert stream.batches_per_epoch == per_epoch

        def with_state(s):
            for b in s:
                yield b, s.state()

        feed = DeviceFeed(with_state(stream), "cpu", depth=2)
        seen, states = Counter(), []
        for _, (host, _, state) in zip(range(per_epoch + 2), feed):
            assert host.batch_size == batch and stream.last_info.build_cpu_s > 0
            if len(states) < per_epoch:
                seen.update(keys(host))
            states.append(state)
        feed.close()
        epoch_rows = core.epoch_order("train", 0, 5, True)[: per_epoch * batch]
        assert seen == keys(ds.collate("train", epoch_rows, 1))  # epoch 0: its full global batches, each example once
        assert states[per_epoch - 1]["epoch"] == 0 and states[per_epoch]["epoch"] == 1  # the short batch is left out
        # Resume from the state after batch 3: the same batches follow.
        resumed = RemoteStream(address, batch, 32, seed=5)
        resumed.load_state(states[2])
        again = RemoteStream(address, batch, 32, seed=5)
        first = [b for _, b in zip(range(5), again)]
        assert [b.user_ids.tolist() for _, b in zip(range(2), resumed)] == [b.user_ids.tolist() for b in first[3:5]]
        # The in-process stream reads the same examples step by step (gpu_bench --dataset stages these batches).
        local = DatasetStream(ds, batch, 32, seed=5, prefetch=0)
        assert [keys(b) for _, b in zip(range(5), local)] == [keys(b) for b in first]
    finally:
        server.stop(0)


def _tensors_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_packed_batch_is_one_buffer_holding_every_tensor_as_before():
    lengths = torch.tensor([3, 0, 2, 1, 1, 0])
    features = JaggedFeatures(["a", "b"], torch.arange(7, dtype=torch.int32), lengths, 3, torch.rand(7))
    batch = make_batch(5)
    batch.labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    batch.seq_actions = torch.ones(2, 3, dtype=torch.bool)  # 6 bytes: the next tensor starts realigned
    batch.seq_item_features = features
    packed = batch.packed()
    assert packed.buffer.dtype == torch.uint8 and packed.buffer.dim() == 1
    again, buffer = packed.to("cpu")
    for name in ("user_ids", "labels", "dense_features", "seq_offsets", "seq_actions", "seq_timestamps"):
        for got in (getattr(packed.batch, name), getattr(again, name)):
            assert _tensors_equal(got, getattr(batch, name)), name
            assert got.untyped_storage().data_ptr() in (
                packed.buffer.untyped_storage().data_ptr(),
                buffer.untyped_storage().data_ptr(),
            )
            assert got.data_ptr() % 16 == 0
    for got in (packed.batch.seq_item_features, again.seq_item_features):
        assert isinstance(got, JaggedFeatures) and got.keys() == ["a", "b"] and got.stride() == 3
        assert _tensors_equal(got.values(), features.values()) and _tensors_equal(got.lengths(), lengths)
        assert _tensors_equal(got.weights_or_none(), features.weights_or_none())
    assert again.max_seq_len == batch.max_seq_len and again.cursor == batch.cursor
    # writing the original afterwards leaves the packed copy alone
    batch.user_ids += 1
    assert int(packed.batch.user_ids[0]) == 5


def test_packed_batch_keeps_torchrec_keyed_jagged_tensors():
    pytest.importorskip("torchrec")
    from gemrec.components.data_service.batch import keyed_jagged

    batch = make_batch(2)
    batch.sparse_features = keyed_jagged(["u", "i"], torch.arange(5), torch.tensor([2, 1, 0, 2]), stride=2)
    again, _ = batch.packed().to("cpu")
    got = again.sparse_features
    assert type(got) is type(batch.sparse_features) and got.keys() == ["u", "i"] and got.stride() == 2
    assert _tensors_equal(got.values(), torch.arange(5)) and got.weights_or_none() is None
    assert _tensors_equal(got.lengths(), torch.tensor([2, 1, 0, 2]))
