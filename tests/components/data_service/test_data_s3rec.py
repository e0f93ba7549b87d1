"""`gemrec data prepare s3rec`: leave-one-out boundaries, history cap, attributes, bad lines."""

import json

import numpy as np
import pytest
from gemrec.cli import main
from gemrec.components.data_service.dataset import Dataset

# user 7: 5 items, user 3: 3 items (one each in train/valid/test), user 9: 2 items (too short: train only).
LINES = "7 10 11 12 13 14\n3 12 15 10\n9 11 16\n"
ATTRIBUTES = {"10": [5, 1], "11": [1], "12": [9, 9, 5], "13": [2], "14": [2, 5], "15": [1], "16": [3]}


def write_raw(tmp_path, lines=LINES, attributes=ATTRIBUTES, name="Toy"):
    raw = tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    (raw / f"{name}.txt").write_text(lines)
    if attributes is not None:
        text = attributes if isinstance(attributes, str) else json.dumps(attributes)
        (raw / f"{name}_item2attributes.json").write_text(text)
    return raw


def prepare(tmp_path, *extra, name="Toy"):
    out = tmp_path / "out"
    code = main(["data", "prepare", "s3rec", "--raw", str(tmp_path / "raw"), "--name", name, "--out", str(out), *extra])
    return code, out


def raw_items(ds: Dataset, dense: np.ndarray) -> list[int]:
    import pyarrow.parquet as pq

    vocab = pq.read_table(ds.path / "vocab" / "items.parquet").column("raw_id").to_pylist()
    return [int(vocab[i]) for i in dense]


def split_view(ds: Dataset, split: str) -> dict[int, tuple[int, list[int]]]:
    """raw user -> (raw target item, raw history items) for every example of the split."""
    import pyarrow.parquet as pq

    users = pq.read_table(ds.path / "vocab" / "users.parquet").column("raw_id").to_pylist()
    ex = ds.examples(split)
    view = {}
    for u, e, a, b in zip(ex.user, ex.event, ex.hist_start, ex.hist_end):
        target = raw_items(ds, [ds.event_items[e]])[0]
        view.setdefault(int(users[u]), []).append((target, raw_items(ds, ds.event_items[a:b])))
    return view


def test_leave_one_out_boundaries_and_counts(tmp_path, capsys):
    write_raw(tmp_path)
    code, out = prepare(tmp_path)
    assert code == 0, capsys.readouterr().err
    ds = Dataset.open(out)
    m = ds.manifest
    assert (m["num_users"], m["num_items"], m["num_events"]) == (3, 7, 10)
    assert m["split"] == {"by": "leave_one_out"} and m["max_history"] == 50
    assert {s: m["splits"][s]["num_examples"] for s in ("train", "valid", "test")} == {
        "train": 6,
        "valid": 2,
        "test": 2,
    }
    test, valid, train = split_view(ds, "test"), split_view(ds, "valid"), split_view(ds, "train")
    assert test == {7: [(14, [10, 11, 12, 13])], 3: [(10, [12, 15])]}
    assert valid == {7: [(13, [10, 11, 12])], 3: [(15, [12])]}
    assert train == {7: [(10, []), (11, [10]), (12, [10, 11])], 3: [(12, [])], 9: [(11, []), (16, [11])]}
    # No leakage: a user's test item is in no training or validation history, the valid item in no training one.
    for user, [(test_item, _)] in test.items():
        assert all(test_item not in hist for _, hist in train[user] + valid[user])
    for user, [(valid_item, _)] in valid.items():
        assert all(valid_item not in hist for _, hist in train[user])
    assert "split by leave_one_out" in capsys.readouterr().out


def test_history_cap_and_attributes(tmp_path, capsys):
    write_raw(tmp_path)
    code, out = prepare(tmp_path, "--max-history", "2")
    assert code == 0, capsys.readouterr().err
    ds = Dataset.open(out)
    assert ds.manifest["max_history"] == 2
    assert split_view(ds, "test")[7] == [(14, [12, 13])]
    assert split_view(ds, "train")[7][2] == (12, [10, 11])
    spec = {f["name"]: f for f in ds.sparse_features}["item_attributes"]
    assert spec["multi_valued"] and spec["num_embeddings"] == 5  # attribute ids 1, 2, 3, 5, 9
    assert ds.seq_item_features == ["item_attributes"]
    import pyarrow.parquet as pq

    vocab = pq.read_table(out / "vocab" / "items.parquet").column("raw_id").to_pylist()
    names = pq.read_table(out / "vocab" / "features" / "item_attributes.parquet").column("value").to_pylist()
    values, lengths = ds.lookup("item", np.array([vocab.index("12"), vocab.index("10")]), ["item_attributes"])[
        "item_attributes"
    ]
    assert lengths.tolist() == [2, 2] and [names[v] for v in values] == ["5", "9", "1", "5"]


def test_without_attributes_file(tmp_path, capsys):
    write_raw(tmp_path, attributes=None)
    code, out = prepare(tmp_path, "--max-history", "0")
    assert code == 0, capsys.readouterr().err
    ds = Dataset.open(out)
    assert ds.seq_item_features == [] and ds.manifest["max_history"] is None
    assert split_view(ds, "test")[7] == [(14, [10, 11, 12, 13])]


@pytest.mark.parametrize(
    "lines, fragments",
    [
        ("7 10 11\n8\n", ["Toy.txt: line 2", "at least one item"]),
        ("7 10 11\n\n8 12\n", ["Toy.txt: line 2", "at least one item"]),
        ("7 10 11\n8 12 x3 14\n", ["Toy.txt: line 2", "'x3' is not an integer id"]),
        ("7 10 11\n8 12\n7 13 14\n", ["Toy.txt: line 3", "user 7 already has line 1"]),
        ("", ["Toy.txt: no lines"]),
    ],
)
def test_bad_lines(tmp_path, capsys, lines, fragments):
    write_raw(tmp_path, lines=lines)
    code, out = prepare(tmp_path)
    err = capsys.readouterr().err
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "attributes, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"ten": [1]}', "item key 'ten' is not an integer id"),
        ('{"10": [1, "a"]}', "item 10: attributes must be a list of integers"),
    ],
)
def test_bad_attributes(tmp_path, capsys, attributes, fragment):
    write_raw(tmp_path, attributes=attributes)
    code, out = prepare(tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and "Toy_item2attributes.json" in err and fragment in err, err
    assert not out.exists()


def test_missing_files(tmp_path, capsys):
    write_raw(tmp_path)
    code, _ = prepare(tmp_path, name="Other")
    assert code == 2 and "Other.txt: file not found" in capsys.readouterr().err
