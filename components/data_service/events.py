"""`gemrec data prepare events`: any CSV/Parquet event log with user_id, item_id, timestamp and more columns.

- Labels: `--label click` takes a 0/1 column; `--label buy=behavior==buy` or `--label like=rating>=4`
  derives one with `COLUMN OP VALUE`, OP in == != >= <= > <.
- Every other event column is an action of *past* events (seen on history tokens only): labels, numbers
  (scaled by their largest absolute value), and categorical columns with few values as one-hot actions
  `column=value`. Integer columns with many distinct values are categorical (ids, not magnitudes) unless
  named with `--numeric`; `--categorical` makes any column categorical. Columns named with `--context` are
  request-time features of the target event instead; `--item-columns` / `--user-columns` are attributes of
  the item / user that live in the events file (their latest value per id): side features, like a side table.
- Side tables (`--items`, `--users`) join on item_id / user_id: float columns become dense features, the
  others categorical ones, `|` separating the values of a multi-valued cell.
- Ids may be numbers or strings (integers beyond int64, e.g. uint64, are kept as their decimal strings).
  Id spaces (and categorical value spaces) larger than the hashing threshold are hashed into that many buckets.
- The manifest's `source.columns` says how each column of the events file was used; binary columns are
  ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
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
    """int64 ids when the column is integral and fits int64, else stripped strings; missing ids are errors."""
    series = frame[column]
    fail_rows(path, column, series.isna().to_numpy(), series, "missing id")
    if pd.api.types.is_unsigned_integer_dtype(series) and series.max() >= 2**63:
        return series.astype(str).to_numpy(dtype=object)  # uint64 beyond int64: exact as text, never wrapped
    if pd.api.types.is_integer_dtype(series):
        return series.to_numpy(dtype=np.int64)
    if pd.api.types.is_float_dtype(series):
        values = series.to_numpy(dtype=np.float64)
        if np.all(values == np.round(values)) and np.all(np.abs(values) < 2**53):
            return values.astype(np.int64)
    return series.astype(str).str.strip().to_numpy(dtype=object)


def _is_binary(series: pd.Series) -> bool:
    return series.dtype == object and pd.api.types.infer_dtype(series, skipna=True) == "bytes"


def _hash_values(feature: Categorical, buckets: int | None) -> Categorical:
    """Hash a categorical feature's values into `buckets` when it has more distinct values."""
    if buckets is None or feature.num_embeddings <= buckets or feature.value_names is None:
        return feature
    bucket_of = (stable_hash(np.asarray(feature.value_names, dtype=object)) % np.uint64(buckets)).astype(np.int64)
    return Categorical(feature.name, bucket_of[feature.values], feature.offsets, buckets, hashed=True)


def _prefixed(entity: str, column: str) -> str:
    return column if column.startswith(f"{entity}_") else f"{entity}_{column}"


