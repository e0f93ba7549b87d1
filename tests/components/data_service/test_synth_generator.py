"""The synthetic generator: determinism by seed, production-like shape, hashed ids, visible planted signals."""

import numpy as np
import pyarrow.parquet as pq
from gemrec.components.data_service.builder import SplitConfig, stable_hash
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.synth import SynthConfig, _lengths, synthesize

SMALL = dict(events=5_000, mean_length=40, items=1_000, item_hash_buckets=512, categories=20, brands=50, tags=30)


def test_same_seed_same_bytes_other_seed_other_data(tmp_path):
    a = synthesize(tmp_path / "a", SynthConfig(seed=3, **SMALL), progress=False)
    b = synthesize(tmp_path / "b", SynthConfig(seed=3, **SMALL), progress=False)
    c = synthesize(tmp_path / "c", SynthConfig(seed=4, **SMALL), progress=False)
    checksum = {p: Dataset.open(p).manifest["dataset_checksum"] for p in (a, b, c)}
    assert checksum[a] == checksum[b] != checksum[c]


def test_lengths_are_heavy_tailed_and_sum_exactly():
    cfg = SynthConfig(events=3_000_000, mean_length=300, length_sigma=1.8, max_length=16_384)
    lengths = _lengths(np.random.default_rng(0), cfg)
    assert lengths.sum() == 3_000_000 and lengths.min() >= 1
    assert lengths.max() == 16_384  # the tail reaches the clip
    assert np.median(lengths) < 0.5 * lengths.mean()  # lognormal: median far below the mean


def test_shape_features_and_hashed_item_ids(synth_dataset):
    ds = Dataset.open(synth_dataset)
    m = ds.manifest
    assert m["num_events"] + m["counts"]["duplicates_dropped"] == 30_000
    features = {f["name"]: f for f in m["sparse_features"]}
    assert features["item_id"]["hashed"] and features["item_id"]["num_embeddings"] == 4_096
    assert features["user_interests"]["multi_valued"] and features["item_tags"]["multi_valued"]
    assert {"ctx_device", "ctx_surface", "ctx_position"} <= {f for f, s in features.items() if s["source"] == "event"}
    vocab = pq.read_table(synth_dataset / "vocab" / "items.parquet").to_pandas()
    raw = vocab["raw_id"].astype(np.int64).to_numpy()
    assert (vocab["embedding_id"].to_numpy() == (stable_hash(raw) % np.uint64(4_096)).astype(np.int64)).all()
    b = ds.collate("train", np.arange(0, ds.num_examples("train"), 50), 128)
    assert b.item_ids.max() < 4_096 and b.seq_item_ids.max() < 4_096
    assert b.sparse_features.keys() == [f["name"] for f in m["sparse_features"]]
    for name, spec in features.items():
        assert int(b.sparse_features[name].values().max()) < spec["num_embeddings"], name
    assert b.dense_features.shape[1] == len(m["dense_features"]) and "item_quality" in m["dense_features"]
    assert m["synth"]["oracle_ne"]["click"] < m["synth"]["static_only_ne"]["click"] < 1.0


def test_recent_interest_signal_is_visible_in_batches(synth_dataset):
    """Click rate is far higher when a liked event of the target's category is among the last 8 history
    tokens: the planted signal reaches the model through seq_item_features and seq_actions."""
    ds = Dataset.open(synth_dataset)
    b = ds.collate("train", np.arange(ds.num_examples("train")), 8)
    lengths = np.diff(b.seq_offsets.numpy())
    owner = np.repeat(np.arange(b.batch_size), lengths)
    target_category = b.sparse_features["item_category"].values().numpy()
    history_category = b.seq_item_features["item_category"].values().numpy()
    liked = b.seq_actions.numpy()[:, ds.action_names.index("like")] > 0
    hit = np.zeros(b.batch_size, dtype=bool)
    np.logical_or.at(hit, owner, liked & (history_category == target_category[owner]))
    clicks = b.labels.numpy()[:, 0]
    assert hit.mean() > 0.2
    assert clicks[hit].mean() - clicks[~hit].mean() > 0.25


def test_split_by_events_puts_the_last_tenth_in_eval(synth_dataset):
    m = Dataset.open(synth_dataset).manifest
    share = m["splits"]["eval"]["num_examples"] / m["num_events"]
    assert 0.09 < share < 0.12
    assert SplitConfig(by="events").cutoff_for(np.arange(100)) == 90


def test_history_item_features_match_the_item_table(synth_dataset):
    ds = Dataset.open(synth_dataset)
    rows = np.arange(3, ds.num_examples("eval"), 97)
    b = ds.collate("eval", rows, 300)
    items = np.concatenate(
        [
            ds.user_history(int(u), int(t), 300)["items"]
            for u, t in zip(ds._split("eval").user[rows], b.timestamps.tolist())
        ]
    )
    assert len(items) == b.num_tokens
    expected = ds.lookup("item", items, ["item_tags", "item_category"])
    for name in ("item_tags", "item_category"):
        assert (b.seq_item_features[name].values().numpy() == expected[name][0]).all()
        assert (b.seq_item_features[name].lengths().numpy() == expected[name][1]).all()


def test_h200_bench_profile_has_one_example_per_user_with_bench_history_lengths(tmp_path):
    """Each user's last event is its one example; the histories are lognormal (mean 384, sigma 0.8) capped at 1024,
    as the GPU benchmark draws them; the latest tenth of the examples is eval."""
    cfg = SynthConfig.for_profile("h200-bench", events=600_000, items=20_000)
    ds = Dataset.open(synthesize(tmp_path / "bench", cfg, split=SplitConfig(eval_fraction=0.1), progress=False))
    m = ds.manifest
    assert m["split"]["by"] == "last_event" and m["seq_item_features"] == ["item_category", "item_brand"]
    assert len(m["dense_features"]) == 16 and m["labels"] == ["click", "convert"]
    users = m["num_users"]
    assert ds.num_examples("train") + ds.num_examples("eval") == users
    assert abs(ds.num_examples("eval") - 0.1 * users) <= 0.02 * users
    examples = {s: pq.read_table(ds.path / "examples" / f"{s}.parquet").to_pandas() for s in ("train", "eval")}
    assert examples["train"]["timestamp"].max() <= examples["eval"]["timestamp"].min()
    timelines = pq.read_table(ds.path / "timelines.parquet").to_pandas().set_index("user")
    both = np.concatenate([examples[s]["event"].to_numpy() for s in examples])
    users_of = np.concatenate([examples[s]["user"].to_numpy() for s in examples])
    assert sorted(users_of) == list(range(users))
    assert (both == (timelines["start"] + timelines["length"] - 1).to_numpy()[users_of]).all()  # the last event
    lengths = np.concatenate([ds.history_lengths(s) for s in ("train", "eval")])
    mu = np.log(384.0) - 0.8**2 / 2
    want = np.clip(np.round(np.random.default_rng(0).lognormal(mu, 0.8, 200_000)), 1, 1024)
    assert lengths.max() <= 1024 and abs(lengths.mean() - want.mean()) < 0.08 * want.mean()
    assert abs(np.median(lengths) - np.median(want)) < 0.1 * np.median(want)
