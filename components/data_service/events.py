"""`gemrec data prepare events`: any CSV/Parquet event log with user_id, item_id, timestamp and more columns.

- Labels: `--label click` takes a 0/1 column; `--label buy=behavior==buy` or `--label like=rating>=4`
  derives one with `COLUMN OP VALUE`, OP in == != >= <= > <.
- Every other event column is an action of *past* events (seen on history tokens only): labels, numbers
  (scaled by their largest absolute value), and categorical columns with few values as one-hot actions
  `column=value`. Columns named with `--context` are request-time features of the target event instead.
- Side tables (`--items`, `--users`) join on item_id / user_id: float columns become dense features, the
  others categorical ones, `|` separating the values of a multi-valued cell.
- Ids may be numbers or strings. Id spaces (and categorical value spaces) larger than the hashing
  threshold are hashed into that many buckets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .builder import Categorical, EventLog, SideTable, SplitConfig, build_dataset, file_sha256, stable_hash
from .encoding import categorical_from_strings
from .errors import DataError
from .readers import fail_rows, parse_timestamps, read_table, require_non_null

ID_COLUMNS = {"user": "user_id", "item": "item_id"}
TIME_COLUMN = "timestamp"
ONE_HOT_MAX_VALUES = 32
OPERATORS = {
    "==": np.equal,
    "!=": np.not_equal,
    ">=": np.greater_equal,
    "<=": np.less_equal,
    ">": np.greater,
    "<": np.less,
}
EXPRESSION = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(==|!=|>=|<=|>|<)\s*(.+?)\s*$")
NAME = re.compile(r"^[A-Za-z_]\w*$")


@dataclass
class LabelSpec:
    name: str
    column: str
    operator: str | None = None  # None: the column itself holds 0/1
    value: str | None = None

    @classmethod
    def parse(cls, text: str) -> LabelSpec:
        name, sep, expression = text.partition("=")
        name = name.strip()
        if not NAME.match(name):
            raise DataError(f"--label {text!r}: label name {name!r} must be an identifier")
        if not sep:
            return cls(name, name)
        match = EXPRESSION.match(expression)
        if match is None:
            raise DataError(
                f"--label {text!r}: unknown label expression {expression!r}; "
                f"expected COLUMN OP VALUE with OP one of {' '.join(OPERATORS)}"
            )
        column, operator, value = match.groups()
        return cls(name, column, operator, value.strip().strip("'\""))

    def evaluate(self, path: Path, frame: pd.DataFrame) -> np.ndarray:
        if self.column not in frame.columns:
            raise DataError(f"{path}: label {self.name!r} needs column {self.column!r}; found {list(frame.columns)}")
        series = frame[self.column]
        fail_rows(path, self.column, series.isna().to_numpy(), series, f"missing value for label {self.name!r}")
        if self.operator is None:
            values = series.map(
                lambda v: {True: 1, False: 0, "true": 1, "false": 0}.get(
                    v.strip().lower() if isinstance(v, str) else v, v
                )
            )
            numeric = pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
            fail_rows(path, self.column, ~np.isin(numeric, (0.0, 1.0)), series, f"label {self.name!r} must be 0 or 1")
            return numeric.astype(np.int8)
        compare = OPERATORS[self.operator]
        if pd.api.types.is_numeric_dtype(series) or pd.api.types.is_bool_dtype(series):
            try:
                threshold = float(self.value)
            except ValueError as err:
                raise DataError(
                    f"--label {self.name}: column {self.column!r} is numeric, {self.value!r} is not a number"
                ) from err
            return compare(series.to_numpy(dtype=np.float64), threshold).astype(np.int8)
        if self.operator not in ("==", "!="):
            raise DataError(f"--label {self.name}: {self.operator} needs a numeric column, {self.column!r} holds text")
        return compare(series.astype(str).str.strip().to_numpy(dtype=object), self.value).astype(np.int8)


def normalize_ids(path: Path, frame: pd.DataFrame, column: str) -> np.ndarray:
    """int64 ids when the column is integral, else stripped strings; missing ids are errors."""
    series = frame[column]
    fail_rows(path, column, series.isna().to_numpy(), series, "missing id")
    if pd.api.types.is_integer_dtype(series):
        return series.to_numpy(dtype=np.int64)
    if pd.api.types.is_float_dtype(series):
        values = series.to_numpy(dtype=np.float64)
        if np.all(values == np.round(values)):
            return values.astype(np.int64)
    return series.astype(str).str.strip().to_numpy(dtype=object)


def _hash_values(feature: Categorical, buckets: int | None) -> Categorical:
    """Hash a categorical feature's values into `buckets` when it has more distinct values."""
    if buckets is None or feature.num_embeddings <= buckets or feature.value_names is None:
        return feature
    bucket_of = (stable_hash(np.asarray(feature.value_names, dtype=object)) % np.uint64(buckets)).astype(np.int64)
    return Categorical(feature.name, bucket_of[feature.values], feature.offsets, buckets, hashed=True)


def _prefixed(entity: str, column: str) -> str:
    return column if column.startswith(f"{entity}_") else f"{entity}_{column}"


