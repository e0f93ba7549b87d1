"""Aggregate features of earlier events: hand-computed values on a made-up log, and no leakage of the target's
label or of later events; the valid split's boundaries."""

import numpy as np
import pyarrow.parquet as pq
import pytest
from gemrec.components.data_service.aggregates import HistoryAggregates, aggregate_feature_sources
from gemrec.components.data_service.builder import Categorical, EventLog, SideTable, SplitConfig, build_dataset
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.dense_bins import quantile_edges
from gemrec.components.data_service.errors import DataError

# (user, item, timestamp, like); A's y and B's x share second 20.
LOG = [
    ("A", "x", 10, 1),
    ("A", "y", 20, 0),
    ("B", "x", 20, 0),
    ("A", "x", 30, 1),
    ("B", "y", 30, 1),
    ("B", "x", 40, 1),
]


def event_log(log) -> EventLog:
    users, items, ts, like = (np.array(c) for c in zip(*log))
    return EventLog(
        users=users,
        items=items,
        timestamps=ts.astype(np.int64),
        labels={"like": like.astype(np.int8)},
        actions={"like": like.astype(np.float32)},
    )


def build(tmp_path, log=LOG, name="agg", options=None, **split):
    """The dataset of `log` (`options`: more build_dataset arguments)."""
    split = SplitConfig(**{"cutoff": 100, "valid_fraction": 0.0, **split})
    path = build_dataset(
        tmp_path / name, name=name, events=event_log(log), split=split, progress=False, **(options or {})
    )
    return Dataset.open(path)


def features(ds: Dataset, split: str = "train") -> dict[tuple[str, int], dict[str, float]]:
    """Dense features by (user raw id, timestamp) of every example of the split."""
    n = ds.num_examples(split)
    batch = ds.collate(split, np.arange(n), max_seq_len=4)
    raw_users = pq.read_table(ds.path / "vocab" / "users.parquet").column("raw_id").to_pylist()
    users = pq.read_table(ds.path / "examples" / f"{split}.parquet").column("user").to_numpy()
    out = {}
    for row in range(n):
        out[(raw_users[users[row]], int(batch.timestamps[row]))] = dict(
            zip(ds.dense_features, batch.dense_features[row].tolist(), strict=True)
        )
    return out


def test_aggregates_match_hand_computed_values(tmp_path):
    ds = build(tmp_path)
    spec = ds.manifest["aggregates"]
    k, prior = spec["smoothing"], spec["priors"]["like"]
    assert prior == pytest.approx(4 / 6)  # the train period's like rate

    def shrunk(total, count):
        return (total + k * prior) / (count + k)

    got = features(ds)
    # user's earlier events (strictly before t): sum of likes, count; item's earlier events by anyone: sum, count
    expected = {
        ("A", 10): ((0, 0), (0, 0)),
        ("A", 20): ((1, 1), (0, 0)),
        ("B", 20): ((0, 0), (1, 1)),  # A's x at 10; not A's y at the same second, not B's own target
        ("A", 30): ((1, 2), (1, 2)),  # item x: A@10 (1), B@20 (0)
        ("B", 30): ((0, 1), (0, 1)),  # item y: A@20 (0)
        ("B", 40): ((1, 2), (2, 3)),  # item x: A@10, B@20, A@30
    }
    longest_timeline, most_item_events = 3, 4  # item x has 4 events in all
    for key, ((u_sum, u_count), (i_sum, i_count)) in expected.items():
        f = got[key]
        assert f["user_past_mean_like"] == pytest.approx(shrunk(u_sum, u_count), abs=1e-6), key
        assert f["user_recent_mean_like"] == pytest.approx(shrunk(u_sum, u_count), abs=1e-6), key
        assert f["item_past_mean_like"] == pytest.approx(shrunk(i_sum, i_count), abs=1e-6), key
        assert f["history_length_log"] == pytest.approx(np.log1p(u_count) / np.log1p(longest_timeline)), key
        assert f["item_past_count_log"] == pytest.approx(np.log1p(i_count) / np.log1p(most_item_events)), key
    span = np.log1p(40 - 10)
    assert got[("A", 10)]["user_seconds_since_last_log"] == 1.0  # no earlier event
    assert got[("A", 30)]["user_seconds_since_last_log"] == pytest.approx(np.log1p(10) / span)
    assert got[("B", 40)]["user_seconds_since_last_log"] == pytest.approx(np.log1p(10) / span)


