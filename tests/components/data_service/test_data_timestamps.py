"""Timestamps in any unit: detected (s, ms, us, ns, native Parquet timestamps) or refused naming the column,
row and accepted range; the feature store keeps 64-bit time, so histories never mix users."""

import numpy as np
import pandas as pd
import pytest
from gemrec.components.data_service.builder import EventLog, SplitConfig, build_dataset
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.errors import DataError
from gemrec.components.data_service.events import prepare_events
from gemrec.components.feature_service.service import FeatureServiceCore
from gemrec.components.feature_service.store import MemoryStore

SECONDS = np.array([1_700_000_000, 1_700_000_100, 1_700_000_050, 1_700_003_600, 1_700_000_200, 1_700_086_400])


def _events(timestamps) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "user_id": [1, 1, 2, 2, 3, 1],
            "item_id": [10, 11, 10, 12, 11, 12],
            "timestamp": timestamps,
            "click": [1, 0, 1, 0, 1, 1],
        }
    )


def _prepare(tmp_path, frame: pd.DataFrame, suffix: str = ".parquet", **kwargs):
    path = tmp_path / f"events{suffix}"
    frame.to_parquet(path) if suffix == ".parquet" else frame.to_csv(path, index=False)
    split = SplitConfig(cutoff=int(SECONDS.max()))
    return prepare_events(tmp_path / "out", path, ["click"], split=split, progress=False, **kwargs)


def _event_seconds(out) -> np.ndarray:
    return np.sort(Dataset.open(out)._event_ts)


@pytest.mark.parametrize(
    "timestamps",
    [
        SECONDS,
        SECONDS * 1_000,
        SECONDS * 1_000_000 + 999_999,
        SECONDS * 1_000_000_000 + 7,
        pd.to_datetime(SECONDS, unit="s"),
        pd.to_datetime(SECONDS, unit="s").as_unit("ms").tz_localize("UTC"),
        pd.to_datetime(SECONDS, unit="s").as_unit("us"),
    ],
    ids=["s", "ms", "us", "ns", "parquet-ns", "parquet-ms-utc", "parquet-us"],
)
def test_the_unit_is_detected(tmp_path, timestamps):
    out = _prepare(tmp_path, _events(timestamps))
    np.testing.assert_array_equal(_event_seconds(out), np.sort(SECONDS))


def test_milliseconds_in_csv_too(tmp_path):
    out = _prepare(tmp_path, _events(SECONDS * 1_000), suffix=".csv")
    np.testing.assert_array_equal(_event_seconds(out), np.sort(SECONDS))


@pytest.mark.parametrize(
    ("bad", "row"), [(-5e9, 3), (1e25, 4), (2**33, 2)], ids=["negative", "overflows-int64", "after-2106"]
)
def test_out_of_range_timestamp_names_column_row_and_range(tmp_path, bad, row):
    stamps = SECONDS.astype(np.float64)
    stamps[row] = bad
    with pytest.raises(DataError, match=rf"column 'timestamp', row {row}\b.*accepted range 1970-01-01 to 2106"):
        _prepare(tmp_path, _events(stamps))


def test_unit_that_cannot_be_told_is_refused(tmp_path):
    with pytest.raises(DataError, match=r"column 'timestamp'.*--timestamp-unit"):
        _prepare(tmp_path, _events(SECONDS // 100_000))  # ~17,000: seconds of 1970? ms? refuse, ask


def test_histories_of_many_users_with_64_bit_time(tmp_path):
    """Stored times far outside 32 bits (ns since 1970 and one far in the past): multi-user history calls
    give each user exactly their own events, as single-user ones do."""
    rng = np.random.default_rng(0)
    users = rng.integers(0, 40, size=600)
    stamps = 1_700_000_000_000_000_000 + rng.integers(0, 10**15, size=600)
    stamps[7] = -5_000_000_000
    log = EventLog(
        users=users,
        items=rng.integers(0, 50, size=600),
        timestamps=stamps,
        labels={"click": rng.integers(0, 2, size=600)},
        actions={"click": np.zeros(600, dtype=np.float32)},
    )
    out = build_dataset(tmp_path / "ds", name="t", events=log, split=SplitConfig(by="events"), progress=False)
    store, ds = MemoryStore(out), Dataset.open(out)
    core = FeatureServiceCore(store)
    everyone = np.arange(store.schema.entities["user"].num_ids)
    for _ in range(20):
        before = rng.choice(stamps, size=len(everyone)) + rng.integers(-1, 2, size=len(everyone))
        got = core.user_history(everyone, before, 30)
        for user in everyone:
            want = ds.user_history(int(user), int(before[user]), 30)
            part = slice(got["offsets"][user], got["offsets"][user + 1])
            np.testing.assert_array_equal(got["timestamps"][part], want["timestamps"], err_msg=f"user {user}")
            np.testing.assert_array_equal(got["items"][part], want["items"], err_msg=f"user {user}")
