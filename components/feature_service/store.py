"""Online feature stores: user/item features by dense id, and users' recent event histories.

Both stores implement the `FeatureSource` protocol of docs/contracts.md,
`lookup(entity, ids, names) -> {name: (values, lengths)}`, plus `user_history(users, before_ts, max_len)`.
`MemoryStore` holds the dataset's columns in numpy arrays; `RedisStore` reads what `materialize` wrote
into Redis: one hash per (entity, feature) mapping id -> raw little-endian bytes of that id's values, so
a lookup of many ids and features is one pipelined round trip of HMGETs and one `b"".join` per feature.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from gemrec.components.common import jagged
from gemrec.components.common.grpc_server import InvalidArgument, NotFound, ServiceError, Unavailable

ENTITIES = ("user", "item")
LENGTH_DTYPE = np.int64


@dataclass
class FeatureInfo:
    name: str
    dtype: str  # "int64" or "float32"
    multi_valued: bool
    num_embeddings: int = 0
    max_length: int = 0  # most values of one id (0: unknown, a schema materialized before it was recorded)


@dataclass
class EntityInfo:
    name: str
    num_ids: int
    features: dict[str, FeatureInfo] = field(default_factory=dict)


@dataclass
class StoreSchema:
    dataset: str
    dataset_checksum: str
    entities: dict[str, EntityInfo]
    actions: list[str]

    def to_json(self) -> str:
        return json.dumps(
            {
                "dataset": self.dataset,
                "dataset_checksum": self.dataset_checksum,
                "actions": self.actions,
                "entities": {
                    n: {"num_ids": e.num_ids, "features": [asdict(f) for f in e.features.values()]}
                    for n, e in self.entities.items()
                },
            }
        )

    @classmethod
    def from_json(cls, text: str) -> StoreSchema:
        raw = json.loads(text)
        entities = {
            n: EntityInfo(n, e["num_ids"], {f["name"]: FeatureInfo(**f) for f in e["features"]})
            for n, e in raw["entities"].items()
        }
        return cls(raw["dataset"], raw["dataset_checksum"], entities, raw["actions"])

    def resolve(self, entity: str, ids: np.ndarray, names: list[str] | None) -> tuple[EntityInfo, list[str]]:
        """Validate a lookup; returns the entity and the feature names (all when `names` is empty)."""
        info = self.entities.get(entity)
        if info is None:
            raise NotFound(f"unknown entity {entity!r}; known: {', '.join(self.entities)}")
        names = list(names) if names else list(info.features)
        for name in names:
            if name not in info.features:
                raise NotFound(f"unknown feature {name!r} of entity {entity!r}; known: {', '.join(info.features)}")
        if len(ids):
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= info.num_ids:
                bad = low if low < 0 else high
                raise NotFound(f"{entity} id {bad} not found: ids are dense indices in [0, {info.num_ids})")
        return info, names


def _read_manifest(dataset: Path) -> dict:
    path = Path(dataset) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{dataset}: not a dataset directory (no manifest.json)")
    return json.loads(path.read_text())


def _column_to_jagged(column: pa.ChunkedArray) -> tuple[FeatureInfo | None, np.ndarray, np.ndarray]:
    """(info without name, values, offsets) of one side-table column."""
    column = column.combine_chunks()
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        offsets = column.offsets.to_numpy().astype(np.int64)
        values = column.values.to_numpy(zero_copy_only=False)
        values = values[offsets[0] : offsets[-1]]
        offsets = offsets - offsets[0]
        multi = True
    else:
        values = column.to_numpy(zero_copy_only=False)
        offsets = np.arange(len(values) + 1, dtype=np.int64)
        multi = False
    dtype = "float32" if values.dtype.kind == "f" else "int64"
    max_length = int(np.diff(offsets).max(initial=0))
    return FeatureInfo("", dtype, multi, max_length=max_length), values.astype(dtype, copy=False), offsets


def cut_histories(
    starts: np.ndarray, ends: np.ndarray, timestamps: np.ndarray, before_ts: np.ndarray, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the most recent `max_len` events strictly before `before_ts` of the timeline
    timestamps[starts:ends] (sorted by time). Returns (starts, lengths).

    A vectorised binary search over all rows at once, in int64: no packing of time into a wider key.
    """
    lo, hi = np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)
    before_ts = np.asarray(before_ts, dtype=np.int64)
    while True:
        active = lo < hi
        if not active.any():
            break
        mid = (lo + hi) // 2
        right = active & (timestamps[np.where(active, mid, 0)] < before_ts)
        lo = np.where(right, mid + 1, lo)
        hi = np.where(active & ~right, mid, hi)
    first = np.maximum(starts, lo - max_len)
    return first, (lo - first).astype(LENGTH_DTYPE)


