"""Point-in-time aggregates of earlier events: the long-term dense features a capped history window cannot see.

For an example (user u, target item i, time t) whose history is the rows [hist_start, hist_end) of
events.parquet (u's events strictly before t):

    history_length_log           log1p(number of u's earlier events) / log1p(longest timeline)
    user_seconds_since_last_log  log1p(t - u's latest earlier event) / log1p(time span of the log); 1 without one
    user_past_mean_<a>           mean of action a over all of u's earlier events
    user_recent_mean_<a>         the same over the last `recent_events` of them
    user_last<N>_mean_<a>        the same over the last N of them, N in WINDOWS (the window is in the name)
    user_past_resid_<a>          mean over u's earlier events e of (a of e - item_past_mean_<a> of e's item at e's
                                 time): how far u's actions sit above or below everyone's on the same items
    user_recent_resid_<a>        the same over the last `recent_events` of them
    item_past_count_log          log1p(events of item i strictly before t, by any user) / log1p(most events of an item)
    item_past_mean_<a>           mean of action a over those events

With a category feature (the manifest's `aggregates.category`, an item feature such as `item_genres`), the user's
earlier events on items sharing a category with i, pooled over i's categories (an event counts once per shared one):

    user_category_count_log      log1p(that count) / log1p(longest timeline)
    user_category_mean_<a>       mean of action a over them, shrunk towards user_past_mean_<a> (not the global prior)
    user_category_resid_<a>      mean over them of the event's residual (as user_past_resid_<a>)

Means are shrunk towards the action's train-period mean (the manifest's `aggregates.priors`), residual means
towards 0, with `smoothing` pseudo-events, so few events give a value near the prior and no events give the prior. Only
events strictly before t enter: never the target event, its label, or anything later.
"""

from __future__ import annotations

import re

import numpy as np
from gemrec.components.common import jagged

from .errors import DataError

RECENT_EVENTS = 10
# More windows of the user's latest events: the last one to three ratings and the last few hundred each predict the
# next one beyond the all-time and last-10 means (measured with the GBDT, docs/benchmarks.md issue 21).
WINDOWS = (1, 3, 30, 100, 300)
SMOOTHING = 5.0
USER_FEATURES = ["history_length_log", "user_seconds_since_last_log"]
ITEM_FEATURES = ["item_past_count_log"]
_WINDOW_NAME = re.compile(r"user_last([1-9][0-9]*)_mean_.+")
USER_SOURCE = "history"  # dense feature sources in the manifest
ITEM_SOURCE = "item_history"


def aggregate_feature_sources(actions: list[str], category: str | None = None) -> dict[str, str]:
    """Dense feature name -> source, for a dataset whose history tokens carry `actions` (and whose items have the
    categorical feature `category`, if given)."""
    kinds = ["past", "recent"] + [f"last{n}" for n in WINDOWS]
    user = USER_FEATURES + [f"user_{kind}_mean_{a}" for kind in kinds for a in actions]
    user += [f"user_{kind}_resid_{a}" for kind in ("past", "recent") for a in actions]
    if category is not None:
        user += ["user_category_count_log"] + [
            f"user_category_{kind}_{a}" for kind in ("mean", "resid") for a in actions
        ]
    item = ITEM_FEATURES + [f"item_past_mean_{a}" for a in actions]
    return {**{n: USER_SOURCE for n in user}, **{n: ITEM_SOURCE for n in item}}


def aggregate_spec(actions: dict[str, np.ndarray], train: np.ndarray, category: str | None = None) -> dict:
    """The manifest's `aggregates` block: window, smoothing, the train-period mean of each action and the item
    category feature (None: no category features)."""
    priors = {a: float(np.mean(v[train])) if np.any(train) else 0.0 for a, v in actions.items()}
    return {"recent_events": RECENT_EVENTS, "smoothing": SMOOTHING, "priors": priors, "category": category}


def _segment_cumsum(values: np.ndarray, segment_start: np.ndarray) -> np.ndarray:
    """Inclusive running sums of `values` (n, k) that restart where each row's segment starts (row index)."""
    out = np.empty(values.shape, dtype=np.float32)
    for j in range(values.shape[1]):
        total = np.cumsum(values[:, j], dtype=np.float64)
        before = np.concatenate([[0.0], total])[segment_start]
        out[:, j] = total - before
    return out


