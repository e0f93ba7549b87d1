"""Bad input exits non-zero with a message naming file, column and row, and leaves no partial output."""

import shutil

import pandas as pd
import pytest
from gemrec.cli import main

GOOD = "user_id,item_id,timestamp,behavior,click\nu1,i1,100,pv,1\nu1,i2,200,buy,0\nu2,i1,150,pv,1\n"


def prepare(tmp_path, events_text=GOOD, *labels, name="events.csv", extra=()):
    path = tmp_path / name
    if events_text is not None:
        path.write_text(events_text)
    out = tmp_path / "out"
    code = main(
        [
            "data",
            "prepare",
            "events",
            "--events",
            str(path),
            "--out",
            str(out),
            *[arg for label in (labels or ("click",)) for arg in ("--label", label)],
            *("--timestamp-unit", "s"),  # toy seconds near 1970: too small to tell the unit from
            *extra,
        ]
    )
    return code, out


def expect_error(capsys, tmp_path, code, out, *fragments):
    err = capsys.readouterr().err
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folder left


def test_good_input_works(tmp_path, capsys):
    code, out = prepare(tmp_path)
    assert code == 0 and (out / "manifest.json").is_file(), capsys.readouterr().err


def test_missing_column(tmp_path, capsys):
    code, out = prepare(tmp_path, "user_id,item_id,click\nu1,i1,1\n")
    expect_error(capsys, tmp_path, code, out, "events.csv", "missing column(s) ['timestamp']")


def test_unparsable_timestamp(tmp_path, capsys):
    code, out = prepare(tmp_path, GOOD + "u2,i3,yesterday-ish,pv,0\n")
    expect_error(
        capsys, tmp_path, code, out, "events.csv", "column 'timestamp'", "row 3 (line 5)", "unparsable", "yesterday-ish"
    )


@pytest.mark.parametrize("value, problem", [("", "missing value"), ("2", "must be 0 or 1"), ("yes", "must be 0 or 1")])
def test_nan_or_non_binary_label(tmp_path, capsys, value, problem):
    code, out = prepare(tmp_path, GOOD + f"u2,i3,300,pv,{value}\n")
    expect_error(capsys, tmp_path, code, out, "events.csv", "column 'click'", "row 3 (line 5)", problem)


def test_unknown_label_expression(tmp_path, capsys):
    code, out = prepare(tmp_path, GOOD, "buy=behavior~buy")
    expect_error(capsys, tmp_path, code, out, "buy=behavior~buy", "unknown label expression")


def test_label_on_a_missing_column(tmp_path, capsys):
    code, out = prepare(tmp_path, GOOD, "like=rating>=4")
    expect_error(capsys, tmp_path, code, out, "events.csv", "needs column 'rating'")


def test_empty_and_header_only_files(tmp_path, capsys):
    code, out = prepare(tmp_path, "")
    expect_error(capsys, tmp_path, code, out, "events.csv", "empty file")
    code, out = prepare(tmp_path, "user_id,item_id,timestamp,click\n")
    expect_error(capsys, tmp_path, code, out, "events.csv", "no data rows")


def test_missing_file(tmp_path, capsys):
    code, out = prepare(tmp_path, None)
    expect_error(capsys, tmp_path, code, out, "events.csv", "file not found")


def test_truncated_csv(tmp_path, capsys):
    code, out = prepare(tmp_path, GOOD + "u2,i3,3")  # cut in the middle of the last row
    expect_error(capsys, tmp_path, code, out, "events.csv", "row 3 (line 5)", "missing value")
    code, out = prepare(tmp_path, GOOD + 'u2,i3,300,"pv')  # cut inside a quoted field
    expect_error(capsys, tmp_path, code, out, "events.csv", "malformed CSV")


def test_corrupt_and_truncated_parquet(tmp_path, capsys):
    frame = pd.read_csv(pd.io.common.StringIO(GOOD))
    path = tmp_path / "events.parquet"
    frame.to_parquet(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    code, out = prepare(tmp_path, None, name="events.parquet")
    expect_error(capsys, tmp_path, code, out, "events.parquet", "corrupt or unreadable Parquet")
    path.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    code, out = prepare(tmp_path, None, name="events.parquet")
    expect_error(capsys, tmp_path, code, out, "events.parquet", "corrupt or unreadable Parquet")


def test_side_table_errors_and_failed_overwrite_keeps_the_old_dataset(tmp_path, capsys):
    code, out = prepare(tmp_path)
    assert code == 0
    before = (out / "manifest.json").read_text()
    items = tmp_path / "items.csv"
    items.write_text("item_id,genres\ni1,a|b\ni1,c\n")
    code, _ = prepare(tmp_path, GOOD, extra=("--items", str(items), "--overwrite"))
    err = capsys.readouterr().err
    assert code == 2 and "items.csv" in err and "duplicate id 'i1'" in err
    assert (out / "manifest.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_existing_output_needs_overwrite(tmp_path, capsys):
    assert prepare(tmp_path)[0] == 0
    code, out = prepare(tmp_path)
    assert code == 2 and "already exists" in capsys.readouterr().err


def test_movielens_checksum_mismatch_names_the_file(tmp_path, capsys, movielens_raw):
    raw = tmp_path / "raw"
    shutil.copytree(movielens_raw, raw)
    with open(raw / "movies.csv", "a") as f:
        f.write("999999,Tampered (2020),Drama\n")
    out = tmp_path / "ml"
    code = main(["data", "prepare", "movielens", "--raw", str(raw), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "movies.csv" in err and "does not match SHA256SUMS" in err
    assert not out.exists()


def test_movielens_bad_raw_dir(tmp_path, capsys):
    code = main(["data", "prepare", "movielens", "--raw", str(tmp_path), "--out", str(tmp_path / "ml")])
    assert code == 2 and "no ratings.csv" in capsys.readouterr().err