def check_history_args(users: np.ndarray, before_ts: np.ndarray, max_len: int, num_users: int) -> np.ndarray:
    if max_len <= 0:
        raise InvalidArgument(f"max_len must be positive, got {max_len}")
    if len(before_ts) == 1 and len(users) != 1:
        before_ts = np.full(len(users), before_ts[0], dtype=np.int64)
    if len(before_ts) != len(users):
        raise InvalidArgument(f"{len(before_ts)} timestamps for {len(users)} users (give one per user or one)")
    if len(users) and (users.min() < 0 or users.max() >= num_users):
        bad = users.min() if users.min() < 0 else users.max()
        raise NotFound(f"user id {bad} not found: ids are dense indices in [0, {num_users})")
    return before_ts


class _Timelines:
    """Every user's events (sorted by time), from events.parquet and timelines.parquet."""

    def __init__(self, dataset: Path, actions: list[str], item_embedding: np.ndarray):
        events = pq.read_table(dataset / "events.parquet", columns=["item", "timestamp", *actions])
        self.items = events["item"].to_numpy().astype(np.int64)
        self.item_ids = item_embedding[self.items]  # the `item_id` feature: dense index or hash bucket
        self.timestamps = events["timestamp"].to_numpy().astype(np.int64)
        self.actions = np.stack(
            [events[a].to_numpy().astype(np.float32) for a in actions] or [np.zeros(len(self.items), np.float32)],
            axis=1,
        )[:, : len(actions)]
        timelines = pq.read_table(dataset / "timelines.parquet").to_pandas().sort_values("user")
        self.offsets = np.zeros(len(timelines) + 1, dtype=np.int64)
        self.offsets[1:] = timelines["start"].to_numpy() + timelines["length"].to_numpy()
        self.offsets[:-1] = timelines["start"].to_numpy()


class MemoryStore:
    """Columnar numpy arrays loaded from a dataset directory (the default store)."""

    kind = "memory"
    fetches_whole_timelines = False

    def __init__(self, dataset: str | Path):
        dataset = Path(dataset)
        manifest = _read_manifest(dataset)
        sparse = {f["name"]: f for f in manifest["sparse_features"]}
        self.columns: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        entities = {}
        for entity in ENTITIES:
            table = pq.read_table(dataset / f"{entity}s.parquet")
            if entity in table.column_names:  # rows by dense index
                order = np.argsort(table[entity].to_numpy(), kind="stable")
                table = table.take(pa.array(order)).drop_columns([entity])
            info = EntityInfo(entity, table.num_rows)
            self.columns[entity] = {}
            for name in table.column_names:
                feature, values, offsets = _column_to_jagged(table[name])
                feature.name = name
                if name in sparse:  # a list column may still hold one value per id
                    feature.num_embeddings = int(sparse[name]["num_embeddings"])
                    feature.multi_valued = bool(sparse[name]["multi_valued"])
                info.features[name] = feature
                self.columns[entity][name] = (values, offsets)
            entities[entity] = info
        self.actions = list(manifest.get("actions", []))
        self.schema = StoreSchema(manifest["name"], manifest.get("dataset_checksum", ""), entities, self.actions)
        self._timelines = _Timelines(dataset, self.actions, self.columns["item"]["item_id"][0])

    def lookup(self, entity: str, ids: np.ndarray, names: list[str] | None = None) -> dict:
        ids = np.asarray(ids, dtype=np.int64)
        _, names = self.schema.resolve(entity, ids, names)
        return {n: jagged.gather(*self.columns[entity][n], ids) for n in names}

    def ping(self) -> None:
        """Always reachable (the arrays are in this process)."""

    def feature_nbytes(self, entity: str, ids: np.ndarray, names: list[str]) -> int:
        """Bytes of the values and lengths a lookup would return (exact; known names and ids)."""
        total = 0
        for name in names:
            values, offsets = self.columns[entity][name]
            total += int((offsets[ids + 1] - offsets[ids]).sum()) * values.dtype.itemsize + 8 * len(ids)
        return total

    def timeline_lengths(self, users: np.ndarray) -> np.ndarray:
        return np.diff(self._timelines.offsets)[users]

    def timelines(self, users: np.ndarray) -> tuple[np.ndarray, ...]:
        """(starts, ends, items, item_ids, timestamps, actions): each user's timeline is rows starts:ends of
        the arrays, here the store's own arrays (no copy)."""
        t = self._timelines
        return t.offsets[users], t.offsets[users + 1], t.items, t.item_ids, t.timestamps, t.actions

    def user_history(self, users: np.ndarray, before_ts: np.ndarray, max_len: int) -> dict[str, np.ndarray]:
        return user_history(self, users, before_ts, max_len)


