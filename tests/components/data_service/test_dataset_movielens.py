"""The dataset layer on the real ml-latest-small: counts, checksums, split, vocabularies, leak-free histories."""

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from gemrec.components.data_service.builder import dataset_checksum
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.errors import DataError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def ds(movielens_dataset) -> Dataset:
    return Dataset.open(movielens_dataset)


@pytest.fixture(scope="module")
def ratings(movielens_raw) -> pd.DataFrame:
    """Raw ratings sorted like a timeline: (user, timestamp, movie)."""
    frame = pd.read_csv(movielens_raw / "ratings.csv")
    return frame.sort_values(["userId", "timestamp", "movieId"], kind="stable").reset_index(drop=True)


def test_manifest_counts_and_checksums(ds, movielens_dataset, movielens_raw):
    m = ds.manifest
    assert (m["num_events"], m["num_users"], m["num_items"]) == (100_836, 610, 9_742)
    assert m["labels"] == ["like", "love"] and m["actions"] == ["rating", "like", "love"]
    assert m["counts"]["duplicates_dropped"] == 0 and m["counts"]["unsorted_input_rows"] > 0
    assert sum(s["num_examples"] for s in m["splits"].values()) == 100_836
    listed = dict(reversed(line.split()) for line in (movielens_raw / "SHA256SUMS").read_text().splitlines())
    for name in ("ratings.csv", "movies.csv", "tags.csv"):
        assert m["checksums"][name] == "sha256:" + listed[name]
    assert m["dataset_checksum"] == dataset_checksum(movielens_dataset)
    features = {f["name"]: f for f in m["sparse_features"]}
    assert features["item_genres"]["multi_valued"] and features["item_genres"]["num_embeddings"] == 19
    assert m["max_seq_len"]["max"] == 2697  # user 414 has 2698 ratings at distinct times


def test_train_and_eval_are_disjoint_in_time(ds):
    train, evals = ds.example_timestamps("train"), ds.example_timestamps("eval")
    cutoff = ds.manifest["split"]["cutoff"]
    assert len(train) and len(evals)
    assert train.max() < cutoff <= evals.min()


def test_vocabulary_round_trip(ds, movielens_dataset, ratings):
    users = pq.read_table(movielens_dataset / "vocab" / "users.parquet").to_pandas()
    items = pq.read_table(movielens_dataset / "vocab" / "items.parquet").to_pandas()
    assert (users["index"].to_numpy() == np.arange(610)).all() and (items["index"].to_numpy() == np.arange(9742)).all()
    user_index = dict(zip(users["raw_id"].astype(int), users["index"]))
    item_index = dict(zip(items["raw_id"].astype(int), items["index"]))
    events = pq.read_table(movielens_dataset / "events.parquet").to_pandas()
    # Every raw rating maps through the vocabularies to exactly one stored event, in timeline order.
    assert (ratings["userId"].map(user_index).to_numpy() == events["user"].to_numpy()).all()
    assert (ratings["movieId"].map(item_index).to_numpy() == events["item"].to_numpy()).all()
    assert (ratings["timestamp"].to_numpy() == events["timestamp"].to_numpy()).all()
    assert np.allclose(events["rating"].to_numpy() * 5.0, ratings["rating"].to_numpy())
    raw_back = items["raw_id"].to_numpy()[events["item"].to_numpy()].astype(int)
    assert (raw_back == ratings["movieId"].to_numpy()).all()


def test_item_features_match_movies_csv(ds, movielens_dataset, movielens_raw):
    movies = pd.read_csv(movielens_raw / "movies.csv")
    items = pq.read_table(movielens_dataset / "vocab" / "items.parquet").to_pandas()
    genre_names = pq.read_table(movielens_dataset / "vocab" / "features" / "item_genres.parquet").to_pandas()
    toy_story = int(items.index[items["raw_id"] == "1"][0])
    values, lengths = ds.lookup("item", np.array([toy_story]), ["item_genres"])["item_genres"]
    assert lengths.tolist() == [5]
    names = set(genre_names["value"].to_numpy()[values])
    assert names == set(movies.loc[movies.movieId == 1, "genres"].iloc[0].split("|"))
    year = ds.lookup("item", np.array([toy_story]), ["item_year"])["item_year"][0]
    year_names = pq.read_table(movielens_dataset / "vocab" / "features" / "item_year.parquet").column("value")
    assert year_names[int(year[0])].as_py() == "1995-1999"


