"""Feature stores against the dataset reader: memory == Dataset.lookup, Redis == memory, histories."""

import numpy as np
import pytest
from gemrec.components.common.grpc_server import InvalidArgument, NotFound
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.feature_service.store import MemoryStore, RedisStore, cut_histories, materialize


@pytest.fixture(scope="module")
def ds(movielens_dataset):
    return Dataset.open(movielens_dataset)


@pytest.fixture(scope="module")
def memory(movielens_dataset):
    return MemoryStore(movielens_dataset)


@pytest.fixture(scope="module")
def redis_store(memory, redis_url):
    report = materialize(memory, redis_url, chunk=1000, progress=False)
    assert report["fields"] > 0
    store = RedisStore(redis_url, memory.schema.dataset_checksum)
    yield store
    store.close()


def _assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        for got, want in zip(a[name], b[name]):
            assert got.dtype == want.dtype, name
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_schema_follows_manifest(memory, ds):
    item = memory.schema.entities["item"]
    assert item.num_ids == ds.manifest["num_items"] and memory.schema.entities["user"].num_ids == 610
    specs = {f["name"]: f for f in ds.manifest["sparse_features"] if f["source"] == "item"}
    for name, spec in specs.items():
        assert item.features[name].multi_valued == spec["multi_valued"]
        assert item.features[name].num_embeddings == spec["num_embeddings"]
        assert item.features[name].dtype == "int64"


@pytest.mark.parametrize("entity", ["user", "item"])
def test_memory_store_matches_dataset_lookup(memory, ds, entity):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, memory.schema.entities[entity].num_ids, size=300)
    ids[:3] = [0, memory.schema.entities[entity].num_ids - 1, 0]  # edges and a repeat
    names = list(memory.schema.entities[entity].features)
    _assert_same(memory.lookup(entity, ids, names), ds.lookup(entity, ids, names))
    assert {n: v[0].size for n, v in memory.lookup(entity, ids[:0], names).items()} == dict.fromkeys(names, 0)


@pytest.mark.parametrize("entity", ["user", "item"])
def test_redis_store_equals_memory_store(memory, redis_store, entity):
    ids = np.arange(memory.schema.entities[entity].num_ids)[::-1]
    _assert_same(redis_store.lookup(entity, ids), memory.lookup(entity, ids))
    ids = np.array([5, 5, 0])
    _assert_same(redis_store.lookup(entity, ids, []), memory.lookup(entity, ids, []))


def test_histories_match_dataset_and_redis(memory, redis_store, ds):
    users = np.arange(610)
    rng = np.random.default_rng(1)
    before = rng.integers(ds.manifest["time_range"][0], ds.manifest["time_range"][1] + 2, size=610)
    got = memory.user_history(users, before, 40)
    for u in range(0, 610, 7):
        want = ds.user_history(u, int(before[u]), 40)
        part = slice(got["offsets"][u], got["offsets"][u + 1])
        for key in ("items", "item_ids", "timestamps", "actions"):
            np.testing.assert_array_equal(got[key][part], want[key], err_msg=f"user {u} {key}")
    from_redis = redis_store.user_history(users, before, 40)
    for key in got:
        np.testing.assert_array_equal(from_redis[key], got[key], err_msg=key)


def test_cut_histories_is_strictly_before_and_most_recent():
    starts, ends = np.array([0, 4, 4]), np.array([4, 4, 7])
    timestamps = np.array([1, 2, 2, 5, 3, 3, 9])
    first, lengths = cut_histories(starts, ends, timestamps, np.array([2, 10, 3]), max_len=2)
    np.testing.assert_array_equal(first, [0, 4, 4])
    np.testing.assert_array_equal(lengths, [1, 0, 0])
    first, lengths = cut_histories(starts, ends, timestamps, np.array([6, 0, 10]), max_len=2)
    np.testing.assert_array_equal(first, [2, 4, 5])
    np.testing.assert_array_equal(lengths, [2, 0, 2])


def test_bad_lookups_name_the_problem(memory, redis_store):
    for store in (memory, redis_store):
        with pytest.raises(NotFound, match="unknown entity 'movie'"):
            store.lookup("movie", np.array([1]))
        with pytest.raises(NotFound, match="unknown feature 'color'"):
            store.lookup("item", np.array([1]), ["item_genres", "color"])
        with pytest.raises(NotFound, match="item id 9742 not found"):
            store.lookup("item", np.array([1, 9742]))
        with pytest.raises(NotFound, match="user id -1 not found"):
            store.user_history(np.array([-1]), np.array([0]), 5)
        with pytest.raises(InvalidArgument, match="2 timestamps for 3 users"):
            store.user_history(np.array([1, 2, 3]), np.array([0, 0]), 5)
        with pytest.raises(InvalidArgument, match="max_len must be positive"):
            store.user_history(np.array([1]), np.array([0]), 0)


def test_redis_store_needs_materialization(redis_url):
    with pytest.raises(FileNotFoundError, match="gemrec serve materialize"):
        RedisStore(redis_url, "sha256:not-materialized")


def test_stores_match_dataset_on_synthetic_hashed_ids(synth_dataset, redis_url):
    ds, memory = Dataset.open(synth_dataset), MemoryStore(synth_dataset)
    materialize(memory, redis_url, progress=False)
    redis_store = RedisStore(redis_url, memory.schema.dataset_checksum)
    try:
        for entity in ("user", "item"):
            ids = np.random.default_rng(2).integers(0, memory.schema.entities[entity].num_ids, size=500)
            names = list(memory.schema.entities[entity].features)
            _assert_same(memory.lookup(entity, ids, names), ds.lookup(entity, ids, names))
            _assert_same(redis_store.lookup(entity, ids, names), ds.lookup(entity, ids, names))
    finally:
        redis_store.close()