def history_nbytes(store, users: np.ndarray, max_len: int) -> int:
    """Bytes a history request costs before it is answered: the response (each row's events, at most
    `max_len`), or the whole timelines of the distinct users when the store fetches those (Redis)."""
    unique, inverse = np.unique(np.asarray(users, dtype=np.int64), return_inverse=True)
    lengths = store.timeline_lengths(unique)
    rows = int(np.minimum(lengths[inverse], max_len).sum())
    if store.fetches_whole_timelines:
        rows = max(rows, int(lengths.sum()))
    return rows * (24 + 4 * len(store.actions)) + 8 * (len(users) + 1)


def user_history(store, users: np.ndarray, before_ts: np.ndarray, max_len: int) -> dict[str, np.ndarray]:
    """Jagged histories, oldest first: offsets (B+1), items (T, dense item index), item_ids (T, the
    `item_id` feature), timestamps (T), actions (T, num_actions). Repeated users are read once."""
    users = np.asarray(users, dtype=np.int64)
    before_ts = check_history_args(
        users, np.asarray(before_ts, dtype=np.int64).reshape(-1), max_len, store.schema.entities["user"].num_ids
    )
    unique, inverse = np.unique(users, return_inverse=True)
    starts, ends, items, item_ids, timestamps, actions = store.timelines(unique)
    starts, lengths = cut_histories(starts[inverse], ends[inverse], timestamps, before_ts, max_len)
    rows = jagged.ranges(starts, lengths)
    out_offsets = np.zeros(len(users) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out_offsets[1:])
    return {
        "offsets": out_offsets,
        "items": items[rows],
        "item_ids": item_ids[rows],
        "timestamps": timestamps[rows],
        "actions": actions[rows],
    }


def redis_prefix(schema: StoreSchema) -> str:
    digest = schema.dataset_checksum.split(":")[-1][:16] or schema.dataset
    return f"gemrec:{digest}"


def materialize(store: MemoryStore, redis_url: str, chunk: int = 4096, progress: bool = True) -> dict:
    """Write every feature and timeline of `store` into Redis with pipelined HSETs of `chunk` ids each.

    The schema key is written last, so a reader never sees a half-written dataset as complete.
    Returns counts (keys, fields, bytes, seconds).
    """
    import time

    import redis
    from tqdm import tqdm

    client = redis.Redis.from_url(redis_url)
    prefix = redis_prefix(store.schema)
    client.delete(f"{prefix}:schema")
    started, fields, nbytes = time.perf_counter(), 0, 0

    def columns():
        for entity, features in store.columns.items():
            for name, (values, offsets) in features.items():
                yield f"{prefix}:{entity}:{name}", values, offsets
        t = store._timelines
        yield f"{prefix}:history:items", t.items, t.offsets
        yield f"{prefix}:history:item_ids", t.item_ids, t.offsets
        yield f"{prefix}:history:timestamps", t.timestamps, t.offsets
        yield f"{prefix}:history:actions", t.actions, t.offsets

    jobs = list(columns())
    total = sum(len(offsets) - 1 for _, _, offsets in jobs)
    bar = tqdm(total=total, desc="materialize", unit="row", disable=not progress)
    for key, values, offsets in jobs:
        client.delete(key)
        row_bytes = values.dtype.itemsize * int(np.prod(values.shape[1:], dtype=np.int64))
        raw = np.ascontiguousarray(values).view(np.uint8).reshape(len(values), row_bytes)
        for lo in range(0, len(offsets) - 1, chunk):
            hi = min(lo + chunk, len(offsets) - 1)
            mapping = {i: raw[offsets[i] : offsets[i + 1]].tobytes() for i in range(lo, hi)}
            pipe = client.pipeline(transaction=False)
            pipe.hset(key, mapping=mapping)
            pipe.execute()
            fields += hi - lo
            nbytes += sum(map(len, mapping.values()))
            bar.update(hi - lo)
    bar.close()
    client.set(f"{prefix}:schema", store.schema.to_json())
    client.close()
    return {
        "prefix": prefix,
        "keys": len(jobs) + 1,
        "fields": fields,
        "bytes": nbytes,
        "seconds": round(time.perf_counter() - started, 3),
    }