def side_table(
    frame: pd.DataFrame,
    entity: str,
    raw_ids: np.ndarray,
    source: str,
    hash_over: int | None,
    numeric: set[str] = frozenset(),
) -> SideTable:
    """Features of one row per raw id: float (or `numeric`) columns dense, binary ones skipped, the rest
    categorical with `|` between the values of a multi-valued cell."""
    categorical, dense = [], {}
    for column in frame.columns:
        name, series = _prefixed(entity, column), frame[column]
        if _is_binary(series):
            continue
        if pd.api.types.is_float_dtype(series) or column in numeric:
            values = pd.to_numeric(series, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
            dense[name] = np.nan_to_num(values, nan=0.0).astype(np.float32)
        else:
            categorical.append(_hash_values(categorical_from_strings(name, series), hash_over))
    return SideTable(source=source, raw_ids=raw_ids, categorical=categorical, dense=dense)


def read_side_frame(path: Path, entity: str) -> tuple[pd.DataFrame, np.ndarray]:
    """A side table file: its feature columns and the normalized raw id of each row."""
    id_column = ID_COLUMNS[entity]
    frame = read_table(path, [id_column])
    return frame.drop(columns=[id_column]), normalize_ids(path, frame, id_column)


@dataclass
class ColumnRoles:
    """What the user said about the events file's extra columns."""

    context: list[str] = field(default_factory=list)
    item: list[str] = field(default_factory=list)  # item attributes living in the events file
    user: list[str] = field(default_factory=list)
    categorical: list[str] = field(default_factory=list)
    numeric: list[str] = field(default_factory=list)

    def check(self, path: Path, columns: list[str], labels: list[LabelSpec]) -> None:
        named = {"--context": self.context, "--item-columns": self.item, "--user-columns": self.user}
        named |= {"--categorical": self.categorical, "--numeric": self.numeric}
        for flag, chosen in named.items():
            for column in chosen:
                if column not in columns:
                    raise DataError(f"{flag} {column!r}: not in {path} (columns: {columns})")
        reserved = {*ID_COLUMNS.values(), TIME_COLUMN}
        roles = {"--context": self.context, "--item-columns": self.item, "--user-columns": self.user}
        seen: dict[str, str] = {}
        for flag, chosen in [*roles.items(), ("--categorical", self.categorical), ("--numeric", self.numeric)]:
            for column in chosen:
                if column in reserved:
                    raise DataError(f"{flag} {column!r}: the id and timestamp columns have fixed roles")
                other = seen.get(column)
                clash = other is not None and (
                    {flag, other} <= set(roles) or {flag, other} == {"--categorical", "--numeric"}
                )
                if clash:
                    raise DataError(f"column {column!r} is named in both {other} and {flag}")
                seen.setdefault(column, flag)
        for column in self.item + self.user:
            if column in {spec.column for spec in labels}:
                raise DataError(f"column {column!r} feeds a label: it cannot also be an item or user attribute")


def _attributes(
    frame: pd.DataFrame, columns: list[str], raw_ids: np.ndarray, order: np.ndarray
) -> tuple[pd.DataFrame, np.ndarray, dict]:
    """The latest value of each attribute column per id (events in time order), the ids, and per column
    how many ids saw it change."""
    latest = frame[columns].iloc[order].assign(_id=raw_ids[order]).groupby("_id", sort=False)
    changed = {c: int((latest[c].nunique() > 1).sum()) for c in columns}
    last = latest.last()
    return last.reset_index(drop=True), np.asarray(last.index.to_numpy()), changed


def _outlier_warnings(timestamps: np.ndarray) -> list[str]:
    """Timestamps far outside the bulk of the log stretch a split by time."""
    q25, q75 = np.percentile(timestamps, [25, 75])
    spread = q75 - q25
    if spread <= 0:
        return []
    far = (timestamps < q25 - 10 * spread) | (timestamps > q75 + 10 * spread)
    if not far.any():
        return []
    low, high = (pd.Timestamp(int(t), unit="s").date() for t in (q25, q75))
    return [
        f"{int(far.sum())} timestamp(s) lie far outside the bulk of the log (half of it is within {low}..{high}), "
        f"e.g. {pd.Timestamp(int(timestamps[far][0]), unit='s')}: they stretch the time range a split by time cuts"
    ]


def read_event_log(
    path: Path,
    labels: list[LabelSpec],
    roles: ColumnRoles | None = None,
    timestamp_unit: str = "auto",
    hash_over: int | None = None,
    split: SplitConfig | None = None,
) -> tuple[EventLog, dict, dict[str, tuple[pd.DataFrame, np.ndarray]]]:
    """The event log, a report of how each column was used, and the item/user attribute columns of the
    events file ({entity: (latest value per id, ids)})."""
    roles = roles or ColumnRoles()
    frame = read_table(path, [*ID_COLUMNS.values(), TIME_COLUMN])
    roles.check(path, list(frame.columns), labels)
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
    uses = {ID_COLUMNS["user"]: "user id", ID_COLUMNS["item"]: "item id", TIME_COLUMN: f"timestamp ({unit})"}
    report = {"timestamp_unit": unit, "columns": uses, "missing_action_values": {}, "warnings": []}
    report["warnings"] += _outlier_warnings(timestamps)
    label_of = {spec.column: spec.name for spec in labels}
    for name in label_values:
        if name in frame.columns:
            uses[name] = f"label {name}, also an action"
    order = np.argsort(timestamps, kind="stable")
    attributes = {}
    for entity, columns, ids in (("item", roles.item, items), ("user", roles.user, users)):
        if columns:
            values, raw_ids, changed = _attributes(frame, columns, ids, order)
            attributes[entity] = (values, raw_ids)
            for column in columns:
                note = f"; {changed[column]:,} {entity}s changed value, the latest is kept" if changed[column] else ""
                uses[column] = f"{entity} feature {_prefixed(entity, column)}{note}"
    for column in roles.context:
        uses[column] = f"context feature {_prefixed('ctx', column)}"
    train = timestamps < (split or SplitConfig()).cutoff_for(timestamps)  # scales come from train time only
    for column in frame.columns:
        if column in uses or column in actions:
            continue
        series = frame[column]
        if _is_binary(series):
            uses[column] = "ignored: binary data"
            continue
        if column in label_of:
            uses[column] = f"source of label {label_of[column]}; "
        kind = _action_kind(series, column, roles)
        if kind == "numeric":
            values = pd.to_numeric(series, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
            missing = int(np.count_nonzero(~np.isfinite(values)))
            values = np.where(np.isfinite(values), values, 0.0)
            scale = float(np.abs(values[train]).max(initial=0.0)) or 1.0
            actions[column] = (values / scale).astype(np.float32)
            uses[column] = uses.get(column, "") + f"action: numeric / {scale:g}"
            if missing:
                report["missing_action_values"][column] = missing
            continue
        text = series.astype("string").str.strip()
        distinct = sorted(text.dropna().unique())
        if len(distinct) > ONE_HOT_MAX_VALUES:
            uses[column] = uses.get(column, "") + (
                f"ignored: {len(distinct)} distinct values, too many for one-hot actions (an item or user attribute: "
                "--item-columns / --user-columns; known at request time: --context; a magnitude: --numeric)"
            )
            continue
        for value in distinct:
            action = f"{column}={value}"
            actions[action] = (text == value).fillna(False).to_numpy(dtype=np.float32)
        uses[column] = uses.get(column, "") + f"action: one-hot over {len(distinct)} values"
    context_features = []
    for column in roles.context:
        series = frame[column]
        fail_rows(path, column, series.isna().to_numpy(), series, "missing context value")
        feature = categorical_from_strings(_prefixed("ctx", column), series, sep=None)
        context_features.append(_hash_values(feature, hash_over))
    log = EventLog(
        users=users, items=items, timestamps=timestamps, labels=label_values, actions=actions, context=context_features
    )
    return log, report, attributes


def _action_kind(series: pd.Series, column: str, roles: ColumnRoles) -> str:
    """ "numeric" or "categorical": bool and float columns are numbers, integer columns too unless they have
    many distinct values (ids, not magnitudes), text is categorical; --numeric/--categorical decide."""
    if column in roles.numeric:
        return "numeric"
    if column in roles.categorical:
        return "categorical"
    if pd.api.types.is_bool_dtype(series) or pd.api.types.is_float_dtype(series):
        return "numeric"
    if pd.api.types.is_integer_dtype(series):
        return "numeric" if series.nunique() <= ONE_HOT_MAX_VALUES else "categorical"
    return "categorical"


def _merged_side(
    path: Path | None,
    entity: str,
    attributes: tuple[pd.DataFrame, np.ndarray] | None,
    events_path: Path,
    hash_over: int | None,
    numeric: set[str],
) -> SideTable | None:
    """The side table file and the events file's attribute columns of one entity, joined on the id."""
    parts, sources = [], []
    if path is not None:
        parts.append(read_side_frame(path, entity))
        sources.append(str(path))
    if attributes is not None:
        parts.append(attributes)
        sources.append(f"{events_path} (--{entity}-columns)")
    if not parts:
        return None
    if len(parts) == 1:
        ((frame, raw_ids),) = parts
        return side_table(frame, entity, raw_ids, sources[0], hash_over, numeric)
    (left, left_ids), (right, right_ids) = parts
    clash = set(left.columns) & set(right.columns)
    if clash:
        raise DataError(f"{path} and --{entity}-columns both give column(s) {sorted(clash)}")
    as_text = not (np.asarray(left_ids).dtype.kind in "iu" and np.asarray(right_ids).dtype.kind in "iu")
    key = (lambda ids: np.asarray(ids).astype(str)) if as_text else (lambda ids: np.asarray(ids, dtype=np.int64))
    merged = left.assign(_id=key(left_ids)).merge(right.assign(_id=key(right_ids)), on="_id", how="outer")
    return side_table(
        merged.drop(columns=["_id"]), entity, merged["_id"].to_numpy(), " + ".join(sources), hash_over, numeric
    )


def prepare_events(
    out: Path,
    events: Path,
    labels: list[str],
    *,
    users: Path | None = None,
    items: Path | None = None,
    context: list[str] | None = None,
    item_columns: list[str] | None = None,
    user_columns: list[str] | None = None,
    categorical: list[str] | None = None,
    numeric: list[str] | None = None,
    timestamp_unit: str = "auto",
    hash_over: int | None = 5_000_000,
    name: str | None = None,
    split: SplitConfig | None = None,
    aggregate_category: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    specs = [LabelSpec.parse(text) for text in labels]
    roles = ColumnRoles(
        list(context or []),
        list(item_columns or []),
        list(user_columns or []),
        list(categorical or []),
        list(numeric or []),
    )
    log, report, attributes = read_event_log(Path(events), specs, roles, timestamp_unit, hash_over, split)
    numeric_set = set(roles.numeric)
    item_table = _merged_side(
        Path(items) if items else None, "item", attributes.get("item"), Path(events), hash_over, numeric_set
    )
    user_table = _merged_side(
        Path(users) if users else None, "user", attributes.get("user"), Path(events), hash_over, numeric_set
    )
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
        aggregate_category=aggregate_category,
        input_checksums=checksums,
        extra={
            "source": {
                "events": str(events),
                "items": str(items) if items else None,
                "users": str(users) if users else None,
                "labels": {
                    s.name: s.column if s.operator is None else f"{s.column}{s.operator}{s.value}" for s in specs
                },
                "context": roles.context,
                "item_columns": roles.item,
                "user_columns": roles.user,
                **report,
            }
        },
        overwrite=overwrite,
        progress=progress,
    )
