"""Read a dataset directory (docs/contracts.md) and collate examples into `Batch`es.

Everything is vectorized numpy over the whole batch: an example's history is a row range of its user's
timeline in `events.parquet` (strictly before the target's timestamp), truncated to the most recent
`max_seq_len` events, gathered with one fancy index for all examples of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from gemrec.components.common import jagged

from .aggregates import ITEM_SOURCE, USER_SOURCE, HistoryAggregates
from .batch import Batch, keyed_jagged
from .builder import read_manifest
from .errors import DataError

ENTITIES = ("user", "item")


class FeatureSource(Protocol):
    """Side features by dense user/item index: {name: (values, lengths)}, one length per id.

    Categorical features give int64 values (jagged), dense features float32 values with length 1.
    """

    def lookup(self, entity: str, ids: np.ndarray, names: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]: ...


@dataclass
class Examples:
    """The example index of one split: arrays over its examples (see docs/contracts.md)."""

    user: np.ndarray
    event: np.ndarray
    hist_start: np.ndarray
    hist_end: np.ndarray
    timestamp: np.ndarray
    labels: np.ndarray  # (n, num_labels) float32


@dataclass
class _Jagged:
    """A categorical side feature by dense index; `single` when every row has exactly one value."""

    values: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    single: bool

    @classmethod
    def from_offsets(cls, values: np.ndarray, offsets: np.ndarray) -> _Jagged:
        lengths = np.diff(offsets)
        return cls(values, offsets, lengths, bool(np.all(lengths == 1)))

    def take(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values, lengths) of rows `ids` (all valid)."""
        if self.single:
            return self.values[ids], np.ones(len(ids), dtype=np.int64)
        lengths = self.lengths[ids]
        return self.values[jagged.ranges(self.offsets[ids], lengths)], lengths


@dataclass
class _SideFeatures:
    embedding_id: np.ndarray  # the `<entity>_id` feature: dense index or hash bucket
    categorical: dict[str, _Jagged]
    dense: dict[str, np.ndarray]


def _column(table: pa.Table, name: str, dtype) -> np.ndarray:
    return np.ascontiguousarray(table.column(name).to_numpy(), dtype=dtype)


def _read(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns, memory_map=True)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: unreadable dataset file ({err})") from err


