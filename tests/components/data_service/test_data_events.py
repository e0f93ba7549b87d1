"""`prepare events` on generic logs: label expressions, string ids, side tables, context, hashing, counts."""

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from gemrec.components.data_service.builder import SplitConfig, stable_hash
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.events import prepare_events

EVENTS = pd.DataFrame(
    {
        "user_id": ["alice", "alice", "bob", "alice", "bob", "alice", "carol", "alice"],
        "item_id": ["sku-1", "sku-2", "sku-1", "sku-3", "sku-2", "sku-2", "sku-9", "sku-3"],
        "timestamp": [
            "2024-01-01 10:00:00",
            "2024-01-01 10:05:00",
            "2024-01-03 08:00:00",
            "2024-01-01 10:05:00",
            "2024-01-02 08:00:00",
            "2024-01-05 12:00:00",
            "2024-01-04 00:00:00",
            "2024-01-01 10:05:00",
        ],
        "behavior": ["pv", "cart", "pv", "buy", "buy", "pv", "pv", "buy"],
        "rating": [3.0, 4.5, 2.0, 3.5, 5.0, 4.0, 1.0, 3.5],
        "dwell": [10.0, np.nan, 5.0, 40.0, 20.0, 8.0, 1.0, 40.0],
        "device": ["ios", "ios", "web", "ios", "web", "android", "web", "ios"],
    }
)
ITEMS = pd.DataFrame(
    {
        "item_id": ["sku-1", "sku-2", "sku-3", "sku-4"],
        "genres": ["a|b", "b", "", "c|a"],
        "price": [1.0, 2.0, np.nan, 4.0],
    }
)
USERS = pd.DataFrame({"user_id": ["alice", "bob"], "country": ["de", "fr"]})


def build(tmp_path, events_name="events.csv", **kwargs):
    events = tmp_path / events_name
    if events_name.endswith(".csv"):
        EVENTS.to_csv(events, index=False)
    else:
        EVENTS.to_parquet(events)
    ITEMS.to_csv(tmp_path / "items.csv", index=False)
    USERS.to_csv(tmp_path / "users.csv", index=False)
    return prepare_events(
        tmp_path / f"out-{events_name}",
        events,
        ["buy=behavior==buy", "like=rating>=4"],
        items=tmp_path / "items.csv",
        users=tmp_path / "users.csv",
        context=["device"],
        split=SplitConfig(cutoff=int(pd.Timestamp("2024-01-04", tz="UTC").timestamp()), valid_fraction=0.0),
        progress=False,
        **kwargs,
    )


def test_labels_actions_side_tables_and_counts(tmp_path):
    ds = Dataset.open(build(tmp_path))
    m = ds.manifest
    assert (m["num_events"], m["num_users"], m["num_items"]) == (7, 3, 5)  # sku-4 only in the side table
    assert m["counts"] == {"input_events": 8, "duplicates_dropped": 1, "unsorted_input_rows": 2}
    assert m["labels"] == ["buy", "like"]
    assert m["actions"][:2] == ["buy", "like"] and {"behavior=pv", "behavior=buy", "rating"} <= set(m["actions"])
    assert m["source"]["missing_action_values"] == {"dwell": 1}
    assert m["source"]["columns"]["dwell"] == "action: numeric / 40"  # scaled by the largest train-time value
    assert m["splits"]["train"]["num_examples"] == 5 and m["splits"]["eval"]["num_examples"] == 2
    features = {f["name"]: f for f in m["sparse_features"]}
    assert features["item_genres"]["multi_valued"] and features["ctx_device"]["source"] == "event"
    assert features["user_country"]["source"] == "user" and "item_price" in m["dense_features"]

    # alice's events at 10:05 (cart sku-2, buy sku-3) share a timestamp: neither is history of the other.
    b = ds.collate("train", np.arange(5), 100)
    users = pq.read_table(ds.path / "vocab" / "users.parquet").column("raw_id").to_pylist()
    items = pq.read_table(ds.path / "vocab" / "items.parquet").column("raw_id").to_pylist()
    offsets = b.seq_offsets.numpy()
    rows = [
        (users[int(b.user_ids[i])], items[int(b.item_ids[i])], int(offsets[i + 1] - offsets[i]), b.labels[i].tolist())
        for i in range(5)
    ]
    assert rows == [
        ("alice", "sku-1", 0, [0.0, 0.0]),
        ("alice", "sku-2", 1, [0.0, 1.0]),
        ("alice", "sku-3", 1, [1.0, 0.0]),
        ("bob", "sku-2", 0, [1.0, 1.0]),
        ("bob", "sku-1", 1, [0.0, 0.0]),
    ]
    genres = pq.read_table(ds.path / "vocab" / "features" / "item_genres.parquet").column("value").to_pylist()
    sku1 = ds.lookup("item", np.array([items.index("sku-1"), items.index("sku-9")]), ["item_genres", "item_price"])
    assert [genres[v] for v in sku1["item_genres"][0]] == ["a", "b"] and sku1["item_genres"][1].tolist() == [2, 0]
    assert sku1["item_price"][0].tolist() == [1.0, 0.0]
    devices = pq.read_table(ds.path / "vocab" / "features" / "ctx_device.parquet").column("value").to_pylist()
    assert [devices[v] for v in b.sparse_features["ctx_device"].values().tolist()] == [
        "ios",
        "ios",
        "ios",
        "web",
        "web",
    ]


def test_parquet_input_gives_the_same_dataset(tmp_path):
    from_csv = Dataset.open(build(tmp_path, "events.csv")).manifest
    from_parquet = Dataset.open(build(tmp_path, "events.parquet")).manifest
    assert from_csv["dataset_checksum"] == from_parquet["dataset_checksum"]


def test_huge_id_spaces_are_hashed(tmp_path):
    ds = Dataset.open(build(tmp_path, hash_over=2))
    features = {f["name"]: f for f in ds.manifest["sparse_features"]}
    assert features["item_id"] == {
        "name": "item_id",
        "source": "item",
        "num_embeddings": 2,
        "multi_valued": False,
        "hashed": True,
    }
    assert features["user_id"]["hashed"] and features["item_genres"]["hashed"]
    vocab = pq.read_table(ds.path / "vocab" / "items.parquet").to_pandas()
    expected = stable_hash(vocab["raw_id"].to_numpy(dtype=object)) % np.uint64(2)
    assert (vocab["embedding_id"].to_numpy() == expected.astype(np.int64)).all()
    assert ds.num_entities("item") == 5  # timelines still tell items apart
