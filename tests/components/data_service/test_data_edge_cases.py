"""Event logs that used to pass silently or crash: binary columns, uint64 ids, duplicate header names,
id-like integer columns taken as magnitudes, attribute columns of items/users in the events file, outlier
timestamps that empty a split, and temp folders of killed prepares."""

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gemrec.cli import main
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.errors import DataError
from gemrec.components.data_service.events import prepare_events

N = 60
RNG = np.random.default_rng(0)
USERS = RNG.integers(0, 8, size=N)
ITEMS = RNG.integers(0, 12, size=N)
BASE = {
    "user_id": USERS,
    "item_id": ITEMS,
    "timestamp": 1_700_000_000 + np.arange(N) * 3_600,
    "click": RNG.integers(0, 2, size=N),
}


def _prepare(tmp_path, columns: dict, *labels, **kwargs):
    path = tmp_path / "events.parquet"
    pq.write_table(pa.table(columns), path)
    return prepare_events(tmp_path / "out", path, list(labels or ["click"]), progress=False, **kwargs)


def _source(out) -> dict:
    return json.loads((out / "manifest.json").read_text())["source"]


def test_binary_column_is_ignored_and_said_so(tmp_path):
    blob = pa.array([b"\xff\xfe\x00", b"\x01"] * (N // 2), pa.binary())
    out = _prepare(tmp_path, {**BASE, "blob": blob})
    assert "binary" in _source(out)["columns"]["blob"]
    assert not any(a.startswith("blob") for a in Dataset.open(out).action_names)


def test_uint64_ids_keep_their_values(tmp_path):
    big = np.array([2**63 + 5, 2**64 - 1, 7, 2**63 + 6, 2**63 + 5, 7] * (N // 6), dtype=np.uint64)
    out = _prepare(tmp_path, {**BASE, "user_id": pa.array(big, pa.uint64())})
    raw = pq.read_table(out / "vocab" / "users.parquet")["raw_id"].to_pylist()
    assert sorted(raw) == sorted({str(v) for v in big.tolist()})


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_duplicate_header_names_are_refused(tmp_path, suffix):
    path = tmp_path / f"events{suffix}"
    names = ["user_id", "item_id", "timestamp", "click", "x", "x"]
    arrays = [pa.array(v) for v in (BASE["user_id"], BASE["item_id"], BASE["timestamp"], BASE["click"])]
    table = pa.Table.from_arrays([*arrays, pa.array(np.ones(N)), pa.array(np.zeros(N))], names=names)
    pq.write_table(table, path) if suffix == ".parquet" else table.to_pandas().to_csv(path, index=False)
    with pytest.raises(DataError, match=r"duplicate column name.*'x'"):
        prepare_events(tmp_path / "out", path, ["click"], progress=False)


def test_id_like_integer_columns_are_not_magnitudes(tmp_path):
    """An integer column with many distinct values is categorical: not a numeric action; `--numeric` and
    `--categorical` override the default."""
    category = RNG.integers(0, 1000, size=N) * 1_000 + 7
    quantity = RNG.integers(1, 4, size=N)
    columns = {**BASE, "category_id": category, "quantity": quantity, "shop": RNG.integers(0, 500, size=N)}
    out = _prepare(tmp_path, columns, numeric=["shop"], categorical=["quantity"])
    actions, uses = Dataset.open(out).action_names, _source(out)["columns"]
    assert "category_id" not in actions and "ignored" in uses["category_id"] and "--item-columns" in uses["category_id"]
    assert "shop" in actions and uses["shop"].startswith("action: numeric")
    assert {"quantity=1", "quantity=2", "quantity=3"} <= set(actions) and "one-hot" in uses["quantity"]


def test_item_and_user_columns_of_the_events_file_become_side_features(tmp_path):
    category = (ITEMS * 37 + 1_000_003).astype(np.int64)  # one category per item, id-like values
    brand = np.array([f"brand-{i % 3}" for i in ITEMS])
    age = np.array(["18-24", "25-34", "35-44", "45+"])[USERS % 4]
    columns = {**BASE, "category_id": category, "brand": brand, "age": age}
    out = _prepare(tmp_path, columns, item_columns=["category_id", "brand"], user_columns=["age"])
    ds, uses = Dataset.open(out), _source(out)["columns"]
    sources = {f["name"]: f["source"] for f in ds.manifest["sparse_features"]}
    assert sources["item_category_id"] == "item" and sources["item_brand"] == "item" and sources["user_age"] == "user"
    assert not {"category_id", "brand", "age"} & {a.split("=")[0] for a in ds.action_names}
    assert uses["category_id"].startswith("item feature") and uses["age"].startswith("user feature")
    items = pq.read_table(out / "vocab" / "items.parquet").to_pandas()
    dense = items.set_index("raw_id")["index"]
    got = ds.lookup("item", dense.to_numpy(), ["item_category_id"])["item_category_id"][0]
    by_item = dict(zip(dense.index, got.tolist()))
    want = {str(i): c for i, c in zip(ITEMS, category)}  # equal raw categories get equal codes, distinct differ
    assert len({by_item[i] for i in want}) == len(set(want.values()))
    for a in want:
        for b in want:
            assert (by_item[a] == by_item[b]) == (want[a] == want[b])


def test_columns_in_two_roles_or_missing_are_refused(tmp_path):
    with pytest.raises(DataError, match="'brand'.*not in"):
        _prepare(tmp_path, BASE, item_columns=["brand"])
    with pytest.raises(DataError, match="'click'.*both"):
        _prepare(tmp_path, BASE, item_columns=["click"], user_columns=["click"])


def test_outlier_timestamp_warns_that_a_split_is_tiny(tmp_path, capsys):
    stamps = BASE["timestamp"].copy()
    stamps[5] = 100_000_000  # one event in 1973, the rest in 2023
    path = tmp_path / "events.csv"
    pd.DataFrame({**BASE, "timestamp": stamps}).to_csv(path, index=False)
    code = main(["data", "prepare", "events", "--events", str(path), "--label", "click", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert code == 0
    assert "warning: split train has 1 of" in out and "--split-by events" in out
    assert "warning: 1 timestamp(s) lie far outside" in out


def test_stale_temp_folders_of_killed_prepares_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.tmp-{dead.pid}"
    (stale / "examples").mkdir(parents=True)
    live = tmp_path / f".out.tmp-{os.getppid()}"  # a running process: maybe another prepare, left alone
    live.mkdir()
    _prepare(tmp_path, BASE)
    assert not stale.exists() and live.exists()