def test_residuals_against_the_items_earlier_means(tmp_path):
    ds = build(tmp_path)
    spec = ds.manifest["aggregates"]
    k, p = spec["smoothing"], spec["priors"]["like"]
    got = features(ds)
    # Each history event's like less its item's shrunk mean before it (LOG above), summed, over (count + k).
    a10, a20 = 1 - p, 0 - p  # A's x at 10 and y at 20: neither item has an earlier event
    b20, b30 = 0 - (1 + k * p) / (1 + k), 1 - (0 + k * p) / (1 + k)  # x after A@10 (1); y after A@20 (0)
    expected = {
        ("A", 10): 0.0,
        ("A", 30): (a10 + a20) / (2 + k),
        ("B", 30): b20 / (1 + k),
        ("B", 40): (b20 + b30) / (2 + k),
    }
    for key, value in expected.items():
        assert got[key]["user_past_resid_like"] == pytest.approx(value, abs=1e-6), key
        assert got[key]["user_recent_resid_like"] == pytest.approx(value, abs=1e-6), key  # all within the last 10


def test_recent_window_covers_only_the_last_events(tmp_path):
    # One user, 14 events alternating like 1, 0, ...; the recent mean of the 15th sees events 4..13 only.
    log = [("A", f"i{t}", t, int(t % 2 == 0)) for t in range(14)] + [("A", "z", 100, 1)]
    ds = build(tmp_path, log=log, cutoff=1000)
    spec = ds.manifest["aggregates"]
    assert spec["recent_events"] == 10
    k, prior = spec["smoothing"], spec["priors"]["like"]
    last = features(ds)[("A", 100)]
    recent_likes = sum(int(t % 2 == 0) for t in range(4, 14))
    assert last["user_recent_mean_like"] == pytest.approx((recent_likes + k * prior) / (10 + k), abs=1e-6)
    assert last["user_past_mean_like"] == pytest.approx((7 + k * prior) / (14 + k), abs=1e-6)
    # More windows: the last event (13: no like), the last 3 (11, 12, 13: one like), the last 30 (all 14).
    assert last["user_last1_mean_like"] == pytest.approx((0 + k * prior) / (1 + k), abs=1e-6)
    assert last["user_last3_mean_like"] == pytest.approx((1 + k * prior) / (3 + k), abs=1e-6)
    assert last["user_last30_mean_like"] == pytest.approx(last["user_past_mean_like"], abs=1e-6)
    assert features(ds)[("A", 0)]["user_last1_mean_like"] == pytest.approx(prior, abs=1e-6)  # no earlier event


def test_dense_bins_are_train_split_quantiles(tmp_path):
    # Item i's count of earlier events grows with time, so the eval examples have larger values than any train one.
    log = [(f"u{t % 7}", "i", 100 + 10 * t, t % 2) for t in range(200)]
    ds = build(tmp_path, log=log, cutoff=100 + 10 * 130)
    bins = ds.manifest["dense_bins"]
    assert bins["split"] == "train" and set(bins["edges"]) == set(ds.dense_features)
    values = {s: ds.collate(s, np.arange(ds.num_examples(s)), max_seq_len=0).dense_features for s in ds.splits}
    col = ds.dense_features.index("item_past_count_log")
    edges = bins["edges"]["item_past_count_log"]
    assert edges[0] == pytest.approx(float(values["train"][:, col].min()))
    assert edges[-1] == pytest.approx(float(values["train"][:, col].max()))
    assert edges[-1] < float(values["eval"][:, col].min())
    assert all(b > a for a, b in zip(edges, edges[1:])) and len(edges) == bins["bins"] + 1  # 130 distinct values