def _reference_history(ratings: pd.DataFrame, user_raw: int, ts: int, max_len: int) -> pd.DataFrame:
    rows = ratings[(ratings.userId == user_raw) & (ratings.timestamp < ts)]
    return rows.iloc[max(0, len(rows) - max_len) :]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    split=st.sampled_from(["train", "eval"]),
    seed=st.integers(0, 2**31),
    batch=st.integers(1, 12),
    max_seq_len=st.sampled_from([0, 1, 3, 50, 4096]),
)
def test_no_history_event_at_or_after_the_target(ds, ratings, movielens_dataset, split, seed, batch, max_seq_len):
    users = pq.read_table(movielens_dataset / "vocab" / "users.parquet").column("raw_id").to_pylist()
    items = pq.read_table(movielens_dataset / "vocab" / "items.parquet").column("raw_id").to_pylist()
    rows = np.random.default_rng(seed).integers(0, ds.num_examples(split), batch)
    b = ds.collate(split, rows, max_seq_len)
    offsets = b.seq_offsets.numpy()
    assert b.batch_size == batch and offsets[-1] == b.num_tokens
    for i in range(batch):
        target = int(b.timestamps[i])
        seq_ts = b.seq_timestamps[offsets[i] : offsets[i + 1]].numpy()
        assert (seq_ts < target).all()
        expected = _reference_history(ratings, int(users[int(b.user_ids[i])]), target, max_seq_len)
        got_items = [int(items[j]) for j in b.seq_item_ids[offsets[i] : offsets[i + 1]].tolist()]
        assert got_items == expected["movieId"].tolist()
        assert (seq_ts == expected["timestamp"].to_numpy()).all()


def test_collate_batch_contents(ds):
    rows = np.arange(0, 2000, 97)
    b = ds.collate("train", rows, 256)
    offsets = b.seq_offsets.numpy()
    lengths = np.diff(offsets)
    assert b.max_seq_len == lengths.max() <= 256
    assert b.labels.shape == (len(rows), 2) and b.label_names == ("like", "love")
    # The target's rating decides its labels; the history carries past ratings as actions.
    assert (b.labels[:, 1] <= b.labels[:, 0]).all()
    actions = b.seq_actions.numpy()
    assert actions.shape == (b.num_tokens, 3)
    assert ((actions[:, 1] == (actions[:, 0] >= 0.8 - 1e-6)) & (actions[:, 2] == (actions[:, 0] >= 0.9 - 1e-6))).all()
    kjt = b.sparse_features
    assert kjt.keys() == ["user_id", "item_id", "item_genres", "item_year", "item_tags"]
    assert kjt.stride() == len(rows)
    assert (kjt["item_id"].values() == b.item_ids).all() and (kjt["user_id"].values() == b.user_ids).all()
    seq = b.seq_item_features
    assert seq.stride() == b.num_tokens and seq.keys() == ["item_genres", "item_year", "item_tags"]
    genres = ds.lookup("item", b.seq_item_ids.numpy(), ["item_genres"])["item_genres"]
    assert (seq["item_genres"].values().numpy() == genres[0]).all()
    assert (seq["item_genres"].lengths().numpy() == genres[1]).all()
    assert b.dense_features.shape == (len(rows), len(ds.dense_features))
    assert np.isfinite(b.dense_features.numpy()).all()


def test_user_history_matches_collate(ds):
    b = ds.collate("eval", np.array([5]), 30)
    history = ds.user_history(int(b.user_ids[0]), int(b.timestamps[0]), 30)
    assert (history["item_ids"] == b.seq_item_ids.numpy()).all()
    assert (history["timestamps"] == b.seq_timestamps.numpy()).all()
    assert (history["actions"] == b.seq_actions.numpy()).all()


def test_ties_at_the_target_time_are_not_history(ds):
    # Many ratings share a user and a second: none of them is history of another.
    ts = ds.example_timestamps("train")
    users = ds.collate("train", np.arange(len(ts)), 0).user_ids.numpy()
    same_second = np.flatnonzero((ts[1:] == ts[:-1]) & (users[1:] == users[:-1]))
    assert len(same_second) > 1000
    pairs = np.stack([same_second, same_second + 1], axis=1).reshape(-1)[:2000]
    b = ds.collate("train", pairs, 10_000)
    lengths = np.diff(b.seq_offsets.numpy()).reshape(-1, 2)
    assert (lengths[:, 0] == lengths[:, 1]).all()
    assert (lengths[:, 1] == ds.history_lengths("train", rows=pairs[1::2])).all()


def test_open_rejects_bad_directories(tmp_path, movielens_dataset):
    with pytest.raises(DataError, match="not a dataset directory"):
        Dataset.open(tmp_path / "nope")
    with pytest.raises(DataError, match="missing manifest.json"):
        Dataset.open(tmp_path)
    broken = tmp_path / "copy"
    broken.mkdir()
    for f in movielens_dataset.rglob("*"):
        if f.is_file():
            (broken / f.relative_to(movielens_dataset)).parent.mkdir(parents=True, exist_ok=True)
            (broken / f.relative_to(movielens_dataset)).write_bytes(f.read_bytes())
    manifest = json.loads((broken / "manifest.json").read_text())
    (broken / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 99}))
    with pytest.raises(DataError, match="schema_version 99"):
        Dataset.open(broken)
    with pytest.raises(DataError, match="no split 'test'"):
        Dataset.open(movielens_dataset).num_examples("test")