def _as_kjt(keys: list[str], parts: list[tuple[np.ndarray, np.ndarray]]):
    values = np.concatenate([v for v, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
    lengths = np.concatenate([n for _, n in parts]) if parts else np.zeros(0, dtype=np.int64)
    return keyed_jagged(
        keys,
        torch.from_numpy(values.astype(np.int64, copy=False)),
        torch.from_numpy(lengths.astype(np.int64, copy=False)),
    )


class Dataset:
    """A prepared dataset held in memory; also a `FeatureSource` for its own user and item features."""

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest
        self.label_names: tuple[str, ...] = tuple(manifest["labels"])
        self.action_names: tuple[str, ...] = tuple(manifest["actions"])
        self.sparse_features: list[dict] = list(manifest["sparse_features"])
        self.seq_item_features: list[str] = list(manifest["seq_item_features"])
        self.dense_features: list[str] = list(manifest["dense_features"])
        self.dense_sources: dict[str, str] = dict(manifest["dense_feature_sources"])
        context = [f["name"] for f in self.sparse_features if f["source"] == "event"]

        events = _read(self.path / "events.parquet")
        self._event_item = _column(events, "item", np.int64)
        self._event_ts = _column(events, "timestamp", np.int64)
        self._event_actions = np.ascontiguousarray(
            np.stack([_column(events, a, np.float32) for a in self.action_names], axis=1)
            if self.action_names
            else np.zeros((len(self._event_item), 0), dtype=np.float32)
        )
        self._context = {n: _column(events, n, np.int64) for n in context}
        timelines = _read(self.path / "timelines.parquet")
        self._timeline_start = _column(timelines, "start", np.int64)
        self._timeline_length = _column(timelines, "length", np.int64)
        self._side = {entity: self._load_side(entity) for entity in ENTITIES}
        self._splits: dict[str, Examples] = {}
        self._per_event: dict[str, _Jagged] = {}
        self._token_bytes: np.ndarray | None = None
        self._aggregate_names = [n for n in self.dense_features if self.dense_sources[n] in (USER_SOURCE, ITEM_SOURCE)]
        self._aggregates = None
        if self._aggregate_names:
            self._aggregates = HistoryAggregates(
                _column(events, "user", np.int64),
                self._event_item,
                self._event_ts,
                self._event_actions,
                list(self.action_names),
                manifest["aggregates"],
                self._item_categories(manifest["aggregates"].get("category")),
            )

    def _item_categories(self, name: str | None) -> tuple[np.ndarray, np.ndarray] | None:
        """(values, offsets) by dense item index of the aggregates' category feature (None: none)."""
        if name is None:
            return None
        if name not in self._side["item"].categorical:
            raise DataError(f"{self.path}: aggregates.category {name!r} is not an item feature of this dataset")
        feature = self._side["item"].categorical[name]
        return feature.values, feature.offsets

    def _seq_feature(self, name: str, seq_items: np.ndarray, begin: np.ndarray, end: np.ndarray):
        """(values, lengths) of an item feature for the history tokens, events [begin, end) per example.

        Multi-valued features are laid out per event once (values of event 0's item, event 1's, ...), so a
        history's values are one contiguous range: B ranges to gather instead of one per token."""
        feature = self._side["item"].categorical[name]
        if feature.single:
            return feature.take(seq_items)
        if name not in self._per_event:
            values, lengths = feature.take(self._event_item)
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            self._per_event[name] = _Jagged(values, offsets, lengths, False)
        per_event = self._per_event[name]
        starts = per_event.offsets[begin]
        return per_event.values[jagged.ranges(starts, per_event.offsets[end] - starts)], feature.lengths[seq_items]

    @classmethod
    def open(cls, path: str | Path) -> Dataset:
        return cls(Path(path), read_manifest(path))

    def _load_side(self, entity: str) -> _SideFeatures:
        table = _read(self.path / f"{entity}s.parquet")
        categorical, dense = {}, {}
        for spec in self.sparse_features:
            if spec["source"] == entity and spec["name"] != f"{entity}_id":
                column = table.column(spec["name"]).combine_chunks()
                offsets = column.offsets.to_numpy().astype(np.int64)
                values = np.asarray(column.values.to_numpy(), dtype=np.int64)
                categorical[spec["name"]] = _Jagged.from_offsets(values, offsets)
        for name, source in self.dense_sources.items():
            if source == entity:
                dense[name] = _column(table, name, np.float32)
        return _SideFeatures(_column(table, f"{entity}_id", np.int64), categorical, dense)

    # -- examples --------------------------------------------------------------------------------------

    @property
    def splits(self) -> list[str]:
        return list(self.manifest["splits"])

    def num_examples(self, split: str) -> int:
        if split not in self.manifest["splits"]:
            raise DataError(f"{self.path}: no split {split!r} (have {self.splits})")
        return int(self.manifest["splits"][split]["num_examples"])

    def _split(self, split: str) -> Examples:
        if split not in self._splits:
            self.num_examples(split)
            table = _read(self.path / "examples" / f"{split}.parquet")
            labels = (
                np.stack([_column(table, n, np.float32) for n in self.label_names], axis=1)
                if self.label_names
                else np.zeros((table.num_rows, 0), dtype=np.float32)
            )
            self._splits[split] = Examples(
                *(_column(table, c, np.int64) for c in ("user", "event", "hist_start", "hist_end", "timestamp")),
                labels=np.ascontiguousarray(labels),
            )
        return self._splits[split]

    def examples(self, split: str) -> Examples:
        """The example index of `split`, in file order."""
        return self._split(split)

    @property
    def event_items(self) -> np.ndarray:
        """The dense item index of every event row of events.parquet."""
        return self._event_item

    def timelines(self) -> tuple[np.ndarray, np.ndarray]:
        """(first event row, number of events) of every user's timeline, by dense user index."""
        return self._timeline_start, self._timeline_length

    def _rows(self, split: str, rows) -> tuple[Examples, np.ndarray]:
        data = self._split(split)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(data.event)):
            raise DataError(f"example rows out of range for split {split!r} ({len(data.event)} examples)")
        return data, rows

    def history_lengths(self, split: str, max_seq_len: int | None = None, rows=None) -> np.ndarray:
        """History length per example (all examples, or `rows`), truncated to max_seq_len when given."""
        data, rows = self._rows(split, np.arange(self.num_examples(split)) if rows is None else rows)
        lengths = data.hist_end[rows] - data.hist_start[rows]
        return lengths if max_seq_len is None else np.minimum(lengths, max_seq_len)

    def example_timestamps(self, split: str) -> np.ndarray:
        return self._split(split).timestamp

    def collate(self, split: str, rows, max_seq_len: int, features: FeatureSource | None = None) -> Batch:
        """A Batch of the given example rows of `split`. Non-sequence user/item features come from
        `features` (e.g. the feature service) when given, else from this dataset."""
        if max_seq_len < 0:
            raise DataError(f"max_seq_len must be >= 0, got {max_seq_len}")
        data, rows = self._rows(split, rows)
        source = features if features is not None else self
        user = data.user[rows]
        event = data.event[rows]
        timestamps = data.timestamp[rows]
        hist_end = data.hist_end[rows]
        lengths = np.minimum(hist_end - data.hist_start[rows], max_seq_len)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = jagged.ranges(hist_end - lengths, lengths)
        seq_items = self._event_item[tokens]
        target_items = self._event_item[event]
        item_embedding = self._side["item"].embedding_id

        wanted = {e: [f["name"] for f in self.sparse_features if f["source"] == e] for e in ENTITIES}
        dense_wanted = {e: [n for n in self.dense_features if self.dense_sources[n] == e] for e in ENTITIES}
        looked_up = {
            "user": source.lookup("user", user, wanted["user"] + dense_wanted["user"]),
            "item": source.lookup("item", target_items, wanted["item"] + dense_wanted["item"]),
        }
        sparse_parts = []
        for spec in self.sparse_features:
            if spec["source"] == "event":
                sparse_parts.append((self._context[spec["name"]][event], np.ones(len(rows), dtype=np.int64)))
            else:
                sparse_parts.append(looked_up[spec["source"]][spec["name"]])
        sparse = _as_kjt([f["name"] for f in self.sparse_features], sparse_parts)

        seq_features = None
        if self.seq_item_features:
            seq_features = _as_kjt(
                self.seq_item_features,
                [self._seq_feature(n, seq_items, hist_end - lengths, hist_end) for n in self.seq_item_features],
            )

        aggregates = {}
        if self._aggregates is not None:
            aggregates = self._aggregates.compute(
                self._aggregate_names, target_items, timestamps, data.hist_start[rows], hist_end
            )
        dense = np.zeros((len(rows), len(self.dense_features)), dtype=np.float32)
        for col, name in enumerate(self.dense_features):
            kind = self.dense_sources[name]
            if kind == "time":
                dense[:, col] = _time_feature(name, timestamps)
            elif name in aggregates:
                dense[:, col] = aggregates[name]
            else:
                dense[:, col] = looked_up[kind][name][0]

        return Batch(
            user_ids=torch.from_numpy(self._side["user"].embedding_id[user]),
            item_ids=torch.from_numpy(item_embedding[target_items]),
            timestamps=torch.from_numpy(timestamps),
            labels=torch.from_numpy(data.labels[rows]),
            dense_features=torch.from_numpy(dense),
            sparse_features=sparse,
            seq_offsets=torch.from_numpy(offsets),
            seq_item_ids=torch.from_numpy(item_embedding[seq_items]),
            seq_timestamps=torch.from_numpy(self._event_ts[tokens]),
            seq_actions=torch.from_numpy(self._event_actions[tokens]),
            seq_item_features=seq_features,
            max_seq_len=int(lengths.max(initial=0)),
            label_names=self.label_names,
        )

    def batch_nbytes(self, split: str, rows, max_seq_len: int) -> int:
        """Bytes of the arrays of `collate(split, rows, max_seq_len)`, from the stored lengths and without
        building it: O(1) per example (the data service refuses batches over its message limit with it)."""
        data, rows = self._rows(split, rows)
        hist_end = data.hist_end[rows]
        lengths = np.minimum(hist_end - data.hist_start[rows], max_seq_len)
        if self._token_bytes is None:  # bytes of each event as a history token, cumulated over events.parquet
            per_token = np.full(len(self._event_item), 16 + 4 * len(self.action_names), dtype=np.int64)
            for name in self.seq_item_features:
                per_token += 8 + 8 * self._side["item"].categorical[name].lengths[self._event_item]
            self._token_bytes = np.concatenate([[0], np.cumsum(per_token)])
        tokens = int((self._token_bytes[hist_end] - self._token_bytes[hist_end - lengths]).sum())
        ids = {"user": data.user[rows], "item": self._event_item[data.event[rows]]}
        values = 0
        for spec in self.sparse_features:
            side = self._side.get(spec["source"])
            feature = side.categorical.get(spec["name"]) if side is not None else None
            values += len(rows) if feature is None else int(feature.lengths[ids[spec["source"]]].sum())
        per_example = 32 + 4 * (len(self.label_names) + len(self.dense_features)) + 8 * len(self.sparse_features)
        return tokens + len(rows) * per_example + 8 * values + 8

    # -- FeatureSource and online lookups --------------------------------------------------------------

    def num_entities(self, entity: str) -> int:
        return len(self._side[entity].embedding_id)

    def lookup(self, entity: str, ids, names: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if entity not in ENTITIES:
            raise DataError(f"unknown entity {entity!r}; use 'user' or 'item'")
        side = self._side[entity]
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(side.embedding_id)):
            raise DataError(f"{entity} index out of range [0, {len(side.embedding_id)})")
        ones = np.ones(len(ids), dtype=np.int64)
        result = {}
        for name in names:
            if name == f"{entity}_id":
                result[name] = (side.embedding_id[ids], ones)
            elif name in side.categorical:
                result[name] = side.categorical[name].take(ids)
            elif name in side.dense:
                result[name] = (side.dense[name][ids], ones)
            else:
                raise DataError(f"unknown {entity} feature {name!r}")
        return result

    def user_history(self, user: int, before_ts: int, max_len: int) -> dict[str, np.ndarray]:
        """The user's most recent `max_len` events strictly before `before_ts`, oldest first:
        item_ids (embedding ids), items (dense item index), timestamps, actions (n, num_actions)."""
        if not 0 <= user < len(self._timeline_start):
            raise DataError(f"user index {user} out of range [0, {len(self._timeline_start)})")
        start = int(self._timeline_start[user])
        stop = start + int(self._timeline_length[user])
        end = start + int(np.searchsorted(self._event_ts[start:stop], before_ts, side="left"))
        begin = max(start, end - max(0, int(max_len)))
        items = self._event_item[begin:end]
        return {
            "item_ids": self._side["item"].embedding_id[items],
            "items": items,
            "timestamps": self._event_ts[begin:end],
            "actions": self._event_actions[begin:end],
        }


def _time_feature(name: str, timestamps: np.ndarray) -> np.ndarray:
    if name.startswith("hour_of_day"):
        phase = (timestamps % 86_400) / 86_400.0
    else:  # day_of_week; 1970-01-01 was a Thursday, so +3 puts Monday at 0
        phase = ((timestamps // 86_400 + 3) % 7) / 7.0
    angle = 2.0 * np.pi * phase
    return (np.sin(angle) if name.endswith("_sin") else np.cos(angle)).astype(np.float32)