def test_no_leakage_of_the_target_or_later_events(tmp_path):
    """Changing the actions of every event at or after an example's time (its own label included) leaves the
    example's aggregates unchanged."""
    rng = np.random.default_rng(0)
    log = [(f"u{rng.integers(4)}", f"i{rng.integers(6)}", int(t) // 2, int(rng.integers(2))) for t in range(80)]
    ds = build(tmp_path, log=log, cutoff=10_000)
    events = pq.read_table(ds.path / "events.parquet").to_pandas()
    examples = pq.read_table(ds.path / "examples" / "train.parquet").to_pandas()
    spec = {"recent_events": 3, "smoothing": 2.0, "priors": {"like": 0.3}}
    names = list(aggregate_feature_sources(["like"]))

    def compute(actions):
        aggregates = HistoryAggregates(
            events.user.to_numpy(), events.item.to_numpy(), events.timestamp.to_numpy(), actions, ["like"], spec
        )
        values = aggregates.compute(
            names,
            events.item.to_numpy()[examples.event.to_numpy()],
            examples.timestamp.to_numpy(),
            examples.hist_start.to_numpy(),
            examples.hist_end.to_numpy(),
        )
        return np.stack([values[n] for n in names], axis=1)

    like = events.like.to_numpy().astype(np.float32)[:, None]
    base = compute(like)
    for pivot in (3, 17, 30):
        later = events.timestamp.to_numpy() >= pivot
        flipped = compute(np.where(later[:, None], 1.0 - like, like))
        upto = examples.timestamp.to_numpy() <= pivot
        np.testing.assert_allclose(flipped[upto], base[upto], atol=1e-6)
        assert not np.allclose(flipped[~upto], base[~upto])  # the test can fail: later examples do change


def test_valid_split_lies_between_train_and_eval(tmp_path):
    log = [(f"u{t % 3}", f"i{t % 5}", 100 + 10 * t, t % 2) for t in range(100)]  # times 100 .. 1090
    ds = build(tmp_path, log=log, cutoff=None, eval_fraction=0.2, valid_fraction=0.25)
    split = ds.manifest["split"]
    assert split["cutoff"] == 100 + int(np.ceil(990 * 0.8))  # 892
    assert split["valid_cutoff"] == 100 + int(np.ceil((890 - 100) * 0.75))  # of the train period's times
    times = {s: ds.example_timestamps(s) for s in ds.splits}
    assert ds.splits == ["train", "valid", "eval"]
    assert times["train"].max() < split["valid_cutoff"] <= times["valid"].min()
    assert times["valid"].max() < split["cutoff"] <= times["eval"].min()
    assert sum(len(t) for t in times.values()) == 100


def test_quantile_edges_merge_duplicates_and_handle_constants():
    assert quantile_edges(np.array([0.0, 0.0, 0.0, 1.0, 2.0]), bins=4) == [
        0.0,
        1.0,
        2.0,
    ]  # quantiles 0, 0, 0, 1, 2 merged
    assert quantile_edges(np.array([3.0, 3.0, np.nan]), bins=4) == [3.0, 4.0]  # one bin of width 1
    assert quantile_edges(np.array([]), bins=4) == [0.0, 1.0]


def test_category_means_over_the_targets_categories(tmp_path):
    # Items: x in genre 0, y in genres 0 and 1, z in genre 1. B's event counts for item means, never for A's.
    log = [("A", "x", 10, 1), ("B", "x", 15, 1), ("A", "y", 20, 0), ("A", "z", 30, 1), ("A", "y", 40, 1)]
    genres = Categorical("item_genres", np.array([0, 0, 1, 1]), np.array([0, 1, 3, 4]), num_embeddings=2)
    items = SideTable("test", np.array(["x", "y", "z"]), categorical=[genres])
    ds = build(tmp_path, log, "cat", {"items": items, "aggregate_category": "item_genres"})
    assert ds.manifest["aggregates"]["category"] == "item_genres"
    k, p = ds.manifest["aggregates"]["smoothing"], ds.manifest["aggregates"]["priors"]["like"]
    got = features(ds)

    def user_mean(total, count):
        return (total + k * p) / (count + k)

    # A@40, target y (genres 0, 1): genre 0 has x (1) and y (0), genre 1 has y (0) and z (1): 4 pooled, 2 likes.
    a40 = got[("A", 40)]
    assert a40["user_category_mean_like"] == pytest.approx((2 + k * user_mean(2, 3)) / (4 + k), abs=1e-6)
    assert a40["user_category_count_log"] == pytest.approx(np.log1p(4) / np.log1p(4), abs=1e-6)
    # A@30, target z (genre 1): only y (0) shares it; y had no earlier event, so its residual is 0 - p.
    a30 = got[("A", 30)]
    assert a30["user_category_mean_like"] == pytest.approx((0 + k * user_mean(1, 2)) / (1 + k), abs=1e-6)
    assert a30["user_category_resid_like"] == pytest.approx((0 - p) / (1 + k), abs=1e-6)
    for first in (("A", 10), ("B", 15)):  # no earlier event of the user: the prior, no count
        assert got[first]["user_category_mean_like"] == pytest.approx(p, abs=1e-6)
        assert got[first]["user_category_count_log"] == 0.0
    with pytest.raises(DataError, match="aggregate category 'item_tags'"):
        build(tmp_path, log, "bad", {"items": items, "aggregate_category": "item_tags"})