def read_side_table(path: Path, entity: str, hash_over: int | None) -> SideTable:
    id_column = ID_COLUMNS[entity]
    frame = read_table(path, [id_column])
    raw_ids = normalize_ids(path, frame, id_column)
    categorical, dense = [], {}
    for column in frame.columns:
        if column == id_column:
            continue
        name = _prefixed(entity, column)
        series = frame[column]
        if pd.api.types.is_float_dtype(series):
            dense[name] = np.nan_to_num(series.to_numpy(dtype=np.float64), nan=0.0).astype(np.float32)
        else:
            categorical.append(_hash_values(categorical_from_strings(name, series), hash_over))
    return SideTable(source=str(path), raw_ids=raw_ids, categorical=categorical, dense=dense)


def read_event_log(
    path: Path,
    labels: list[LabelSpec],
    context: list[str],
    timestamp_unit: str = "auto",
    hash_over: int | None = None,
    split: SplitConfig | None = None,
) -> tuple[EventLog, dict]:
    """The event log and a report of how each extra column was used."""
    frame = read_table(path, [*ID_COLUMNS.values(), TIME_COLUMN, *context])
    require_non_null(path, frame, [TIME_COLUMN])
    timestamps, unit = parse_timestamps(path, frame[TIME_COLUMN], TIME_COLUMN, timestamp_unit)
    users = normalize_ids(path, frame, ID_COLUMNS["user"])
    items = normalize_ids(path, frame, ID_COLUMNS["item"])
    if not labels:
        raise DataError("at least one --label is required")
    names = [spec.name for spec in labels]
    if len(set(names)) != len(names):
        raise DataError(f"label names repeat: {names}")
    label_values = {spec.name: spec.evaluate(path, frame) for spec in labels}

    actions = {name: values.astype(np.float32) for name, values in label_values.items()}
    report = {"timestamp_unit": unit, "actions": {}, "ignored_columns": {}, "missing_action_values": {}}
    reserved = {*ID_COLUMNS.values(), TIME_COLUMN, *context}
    train = timestamps < (split or SplitConfig()).cutoff_for(timestamps)  # scales come from train time only
    for column in frame.columns:
        if column in reserved or column in actions:
            continue
        series = frame[column]
        if pd.api.types.is_bool_dtype(series) or pd.api.types.is_numeric_dtype(series):
            values = series.to_numpy(dtype=np.float64, na_value=np.nan)
            missing = int(np.count_nonzero(~np.isfinite(values)))
            values = np.where(np.isfinite(values), values, 0.0)
            scale = float(np.abs(values[train]).max(initial=0.0)) or 1.0
            actions[column] = (values / scale).astype(np.float32)
            report["actions"][column] = f"numeric / {scale:g}"
            if missing:
                report["missing_action_values"][column] = missing
            continue
        text = series.astype("string").str.strip()
        distinct = sorted(text.dropna().unique())
        if len(distinct) > ONE_HOT_MAX_VALUES:
            report["ignored_columns"][column] = (
                f"{len(distinct)} distinct values: too many for one-hot actions "
                "(name it with --context if it is known at request time)"
            )
            continue
        for value in distinct:
            action = f"{column}={value}"
            actions[action] = (text == value).fillna(False).to_numpy(dtype=np.float32)
        report["actions"][column] = f"one-hot over {len(distinct)} values"
    context_features = []
    for column in context:
        series = frame[column]
        fail_rows(path, column, series.isna().to_numpy(), series, "missing context value")
        feature = categorical_from_strings(_prefixed("ctx", column), series, sep=None)
        context_features.append(_hash_values(feature, hash_over))
    return EventLog(
        users=users, items=items, timestamps=timestamps, labels=label_values, actions=actions, context=context_features
    ), report


def prepare_events(
    out: Path,
    events: Path,
    labels: list[str],
    *,
    users: Path | None = None,
    items: Path | None = None,
    context: list[str] | None = None,
    timestamp_unit: str = "auto",
    hash_over: int | None = 5_000_000,
    name: str | None = None,
    split: SplitConfig | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    specs = [LabelSpec.parse(text) for text in labels]
    context = list(context or [])
    log, report = read_event_log(Path(events), specs, context, timestamp_unit, hash_over, split)
    item_table = read_side_table(Path(items), "item", hash_over) if items else None
    user_table = read_side_table(Path(users), "user", hash_over) if users else None
    inputs = [Path(p) for p in (events, items, users) if p]
    checksums = {p.name: "sha256:" + file_sha256(p) for p in inputs}
    buckets = {"user": hash_over, "item": hash_over} if hash_over else None
    return build_dataset(
        out,
        name=name or Path(events).stem,
        events=log,
        items=item_table,
        users=user_table,
        split=split,
        hash_buckets=buckets,
        input_checksums=checksums,
        extra={
            "source": {
                "events": str(events),
                "items": str(items) if items else None,
                "users": str(users) if users else None,
                "labels": {
                    s.name: s.column if s.operator is None else f"{s.column}{s.operator}{s.value}" for s in specs
                },
                "context": context,
                **report,
            }
        },
        overwrite=overwrite,
        progress=progress,
    )
