"""Requests that ask for far more than they send: bounded from the request before the work is done."""

import time

import grpc
import numpy as np
import pytest
from gemrec.components.common.grpc_channel import open_channel
from gemrec.components.common.grpc_server import ResourceExhausted, Server, ServerOptions
from gemrec.components.feature_service.service import FeatureServiceCore, register
from gemrec.components.feature_service.store import MemoryStore, RedisStore, materialize
from gemrec.proto.gemrec.v1 import features_pb2, features_pb2_grpc


@pytest.fixture(scope="module")
def memory(movielens_dataset):
    return MemoryStore(movielens_dataset)


@pytest.fixture(scope="module")
def heaviest_user(memory) -> int:
    return int(np.argmax(memory.timeline_lengths(np.arange(memory.schema.entities["user"].num_ids))))


@pytest.fixture(scope="module")
def stub(memory):
    server = Server(ServerOptions(port=0, max_message_mb=1), register(FeatureServiceCore(memory, max_response_mb=1)))
    channel = open_channel(f"127.0.0.1:{server.port}")
    yield features_pb2_grpc.FeatureServiceStub(channel)
    channel.close()
    server.stop(0)


def _ids(ids) -> bytes:
    return np.asarray(ids, dtype="<i8").tobytes()


def test_repeated_user_with_huge_max_len_is_refused_from_the_stored_lengths(stub, heaviest_user):
    request = features_pb2.GetUserHistoryRequest(
        users=_ids([heaviest_user] * 512), before_timestamps=_ids([2**32 - 1]), max_len=65536
    )
    start = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        stub.GetUserHistory(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "estimated" in err.value.details() and "max_len" in err.value.details()
    assert time.perf_counter() - start < 5


class _RecordingStore(MemoryStore):
    """The real memory store, recording the feature names each lookup is asked for."""

    asked: list

    def lookup(self, entity, ids, names=None):
        self.asked.append(list(names))
        return super().lookup(entity, ids, names)


def test_repeated_feature_names_are_looked_up_once(movielens_dataset):
    store = _RecordingStore(movielens_dataset)
    store.asked = []
    core = FeatureServiceCore(store)
    got = core.get_features("item", np.arange(100), ["item_tags"] * 1000 + ["item_year", "item_tags"])
    assert store.asked == [["item_tags", "item_year"]] and list(got) == ["item_tags", "item_year"]


def test_feature_response_over_the_limit_is_refused_before_the_lookup(memory):
    core = FeatureServiceCore(memory, max_response_mb=1)
    ids = np.zeros(40_000, dtype=np.int64)  # 40k x 4 features: ~2.6 MB of values and lengths
    with pytest.raises(ResourceExhausted, match="estimated"):
        core.get_features("item", ids, [])
    assert set(core.get_features("item", ids[:1000], [])) == set(memory.schema.entities["item"].features)


def test_duplicate_users_get_their_own_histories(memory, heaviest_user):
    users = np.array([heaviest_user, 3, heaviest_user, heaviest_user])
    before = np.array([1_200_000_000, 1_500_000_000, 2**32 - 1, 1_300_000_000])
    got = memory.user_history(users, before, 50)
    for i, (user, ts) in enumerate(zip(users, before)):
        one = memory.user_history(np.array([user]), np.array([ts]), 50)
        part = slice(got["offsets"][i], got["offsets"][i + 1])
        for key in ("items", "item_ids", "timestamps", "actions"):
            np.testing.assert_array_equal(got[key][part], one[key], err_msg=f"row {i} {key}")


def test_redis_history_bound_counts_whole_timelines(memory, redis_url, heaviest_user):
    """Redis returns whole timelines, so the bound covers them even when max_len is small."""
    materialize(memory, redis_url, progress=False)
    store = RedisStore(redis_url, memory.schema.dataset_checksum)
    try:
        np.testing.assert_array_equal(
            store.timeline_lengths(np.array([heaviest_user, 0])), memory.timeline_lengths(np.array([heaviest_user, 0]))
        )
        users = np.arange(memory.schema.entities["user"].num_ids)
        with pytest.raises(ResourceExhausted, match="estimated"):
            FeatureServiceCore(store, max_response_mb=1).user_history(users, np.array([2**32 - 1]), 1)
        assert len(
            FeatureServiceCore(memory, max_response_mb=1).user_history(users, np.array([2**32 - 1]), 1)["items"]
        ) == len(users)
    finally:
        store.close()
