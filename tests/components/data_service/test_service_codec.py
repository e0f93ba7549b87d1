"""The hand-written BatchMessage serializer against the generated protobuf parser, and zero-copy decoding."""

import time

import numpy as np
import pytest
import torch
from gemrec.components.data_service.codec import decode_batch, serialize_batch
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.feature_service.wire import from_array
from gemrec.proto.gemrec.v1 import data_pb2

TENSORS = (
    "user_ids",
    "item_ids",
    "timestamps",
    "labels",
    "dense_features",
    "seq_offsets",
    "seq_item_ids",
    "seq_timestamps",
    "seq_actions",
)


@pytest.fixture(scope="module")
def ds(synth_dataset):
    return Dataset.open(synth_dataset)


@pytest.mark.parametrize("rows", [np.arange(0, 400, 3), np.array([5]), np.array([], dtype=np.int64)])
def test_serialized_batch_parses_to_the_same_arrays(ds, rows):
    batch = ds.collate("train", rows, 300)
    fields = dict(
        cursor=b"\x00cursor\xff",
        epoch=3,
        step=2**40,
        num_steps=7,
        cost_imbalance=1.25,
        tokens_imbalance=1.0,
        sq_tokens_imbalance=2.5,
        naive_cost_imbalance=3.0,
    )
    message = data_pb2.BatchMessage.FromString(serialize_batch(batch, **fields))
    for name in TENSORS:
        want = getattr(batch, name).numpy()
        got = from_array(getattr(message, name))
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    for name, value in fields.items():
        assert getattr(message, name) == value
    assert message.max_seq_len == batch.max_seq_len and tuple(message.label_names) == batch.label_names
    kjt = message.seq_item_features
    assert list(kjt.keys) == batch.seq_item_features.keys() and kjt.stride == batch.seq_item_features.stride()
    np.testing.assert_array_equal(from_array(kjt.values), batch.seq_item_features.values().numpy())

    decoded, info = decode_batch(message.SerializeToString())
    assert info.cursor == fields["cursor"] and info.step == 2**40 and info.cost_imbalance == 1.25
    for name in TENSORS:
        assert torch.equal(getattr(decoded, name), getattr(batch, name)), name
    for name in ("sparse_features", "seq_item_features"):
        a, b = getattr(decoded, name), getattr(batch, name)
        assert a.keys() == b.keys() and torch.equal(a.values(), b.values()) and torch.equal(a.lengths(), b.lengths())
    assert decoded.cursor == fields["cursor"]


def test_decoding_does_not_copy(ds):
    data = serialize_batch(ds.collate("train", np.arange(64), 100))
    batch, _ = decode_batch(data)
    start = np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0]
    for name in TENSORS:
        tensor = getattr(batch, name)
        if tensor.numel():
            assert start <= tensor.data_ptr() < start + len(data), name
    del data
    assert torch.equal(batch.seq_offsets, ds.collate("train", np.arange(64), 100).seq_offsets)  # views keep it alive


@pytest.mark.parametrize("data", [b"\x0a\xff", b"\x0a\x05abc", b"\x0b", b"\x0a\x00"])
def test_malformed_messages_raise_value_error(data):
    with pytest.raises(ValueError):
        decode_batch(data)


def test_negative_values_round_trip(ds):
    batch = ds.collate("train", np.arange(4), 10)
    batch.timestamps = torch.tensor([-5, 0, 2**62, -(2**63)])
    message = data_pb2.BatchMessage.FromString(serialize_batch(batch, epoch=-1))
    assert message.epoch == -1
    np.testing.assert_array_equal(from_array(message.timestamps), batch.timestamps.numpy())


def test_build_cpu_time_travels_in_the_message(ds):
    """The service's CPU seconds per batch (field 22): parsed by the generated class and by decode_batch; a
    message without it (an older server) decodes to 0."""
    start = time.thread_time()
    batch = ds.collate("train", np.arange(2000), 300)
    data = serialize_batch(batch, cpu_start=start)
    spent = time.thread_time() - start
    message = data_pb2.BatchMessage.FromString(data)
    assert 0 < message.build_cpu_s <= spent
    assert decode_batch(data)[1].build_cpu_s == message.build_cpu_s
    assert decode_batch(serialize_batch(batch))[1].build_cpu_s == 0.0