class HistoryAggregates:
    """Computes the aggregate features of any examples from the event table, vectorized over a batch."""

    def __init__(
        self,
        event_user: np.ndarray,
        event_item: np.ndarray,
        event_ts: np.ndarray,
        actions: np.ndarray,
        action_names: list[str],
        spec: dict,
        item_categories: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        """Events sorted by (user, timestamp), as in events.parquet; `actions` (n, len(action_names));
        `item_categories`: (values, offsets) of the spec's category feature by dense item index."""
        self.action_names = list(action_names)
        self.recent = int(spec["recent_events"])
        self.smoothing = float(spec["smoothing"])
        missing = sorted(set(self.action_names) - set(spec["priors"]))
        if missing:
            raise DataError(f"manifest aggregates.priors lacks action(s) {missing}")
        self.priors = np.array([spec["priors"][a] for a in self.action_names], dtype=np.float32)
        n = len(event_ts)
        self._actions = actions
        self._ts = event_ts
        rows = np.arange(n, dtype=np.int64)
        new_user = np.ones(n, dtype=bool)
        new_user[1:] = event_user[1:] != event_user[:-1]
        user_start = np.maximum.accumulate(np.where(new_user, rows, 0))
        self._user_cum = _segment_cumsum(actions, user_start)
        lengths = np.bincount(event_user) if n else np.zeros(0, dtype=np.int64)
        self._user_count_norm = float(np.log1p(max(1, int(lengths.max(initial=0)))))
        first, last = (int(event_ts.min()), int(event_ts.max())) if n else (0, 0)
        self._time_norm = float(np.log1p(max(1, last - first)))

        # Item timelines keyed by (item, rank of the timestamp among the distinct event times): one searchsorted
        # finds how many of an item's events are strictly earlier than any time.
        self._times = np.unique(event_ts)
        self._key_stride = len(self._times) + 1
        if (int(event_item.max(initial=0)) + 1) * self._key_stride >= 1 << 63:
            raise DataError("too many items x distinct timestamps for the item aggregates' int64 keys")
        order = np.lexsort((event_ts, event_item))
        sorted_item = event_item[order]
        new_item = np.ones(n, dtype=bool)
        new_item[1:] = sorted_item[1:] != sorted_item[:-1]
        self._item_key = sorted_item * self._key_stride + np.searchsorted(self._times, event_ts[order])
        self._item_start = np.searchsorted(sorted_item, np.arange(int(event_item.max(initial=-1)) + 1))
        self._item_cum = _segment_cumsum(actions[order], np.maximum.accumulate(np.where(new_item, rows, 0)))
        self._item_count_norm = float(np.log1p(max(1, int(np.bincount(event_item).max(initial=0)) if n else 1)))
        # Each event's actions less its item's mean before it: the user-side residual sums.
        self._resid = (actions - self._item_past(event_item, event_ts)[1]).astype(np.float32)
        self._resid_cum = _segment_cumsum(self._resid, user_start)
        self._categories = None
        if spec.get("category") is not None:
            if item_categories is None:
                raise DataError(f"aggregates.category {spec['category']!r}: the item feature's values are missing")
            self._categories = _CategoryTimelines(event_item, item_categories, actions, self._resid)

    def _shrunk(self, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
        return (sums + self.smoothing * self.priors) / (counts[:, None] + self.smoothing)

    def _window_sums(self, begin: np.ndarray, end: np.ndarray, resid: bool = False) -> np.ndarray:
        """Action (or residual) sums over user rows [begin, end) of one user's timeline each."""
        cum, values = (self._resid_cum, self._resid) if resid else (self._user_cum, self._actions)
        last = np.maximum(end - 1, 0)
        first = np.minimum(begin, last)
        sums = cum[last] - cum[first] + values[first]
        return np.where((end > begin)[:, None], sums, 0.0)

    def _item_past(self, items: np.ndarray, timestamps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(count, shrunk action means) of each item's events strictly before the given time."""
        if len(items) and (items.min() < 0 or items.max() >= len(self._item_start)):
            raw = items[(items < 0) | (items >= len(self._item_start))][0]
            raise DataError(f"item index {raw} has no events")
        lo = self._item_start[items]
        earlier_times = np.searchsorted(self._times, timestamps, side="left")
        hi = np.searchsorted(self._item_key, items * self._key_stride + earlier_times, side="left")
        count = hi - lo
        sums = np.where((count > 0)[:, None], self._item_cum[np.maximum(hi - 1, 0)], 0.0)
        return count, self._shrunk(sums, count)

    def compute(
        self,
        names: list[str],
        items: np.ndarray,
        timestamps: np.ndarray,
        hist_start: np.ndarray,
        hist_end: np.ndarray,
    ) -> dict[str, np.ndarray]:
        """float32 values of the named features for examples of the given target items and times."""
        out: dict[str, np.ndarray] = {}
        count = hist_end - hist_start
        if any(n.startswith("user_") or n == "history_length_log" for n in names):
            out["history_length_log"] = np.log1p(count) / self._user_count_norm
            since = timestamps - self._ts[np.maximum(hist_end - 1, 0)]
            out["user_seconds_since_last_log"] = np.where(
                count > 0, np.log1p(np.maximum(since, 0)) / self._time_norm, 1.0
            )
            past = self._shrunk(self._window_sums(hist_start, hist_end), count)
            begin = np.maximum(hist_start, hist_end - self.recent)
            recent = self._shrunk(self._window_sums(begin, hist_end), hist_end - begin)
            for j, a in enumerate(self.action_names):
                out[f"user_past_mean_{a}"] = past[:, j]
                out[f"user_recent_mean_{a}"] = recent[:, j]
            for window in sorted({int(m.group(1)) for m in map(_WINDOW_NAME.fullmatch, names) if m}):
                begin = np.maximum(hist_start, hist_end - window)
                means = self._shrunk(self._window_sums(begin, hist_end), hist_end - begin)
                for j, a in enumerate(self.action_names):
                    out[f"user_last{window}_mean_{a}"] = means[:, j]
            for kind, begin in (("past", hist_start), ("recent", np.maximum(hist_start, hist_end - self.recent))):
                resid = self._window_sums(begin, hist_end, resid=True) / (hist_end - begin + self.smoothing)[:, None]
                for j, a in enumerate(self.action_names):
                    out[f"user_{kind}_resid_{a}"] = resid[:, j]
        if self._categories is not None and any(n.startswith("user_category_") for n in names):
            user_mean = self._shrunk(self._window_sums(hist_start, hist_end), count)
            sums = self._categories.sums(items, hist_start, hist_end)
            shared, actions = sums[:, 0], len(self.action_names)
            out["user_category_count_log"] = np.log1p(shared) / self._user_count_norm
            mean = (sums[:, 1 : 1 + actions] + self.smoothing * user_mean) / (shared + self.smoothing)[:, None]
            resid = sums[:, 1 + actions :] / (shared + self.smoothing)[:, None]
            for j, a in enumerate(self.action_names):
                out[f"user_category_mean_{a}"] = mean[:, j]
                out[f"user_category_resid_{a}"] = resid[:, j]
        if any(n.startswith("item_") for n in names):
            item_count, past = self._item_past(items, timestamps)
            out["item_past_count_log"] = np.log1p(item_count) / self._item_count_norm
            for j, a in enumerate(self.action_names):
                out[f"item_past_mean_{a}"] = past[:, j]
        unknown = sorted(set(names) - set(out))
        if unknown:
            raise DataError(f"unknown aggregate feature(s) {unknown}")
        return {n: out[n].astype(np.float32) for n in names}


class _CategoryTimelines:
    """Every (category, event) pair of the event table, keyed category-major by event row, with running sums of
    (1, actions, residuals): two searchsorted give a user's sums over a row range [begin, end) in one category."""

    def __init__(self, event_item: np.ndarray, item_categories, actions: np.ndarray, resid: np.ndarray):
        values, offsets = (np.asarray(a, dtype=np.int64) for a in item_categories)
        self._values, self._offsets = values, offsets
        if len(event_item) and int(event_item.max()) + 1 >= len(offsets):
            raise DataError(f"item index {int(event_item.max())} has no category values")
        n = len(event_item)
        self._stride = n + 1
        per_event = np.diff(offsets)[event_item]
        rows = np.repeat(np.arange(n, dtype=np.int64), per_event)
        keys = values[jagged.ranges(offsets[event_item], per_event)] * self._stride + rows
        order = np.argsort(keys, kind="stable")
        self._keys = keys[order]
        pairs = np.concatenate([np.ones((n, 1)), actions, resid], axis=1)[rows[order]]
        self._cum = np.zeros((len(order) + 1, pairs.shape[1]))
        np.cumsum(pairs, axis=0, out=self._cum[1:])

    def sums(self, items: np.ndarray, begin: np.ndarray, end: np.ndarray) -> np.ndarray:
        """(B, 1 + 2 * actions): per example, the sums of (1, actions, residuals) over its user's rows
        [begin, end) on items sharing a category with its item, pooled over the item's categories."""
        per_item = np.diff(self._offsets)[items]
        example = np.repeat(np.arange(len(items)), per_item)
        base = self._values[jagged.ranges(self._offsets[items], per_item)] * self._stride
        lo = np.searchsorted(self._keys, base + begin[example])
        hi = np.searchsorted(self._keys, base + end[example])
        out = np.zeros((len(items), self._cum.shape[1]))
        np.add.at(out, example, self._cum[hi] - self._cum[lo])
        return out
