"""Read CSV/Parquet tables and validate columns, with errors that name the file, column and row."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import DataError


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq")


def row_location(path: Path, row: int) -> str:
    """`row R` (0-based data row), plus the 1-based line number for CSV files with a header."""
    return f"row {row} (line {row + 2})" if not is_parquet(path) else f"row {row}"


def read_table(path: Path, required: list[str], *, dtype: dict | None = None) -> pd.DataFrame:
    """The whole table; `required` columns must be present. CSV or Parquet by suffix."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file")
    _check_header(path)
    if is_parquet(path):
        try:
            frame = pq.read_table(path).to_pandas()
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as err:
            raise DataError(f"{path}: corrupt or unreadable Parquet file ({err})") from err
    else:
        try:
            frame = pd.read_csv(path, dtype=dtype, keep_default_na=True, skipinitialspace=True)
        except pd.errors.EmptyDataError as err:
            raise DataError(f"{path}: empty file (no header)") from err
        except (pd.errors.ParserError, UnicodeDecodeError) as err:
            raise DataError(f"{path}: malformed CSV ({err})") from err
        except ValueError as err:  # a dtype that does not fit a value
            raise DataError(f"{path}: {err}") from err
    frame.columns = [str(c).strip() for c in frame.columns]
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; found {list(frame.columns)}")
    if len(frame) == 0:
        raise DataError(f"{path}: no data rows")
    return frame


def _check_header(path: Path) -> None:
    """Duplicate column names are refused (pandas would rename them `x.1` and use them as new columns)."""
    try:
        if is_parquet(path):
            names = pq.read_schema(path).names
        else:
            with open(path, newline="", encoding="utf-8", errors="replace") as f:
                names = next(csv.reader(f), [])
    except (pa.ArrowException, OSError):
        return  # unreadable: the reader below says so
    names = [str(n).strip() for n in names]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise DataError(f"{path}: duplicate column name(s) {duplicates} in the header; rename them")


def fail_rows(path: Path, column: str, bad: np.ndarray, values, problem: str) -> None:
    """Raise a DataError naming the first row where `bad` is true, if any."""
    bad_rows = np.flatnonzero(bad)
    if len(bad_rows) == 0:
        return
    row = int(bad_rows[0])
    value = values.iloc[row] if isinstance(values, pd.Series) else values[row]
    more = f" ({len(bad_rows)} bad rows in all)" if len(bad_rows) > 1 else ""
    shown = "<empty>" if pd.isna(value) else repr(value.item() if isinstance(value, np.generic) else value)
    raise DataError(f"{path}: column '{column}', {row_location(path, row)}: {problem}: {shown}{more}")


def require_non_null(path: Path, frame: pd.DataFrame, columns: list[str]) -> None:
    for column in columns:
        fail_rows(path, column, frame[column].isna().to_numpy(), frame[column], "missing value")


def parse_numeric(path: Path, series: pd.Series, column: str) -> np.ndarray:
    """float64 values of a numeric column; non-numbers and NaN are errors."""
    values = pd.to_numeric(series, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    fail_rows(path, column, ~np.isfinite(values), series, "not a finite number")
    return values


TIME_UNITS = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
SECONDS_RANGE = (0, 2**32)  # accepted unix seconds: 1970-01-01 up to 2106-02-07
ACCEPTED = "the accepted range 1970-01-01 to 2106-02-07 (unix seconds [0, 2^32))"
# A unit is detected when the median timestamp, read in it, falls in 1973..2106 (the windows do not overlap).
PLAUSIBLE_SECONDS = (1e8, 2.0**32)


def parse_timestamps(path: Path, series: pd.Series, column: str, unit: str = "auto") -> tuple[np.ndarray, str]:
    """(unix seconds as int64, the unit they were read in) from numbers in `unit` ("auto": detected from
    their magnitude), date/time strings or native (Parquet) timestamps. Values outside SECONDS_RANGE are
    errors naming the row."""
    if unit != "auto" and unit not in TIME_UNITS:
        raise DataError(f"unknown timestamp unit {unit!r}; use auto or one of {sorted(TIME_UNITS)}")
    if pd.api.types.is_datetime64_any_dtype(series):
        return _datetime_seconds(path, series, column, series), "datetime"
    numeric = pd.to_numeric(series, errors="coerce")
    if not (pd.api.types.is_numeric_dtype(series) or numeric.notna().mean() >= 0.5):  # date/time strings
        parsed = pd.to_datetime(series, errors="coerce", utc=True, format="mixed")
        fail_rows(path, column, parsed.isna().to_numpy(), series, "unparsable timestamp")
        return _datetime_seconds(path, parsed, column, series), "datetime"
    values = numeric.to_numpy(dtype=np.float64, na_value=np.nan)
    fail_rows(path, column, ~np.isfinite(values), series, "unparsable timestamp")
    if unit == "auto":
        unit = _detect_unit(path, column, values)
    factor = TIME_UNITS[unit]
    seconds = np.floor(values / factor)
    low, high = SECONDS_RANGE
    fail_rows(path, column, (seconds < low) | (seconds >= high), series, f"read in {unit}, outside {ACCEPTED}")
    if pd.api.types.is_integer_dtype(series):  # exact for ns-sized integers, which float64 rounds
        return series.to_numpy(dtype=np.int64) // factor, unit
    return seconds.astype(np.int64), unit


def _detect_unit(path: Path, column: str, values: np.ndarray) -> str:
    median = float(np.median(np.abs(values)))
    for unit, factor in TIME_UNITS.items():
        if PLAUSIBLE_SECONDS[0] <= median / factor < PLAUSIBLE_SECONDS[1]:
            return unit
    raise DataError(
        f"{path}: column '{column}': cannot tell the unit of numeric timestamps (median {median:g} is no plausible "
        f"date in s, ms, us or ns); pass --timestamp-unit s|ms|us|ns (dates must lie in {ACCEPTED})"
    )


def _datetime_seconds(path: Path, parsed: pd.Series, column: str, raw: pd.Series) -> np.ndarray:
    fail_rows(path, column, parsed.isna().to_numpy(), raw, "missing timestamp")
    if parsed.dt.tz is None:
        parsed = parsed.dt.tz_localize("UTC")
    seconds = ((parsed - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(seconds=1)).to_numpy(dtype=np.int64)
    low, high = SECONDS_RANGE
    fail_rows(path, column, (seconds < low) | (seconds >= high), raw, f"outside {ACCEPTED}")
    return seconds
