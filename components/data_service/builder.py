"""Write a dataset directory (format in docs/contracts.md) from an event log held in numpy arrays.

The readers of each source (MovieLens, any event log, the synthetic generator) turn their input into an
`EventLog` plus optional item/user `SideTable`s; `build_dataset` does the rest: id vocabularies (hashed
embedding ids for huge id spaces), dropping duplicate events, sorting each user's timeline once, the
leak-free example index (history = the user's events strictly before the target's timestamp), the temporal
split, side feature tables, manifest and checksums. It writes into a temporary folder beside `out` and
renames it at the end, so a failed build leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from gemrec.components.common import jagged
from tqdm import tqdm

from .aggregates import aggregate_feature_sources, aggregate_spec
from .dense_bins import dense_bins
from .errors import DataError

SCHEMA_VERSION = 2  # 2: point-in-time aggregate features of earlier events (aggregates.py)
# Dense features computed from the target event itself (request-time context), in this order.
TIME_FEATURES = ["hour_of_day_sin", "hour_of_day_cos", "day_of_week_sin", "day_of_week_cos"]
REQUIRED_FILES = [
    "manifest.json",
    "events.parquet",
    "timelines.parquet",
    "items.parquet",
    "users.parquet",
    "vocab/users.parquet",
    "vocab/items.parquet",
]


@dataclass
class Categorical:
    """A categorical feature, jagged over the rows of its table: row i has values[offsets[i]:offsets[i+1]]."""

    name: str
    values: np.ndarray  # int64 in [0, num_embeddings)
    offsets: np.ndarray  # int64, rows + 1
    num_embeddings: int
    value_names: list[str] | None = None  # readable value per index, written to vocab/features/
    hashed: bool = False

    @classmethod
    def single(cls, name: str, codes: np.ndarray, num_embeddings: int, **kwargs) -> Categorical:
        offsets = np.arange(len(codes) + 1, dtype=np.int64)
        return cls(name, np.asarray(codes, dtype=np.int64), offsets, num_embeddings, **kwargs)

    @property
    def multi_valued(self) -> bool:
        return bool(np.any(np.diff(self.offsets) != 1))


@dataclass
class SideTable:
    """Features of users or items, one row per raw id."""

    source: str  # file name or description, for error messages
    raw_ids: np.ndarray
    categorical: list[Categorical] = field(default_factory=list)
    dense: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class EventLog:
    """One row per event, in input order."""

    users: np.ndarray  # raw user ids (int or str)
    items: np.ndarray  # raw item ids
    timestamps: np.ndarray  # int64 unix seconds
    labels: dict[str, np.ndarray]  # prediction targets, 0/1
    actions: dict[str, np.ndarray]  # float signals of the event, seen only on history tokens (may repeat labels)
    context: list[Categorical] = field(default_factory=list)  # single-valued request-time features


@dataclass
class SplitConfig:
    """Global temporal split: examples at or after the cutoff are `eval`, the rest `train`.

    `by="leave_one_out"` (the sequential-recommendation papers' protocol) splits per user instead: the
    user's last event is `test`, the second-to-last `valid`, the rest `train`; users with fewer than 3
    events keep all their events in `train`.

    `by="last_event"`: each user's last event is the only example of that user (its history is all the
    user's earlier events); the latest `eval_fraction` of these examples (or those at or after `cutoff`)
    are `eval`, the rest `train`. The other events are history only.

    Time and event splits also carve `valid` out of the train period: its last `valid_fraction` (of the time
    range or of the events, as `by`) is held out for early stopping (never any of the eval period).
    """

    eval_fraction: float = 0.1
    by: str = "time"  # "time": the last fraction of the time range; "events": the last fraction of events
    cutoff: int | None = None  # explicit cutoff timestamp (overrides the fraction)
    valid_fraction: float = 0.1  # 0 = no valid split

    def masks(self, user: np.ndarray, timestamps: np.ndarray, timeline_ends: np.ndarray) -> dict[str, np.ndarray]:
        """Split name -> mask over the events (sorted by user, then time); `timeline_ends[u]` is one past
        user u's last event row."""
        if self.by == "leave_one_out":
            rows = np.arange(len(user), dtype=np.int64)
            from_end = timeline_ends[user] - 1 - rows
            long_enough = np.bincount(user, minlength=len(timeline_ends))[user] >= 3
            test = long_enough & (from_end == 0)
            valid = long_enough & (from_end == 1)
            return {"train": ~(test | valid), "valid": valid, "test": test}
        if self.by == "last_event":
            last = np.zeros(len(user), dtype=bool)
            last[timeline_ends[timeline_ends > 0] - 1] = True
            is_eval = last & (timestamps >= self.cutoff_for(timestamps[last]))
            return {"train": last & ~is_eval, "eval": is_eval}
        eval_cutoff = self.cutoff_for(timestamps)
        is_eval = timestamps >= eval_cutoff
        if self.valid_fraction == 0.0:
            return {"train": ~is_eval, "eval": is_eval}
        train = timestamps < self.valid_cutoff_for(timestamps, eval_cutoff)
        return {"train": train, "valid": ~train & ~is_eval, "eval": is_eval}

    def describe(self, timestamps: np.ndarray) -> dict:
        if self.by == "leave_one_out":
            return {"by": "leave_one_out"}
        if self.by == "last_event":  # the cutoff is over the users' last events (the splits' time ranges show it)
            return {"by": "last_event", "eval_fraction": self.eval_fraction, "cutoff": self.cutoff}
        cutoff = self.cutoff_for(timestamps)
        return {
            "by": self.by if self.cutoff is None else "cutoff",
            "eval_fraction": self.eval_fraction,
            "cutoff": cutoff,
            "valid_fraction": self.valid_fraction,
            "valid_cutoff": self.valid_cutoff_for(timestamps, cutoff),
        }

    def cutoff_for(self, timestamps: np.ndarray) -> int:
        if self.cutoff is not None:
            return int(self.cutoff)
        return _fraction_cutoff(timestamps, self.eval_fraction, self.by, "eval")

    def valid_cutoff_for(self, timestamps: np.ndarray, eval_cutoff: int) -> int:
        """Examples in [valid cutoff, eval cutoff) are `valid`; none where carving them would leave no train example."""
        train = timestamps[timestamps < eval_cutoff]
        if len(train) == 0:
            return eval_cutoff
        cutoff = _fraction_cutoff(train, self.valid_fraction, self.by, "valid")
        return cutoff if int(train.min()) < cutoff < eval_cutoff else eval_cutoff


def _fraction_cutoff(timestamps: np.ndarray, fraction: float, by: str, what: str) -> int:
    """The timestamp from which the last `fraction` of the time range (or of the events) starts."""
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"{what} fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return int(timestamps.max()) + 1
    if by == "time":
        first, last = int(timestamps.min()), int(timestamps.max())
        return first + int(np.ceil((last - first) * (1.0 - fraction)))
    if by in ("events", "last_event"):
        ordered = np.sort(timestamps)
        return int(ordered[min(len(ordered) - 1, int(len(ordered) * (1.0 - fraction)))])
    raise DataError(f"unknown split mode {by!r}; use 'time', 'events', 'leave_one_out' or 'last_event'")


def stable_hash(raw_ids: np.ndarray) -> np.ndarray:
    """uint64 hash of raw ids that is the same on every machine: splitmix64 for integers, SipHash
    (pandas.util.hash_array with its fixed key) of the string form otherwise."""
    raw_ids = np.asarray(raw_ids)
    if raw_ids.dtype.kind in "iu":
        x = raw_ids.astype(np.uint64)
        with np.errstate(over="ignore"):
            x = x + np.uint64(0x9E3779B97F4A7C15)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            return x ^ (x >> np.uint64(31))
    return pd.util.hash_array(raw_ids.astype(str).astype(object))


def _same_kind(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ids from two tables as comparable arrays (strings unless both are integers)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        return a.astype(np.int64), b.astype(np.int64)
    return a.astype(str).astype(object), b.astype(str).astype(object)


def _vocabulary(event_ids: np.ndarray, side: SideTable | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted unique raw ids, dense index of each event, side-table row of each dense index or -1)."""
    side_ids = side.raw_ids if side is not None else event_ids[:0]
    event_ids, side_ids = _same_kind(event_ids, side_ids)
    codes, uniques = pd.factorize(np.concatenate([event_ids, side_ids]), sort=True)
    codes = codes.astype(np.int64)
    side_rows = np.full(len(uniques), -1, dtype=np.int64)
    if side is not None:
        side_codes = codes[len(event_ids) :]
        if len(np.unique(side_codes)) != len(side_codes):
            dup = pd.Series(side_ids)[pd.Series(side_codes).duplicated()].iloc[0]
            raise DataError(f"{side.source}: duplicate id {dup!r}")
        side_rows[side_codes] = np.arange(len(side_codes))
    return np.asarray(uniques), codes[: len(event_ids)], side_rows


def _list_array(values: np.ndarray, offsets: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32) if offsets[-1] < 2**31 else offsets), pa.array(values.astype(np.int64))
    )


def _length_stats(lengths: np.ndarray) -> dict[str, int]:
    if len(lengths) == 0:
        return {"p50": 0, "p90": 0, "p99": 0, "max": 0, "mean": 0.0}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {
        "p50": int(p50),
        "p90": int(p90),
        "p99": int(p99),
        "max": int(lengths.max()),
        "mean": round(float(lengths.mean()), 2),
    }


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def dataset_checksum(root: Path) -> str:
    """sha256 over (relative path, file sha256) of every file of the dataset except manifest.json."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json"):
        digest.update(f"{path.relative_to(root).as_posix()}\0{file_sha256(path)}\n".encode())
    return "sha256:" + digest.hexdigest()


def _side_columns(
    entity: str, side: SideTable | None, side_rows: np.ndarray, embedding_ids: np.ndarray, num_entities: int
) -> tuple[dict[str, pa.Array], list[Categorical], list[str]]:
    """Side-table columns aligned to dense indices (missing rows: no values, dense 0)."""
    columns: dict[str, pa.Array] = {
        entity: pa.array(np.arange(num_entities, dtype=np.int64)),
        f"{entity}_id": pa.array(embedding_ids),
    }
    if side is None:
        return columns, [], []
    for feature in side.categorical:
        if len(feature.offsets) != len(side.raw_ids) + 1:
            raise DataError(
                f"{side.source}: feature {feature.name} has {len(feature.offsets) - 1} rows, "
                f"expected {len(side.raw_ids)}"
            )
        values, lengths = jagged.gather(feature.values, feature.offsets, side_rows)
        offsets = np.zeros(num_entities + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        columns[feature.name] = _list_array(values, offsets)
    dense_names = []
    for name, values in side.dense.items():
        values = np.asarray(values, dtype=np.float32)
        aligned = np.where(side_rows >= 0, values[np.maximum(side_rows, 0)], 0.0).astype(np.float32)
        columns[name] = pa.array(np.nan_to_num(aligned, nan=0.0))
        dense_names.append(name)
    return columns, list(side.categorical), dense_names


def _write_vocab(path: Path, uniques: np.ndarray, embedding_ids: np.ndarray) -> None:
    table = pa.table(
        {
            "raw_id": pa.array(uniques.astype(str)),
            "index": pa.array(np.arange(len(uniques), dtype=np.int64)),
            "embedding_id": pa.array(embedding_ids),
        }
    )
    pq.write_table(table, path)


def _embedding_ids(uniques: np.ndarray, buckets: int | None) -> tuple[np.ndarray, int, bool]:
    """Index into the id embedding table: the dense index, or a stable hash bucket for huge id spaces."""
    if buckets is None or len(uniques) <= buckets:
        return np.arange(len(uniques), dtype=np.int64), len(uniques), False
    return (stable_hash(uniques) % np.uint64(buckets)).astype(np.int64), int(buckets), True


def _remove_stale_temp(out: Path) -> None:
    """Temp folders a prepare of `out` left when it was killed (named after its pid, now dead)."""
    for path in [*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")]:
        pid = path.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, someone else's
            pass


def build_dataset(
    out: Path,
    *,
    name: str,
    events: EventLog,
    items: SideTable | None = None,
    users: SideTable | None = None,
    split: SplitConfig | None = None,
    seq_item_features: list[str] | None = None,
    hash_buckets: dict[str, int] | None = None,
    max_history: int | None = None,
    aggregates: bool = True,
    aggregate_category: str | None = None,
    input_checksums: dict[str, str] | None = None,
    extra: dict | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write the dataset directory `out` and return it. See the module docstring.

    `max_history`: keep only the most recent `max_history` events of every example's history (None: all).
    `aggregates`: add the point-in-time aggregate dense features (aggregates.py); `aggregate_category`: an item
    categorical feature (e.g. `item_genres`) that adds the user's earlier means on the target item's categories."""
    out = Path(out)
    occupied = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if occupied and not overwrite:
        raise DataError(f"{out}: already exists (pass --overwrite to replace it)")
    split = split or SplitConfig()
    hash_buckets = hash_buckets or {}
    if max_history is not None and max_history < 1:
        raise DataError(f"max_history must be >= 1, got {max_history}")
    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    steps = tqdm(total=7, desc=f"prepare {name}", unit="step", disable=not progress, leave=False)
    try:
        (tmp / "examples").mkdir(parents=True)
        (tmp / "vocab").mkdir()
        manifest = _build(
            tmp,
            name,
            events,
            items,
            users,
            split,
            seq_item_features,
            hash_buckets,
            max_history,
            aggregates,
            aggregate_category,
            steps,
        )
        if manifest["dense_features"]:
            manifest["dense_bins"] = _dense_bins(tmp, manifest)
        manifest["checksums"] = dict(sorted((input_checksums or {}).items()))
        manifest.update(extra or {})
        manifest["prepare_seconds"] = round(time.perf_counter() - started, 3)
        manifest["dataset_checksum"] = dataset_checksum(tmp)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        steps.update()
        if out.exists():
            trash = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(trash)
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        steps.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dense_bins(root: Path, manifest: dict) -> dict:
    """The manifest's dense_bins of the dataset written at `root`: read back through `Dataset.collate`, the code
    that training and serving use, so the edges are of exactly the values the model sees."""
    from .dataset import Dataset  # dataset.py reads manifests through this module

    return dense_bins(Dataset(root, manifest))


def _build(
    tmp: Path,
    name: str,
    events: EventLog,
    items: SideTable | None,
    users: SideTable | None,
    split: SplitConfig,
    seq_item_features: list[str] | None,
    hash_buckets: dict[str, int],
    max_history: int | None,
    aggregates: bool,
    aggregate_category: str | None,
    steps: tqdm,
) -> dict:
    num_input = len(events.timestamps)
    if num_input == 0:
        raise DataError("the event log has no events")
    for column in [events.users, events.items, *events.labels.values(), *events.actions.values()]:
        if len(column) != num_input:
            raise DataError("event columns differ in length")

    steps.set_postfix_str("vocabularies")
    user_uniques, user, user_side_rows = _vocabulary(events.users, users)
    item_uniques, item, item_side_rows = _vocabulary(events.items, items)
    num_users, num_items = len(user_uniques), len(item_uniques)
    user_embedding, user_buckets, user_hashed = _embedding_ids(user_uniques, hash_buckets.get("user"))
    item_embedding, item_buckets, item_hashed = _embedding_ids(item_uniques, hash_buckets.get("item"))
    timestamps = np.asarray(events.timestamps, dtype=np.int64)
    steps.update()

    steps.set_postfix_str("sort timelines")
    # Rows that go back in time within their user's input order.
    by_user = np.argsort(user, kind="stable")
    same_user = user[by_user][1:] == user[by_user][:-1]
    unsorted_rows = int(np.count_nonzero(same_user & (timestamps[by_user][1:] < timestamps[by_user][:-1])))
    order = np.lexsort((item, timestamps, user))  # stable: equal keys keep input order
    user, item, timestamps = user[order], item[order], timestamps[order]
    # Duplicate events (same user, item, timestamp): the last one in input order wins.
    last_of_key = np.ones(len(order), dtype=bool)
    last_of_key[:-1] = (user[1:] != user[:-1]) | (item[1:] != item[:-1]) | (timestamps[1:] != timestamps[:-1])
    keep = order[last_of_key]
    user, item, timestamps = user[last_of_key], item[last_of_key], timestamps[last_of_key]
    num_events = len(keep)
    steps.update()

    steps.set_postfix_str("example index")
    timeline_lengths = np.bincount(user, minlength=num_users).astype(np.int64)
    timeline_starts = np.zeros(num_users, dtype=np.int64)
    np.cumsum(timeline_lengths[:-1], out=timeline_starts[1:])
    rows = np.arange(num_events, dtype=np.int64)
    new_moment = np.ones(num_events, dtype=bool)
    new_moment[1:] = (user[1:] != user[:-1]) | (timestamps[1:] != timestamps[:-1])
    # History of event i: the user's events before the first event at the same (user, timestamp).
    hist_end = np.maximum.accumulate(np.where(new_moment, rows, 0))
    hist_start = timeline_starts[user]
    if max_history is not None:
        hist_start = np.maximum(hist_start, hist_end - max_history)
    split_masks = split.masks(user, timestamps, timeline_starts + timeline_lengths)
    split_info = split.describe(timestamps)
    if not np.any(split_masks["train"]):
        raise DataError(f"the train split is empty ({split_info}); lower the eval fraction")
    labels = {}
    for label, values in events.labels.items():
        values = np.asarray(values)[keep]
        bad = ~np.isin(values, (0, 1))
        if np.any(bad):
            raise DataError(f"label {label!r} has a value that is not 0/1: {values[bad][0]!r}")
        labels[label] = values.astype(np.int8)
    steps.update()

    steps.set_postfix_str("write events")
    actions = {n: np.asarray(v, dtype=np.float32)[keep] for n, v in events.actions.items()}
    for action, values in actions.items():
        if not np.all(np.isfinite(values)):
            raise DataError(f"action column {action!r} has NaN or infinite values")
    context = {}
    for feature in events.context:
        if feature.multi_valued or len(feature.values) != num_input:
            raise DataError(f"context feature {feature.name!r} must have one value per event")
        context[feature.name] = feature.values[keep]
    pq.write_table(
        pa.table(
            {
                "user": user,
                "item": item,
                "timestamp": timestamps,
                **{n: pa.array(v) for n, v in actions.items()},
                **{n: pa.array(v) for n, v in context.items()},
            }
        ),
        tmp / "events.parquet",
        row_group_size=1 << 20,
    )
    pq.write_table(
        pa.table({"user": np.arange(num_users, dtype=np.int64), "start": timeline_starts, "length": timeline_lengths}),
        tmp / "timelines.parquet",
    )
    steps.update()

    steps.set_postfix_str("write examples")
    splits, label_rates, history_lengths = {}, {}, []
    for split_name, mask in split_masks.items():
        idx = np.flatnonzero(mask)
        table = {
            "user": user[idx],
            "event": idx,
            "hist_start": hist_start[idx],
            "hist_end": hist_end[idx],
            "timestamp": timestamps[idx],
            **{n: v[idx] for n, v in labels.items()},
        }
        pq.write_table(pa.table(table), tmp / "examples" / f"{split_name}.parquet", row_group_size=1 << 20)
        lengths = hist_end[idx] - hist_start[idx]
        history_lengths.append(lengths)
        splits[split_name] = {
            "num_examples": len(idx),
            "time_range": [int(timestamps[idx].min()), int(timestamps[idx].max())] if len(idx) else None,
            "history_length": _length_stats(lengths),
        }
        label_rates[split_name] = {n: round(float(v[idx].mean()), 6) if len(idx) else None for n, v in labels.items()}
    steps.update()

    steps.set_postfix_str("side tables")
    item_columns, item_features, item_dense = _side_columns("item", items, item_side_rows, item_embedding, num_items)
    user_columns, user_features, user_dense = _side_columns("user", users, user_side_rows, user_embedding, num_users)
    pq.write_table(pa.table(item_columns), tmp / "items.parquet")
    pq.write_table(pa.table(user_columns), tmp / "users.parquet")
    _write_vocab(tmp / "vocab" / "users.parquet", user_uniques, user_embedding)
    _write_vocab(tmp / "vocab" / "items.parquet", item_uniques, item_embedding)
    named = [f for f in [*user_features, *item_features, *events.context] if f.value_names is not None]
    if named:
        (tmp / "vocab" / "features").mkdir()
    for feature in named:
        pq.write_table(
            pa.table(
                {
                    "value": pa.array([str(v) for v in feature.value_names]),
                    "index": pa.array(np.arange(len(feature.value_names), dtype=np.int64)),
                }
            ),
            tmp / "vocab" / "features" / f"{feature.name}.parquet",
        )
    steps.update()

    sparse = [
        {
            "name": "user_id",
            "source": "user",
            "num_embeddings": user_buckets,
            "multi_valued": False,
            "hashed": user_hashed,
        },
        {
            "name": "item_id",
            "source": "item",
            "num_embeddings": item_buckets,
            "multi_valued": False,
            "hashed": item_hashed,
        },
    ]
    for source, features in (("user", user_features), ("item", item_features), ("event", events.context)):
        for feature in features:
            sparse.append(
                {
                    "name": feature.name,
                    "source": source,
                    "num_embeddings": int(feature.num_embeddings),
                    "multi_valued": feature.multi_valued,
                    "hashed": feature.hashed,
                }
            )
    names = [f["name"] for f in sparse]
    dense_sources = {
        **{n: "time" for n in TIME_FEATURES},
        **(aggregate_feature_sources(list(actions), aggregate_category) if aggregates else {}),
        **{n: "user" for n in user_dense},
        **{n: "item" for n in item_dense},
    }
    all_names = names + list(dense_sources) + list(actions) + list(labels)
    clashes = sorted({n for n in names + list(dense_sources) if all_names.count(n) > 1})
    if clashes:
        raise DataError(f"feature names used twice: {clashes}")
    item_feature_names = [f.name for f in item_features]
    if aggregate_category is not None and (not aggregates or aggregate_category not in item_feature_names):
        raise DataError(
            f"aggregate category {aggregate_category!r} needs the aggregates and an item feature of that name "
            f"(item features: {item_feature_names})"
        )
    if seq_item_features is None:
        seq_item_features = item_feature_names
    unknown = sorted(set(seq_item_features) - set(item_feature_names))
    if unknown:
        raise DataError(f"seq_item_features {unknown} are not item features ({item_feature_names})")
    all_lengths = np.concatenate(history_lengths)
    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "num_events": num_events,
        "num_users": num_users,
        "num_items": num_items,
        "labels": list(labels),
        "actions": list(actions),
        "sparse_features": sparse,
        "seq_item_features": list(seq_item_features),
        "dense_features": list(dense_sources),
        "dense_feature_sources": dense_sources,
        "splits": splits,
        "split": split_info,
        "max_history": max_history,
        "label_rates": label_rates,
        **({"aggregates": aggregate_spec(actions, split_masks["train"], aggregate_category)} if aggregates else {}),
        "max_seq_len": _length_stats(all_lengths),
        "timeline_length": _length_stats(timeline_lengths),
        "time_range": [int(timestamps.min()), int(timestamps.max())],
        "counts": {
            "input_events": num_input,
            "duplicates_dropped": num_input - num_events,
            "unsorted_input_rows": unsorted_rows,
        },
    }


def read_manifest(path: str | Path) -> dict:
    """The manifest of a complete dataset directory (DataError naming what is wrong otherwise)."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: not a dataset directory")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise DataError(f"{path}: not a complete dataset (missing {', '.join(missing)})")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path / 'manifest.json'}: invalid JSON ({err})") from err
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if version != SCHEMA_VERSION:
        raise DataError(
            f"{path / 'manifest.json'}: schema_version {version!r}, this code reads {SCHEMA_VERSION} "
            "(prepare the dataset again with this version of gemrec)"
        )
    return manifest