class RedisStore:
    """Features and timelines materialized in Redis by `materialize` (same answers as `MemoryStore`)."""

    kind = "redis"
    fetches_whole_timelines = True

    def __init__(self, redis_url: str, dataset_checksum: str | None = None, dataset_name: str | None = None):
        import redis

        self.url = redis_url
        self.client = redis.Redis.from_url(redis_url, socket_connect_timeout=2.0, socket_timeout=10.0)
        key = f"gemrec:{(dataset_checksum or '').split(':')[-1][:16] or dataset_name}:schema"
        raw = self.client.get(key)
        if raw is None:
            raise FileNotFoundError(
                f"no materialized dataset at {redis_url} (key {key}); run `gemrec serve materialize` first"
            )
        self.schema = StoreSchema.from_json(raw.decode())
        self.prefix = redis_prefix(self.schema)
        self.actions = self.schema.actions
        self._dtypes = {
            (e, f.name): np.dtype(f.dtype).newbyteorder("<")
            for e, info in self.schema.entities.items()
            for f in info.features.values()
        }

    def _fetch(self, keys_dtypes: list[tuple[str, np.dtype]], ids: np.ndarray):
        """One pipelined round trip: HMGET of `ids` in each key -> [(values, lengths)] in order."""
        fields = ids.tolist()
        pipe = self.client.pipeline(transaction=False)
        for key, _ in keys_dtypes:
            pipe.hmget(key, fields)
        with self._errors():
            replies = pipe.execute() if fields else [[] for _ in keys_dtypes]
        out = []
        for (key, dtype), blobs in zip(keys_dtypes, replies):
            if any(b is None for b in blobs):
                missing = ids[[i for i, b in enumerate(blobs) if b is None][0]]
                raise NotFound(f"id {missing} missing from redis hash {key} (materialization incomplete?)")
            nbytes = np.fromiter((len(b) for b in blobs), dtype=LENGTH_DTYPE, count=len(blobs))
            out.append((np.frombuffer(b"".join(blobs), dtype=dtype), nbytes // dtype.itemsize))
        return out

    def lookup(self, entity: str, ids: np.ndarray, names: list[str] | None = None) -> dict:
        ids = np.asarray(ids, dtype=np.int64)
        _, names = self.schema.resolve(entity, ids, names)
        keys = [(f"{self.prefix}:{entity}:{n}", self._dtypes[(entity, n)]) for n in names]
        return dict(zip(names, self._fetch(keys, ids)))

    def feature_nbytes(self, entity: str, ids: np.ndarray, names: list[str]) -> int:
        """An upper bound from each feature's longest row (0 when the schema predates `max_length`)."""
        info = self.schema.entities[entity].features
        return sum(len(ids) * (info[n].max_length * self._dtypes[(entity, n)].itemsize + 8) for n in names)

    def timeline_lengths(self, users: np.ndarray) -> np.ndarray:
        """Events per user, from the stored value sizes (HSTRLEN), without fetching the timelines."""
        pipe = self.client.pipeline(transaction=False)
        key = f"{self.prefix}:history:timestamps"
        for user in users.tolist():
            pipe.hstrlen(key, user)
        with self._errors():
            return np.asarray(pipe.execute() if len(users) else [], dtype=np.int64) // 8

    def timelines(self, users: np.ndarray):
        """(starts, ends, items, item_ids, timestamps, actions) of the users' whole timelines, concatenated."""
        i64, f32 = np.dtype("<i8"), np.dtype("<f4")
        (items, lengths), (item_ids, _), (timestamps, _), (actions, _) = self._fetch(
            [(f"{self.prefix}:history:{name}", i64) for name in ("items", "item_ids", "timestamps")]
            + [(f"{self.prefix}:history:actions", f32)],
            users,
        )
        ends = np.cumsum(lengths)
        return ends - lengths, ends, items, item_ids, timestamps, actions.reshape(len(items), len(self.actions))

    def user_history(self, users: np.ndarray, before_ts: np.ndarray, max_len: int) -> dict[str, np.ndarray]:
        return user_history(self, users, before_ts, max_len)

    @contextlib.contextmanager
    def _errors(self):
        """Redis unreachable or timing out -> Unavailable (clients retry it); other Redis errors -> INTERNAL."""
        import redis

        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as err:
            raise Unavailable(f"redis at {self.url} is unreachable: {err}") from None
        except redis.RedisError as err:
            raise ServiceError(f"redis at {self.url}: {type(err).__name__}: {err}") from None

    def ping(self) -> None:
        with self._errors():
            self.client.ping()

    def close(self) -> None:
        self.client.close()
