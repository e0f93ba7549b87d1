"""Leave-one-out data for `gemrec bench seqrec`: histories, targets, negatives and model inputs.

Read from a dataset folder with the splits `train`, `valid` and `test` (`gemrec data prepare s3rec`). Items
are dense item indices throughout; model inputs carry their embedding ids. Histories are each example's
history in the dataset (already cut to the dataset's `max_history`), cut again to the recipe's
`seqrec.max_seq_len`. Timestamps inside a model input are positions: history token i of a length-L history
has timestamp i and the target L (what `prepare s3rec` stores, shifted).

What each part of a user's sequence may be used for:
- training: the `train` events only (targets, histories and the set negatives are drawn outside of);
- validation: the `valid` event, its history being the `train` events;
- test: the `test` event, its history being everything before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gemrec.components.common import jagged
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.errors import DataError
from gemrec.model import FeatureSchema, JaggedFeatures, ModelInput

SPLITS = ("train", "valid", "test")


@dataclass
class Jagged:
    """Rows of int64 values: row i is values[offsets[i]:offsets[i + 1]]."""

    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_lengths(cls, values: np.ndarray, lengths: np.ndarray) -> Jagged:
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(np.asarray(values, dtype=np.int64), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def take(self, rows: np.ndarray) -> Jagged:
        return Jagged.from_lengths(*jagged.gather(self.values, self.offsets, rows))

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]


@dataclass
class Targets:
    """One example per row: its user, target item, history (oldest first, cut to max_seq_len) and every item
    of the user before the target (uncut: what full ranking removes from the candidates)."""

    users: np.ndarray
    items: np.ndarray
    history: Jagged
    before: Jagged

    def __len__(self) -> int:
        return len(self.users)

    def take(self, rows: np.ndarray) -> Targets:
        return Targets(self.users[rows], self.items[rows], self.history.take(rows), self.before.take(rows))

    def next_items(self) -> np.ndarray:
        """The item that follows every history token: the next history token, or the target after the last."""
        out = np.empty_like(self.history.values)
        out[:-1] = self.history.values[1:]
        lengths = self.history.lengths
        out[self.history.offsets[1:][lengths > 0] - 1] = self.items[lengths > 0]
        return out


def pair_keys(users: np.ndarray, items: np.ndarray, num_items: int) -> np.ndarray:
    return np.asarray(users, dtype=np.int64) * num_items + np.asarray(items, dtype=np.int64)


def contains(sorted_keys: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Whether each key is in `sorted_keys` (ascending)."""
    if len(sorted_keys) == 0:
        return np.zeros(np.shape(keys), dtype=bool)
    at = np.searchsorted(sorted_keys, keys).clip(max=len(sorted_keys) - 1)
    return sorted_keys[at] == keys


class SeqRecData:
    def __init__(self, ds: Dataset, max_seq_len: int):
        missing = [s for s in SPLITS if s not in ds.splits]
        if missing:
            raise DataError(
                f"{ds.path}: no split(s) {missing} (have {ds.splits}): the sequential benchmarks need a "
                "leave-one-out dataset (gemrec data prepare s3rec)"
            )
        self.name = ds.manifest.get("name")
        self.checksum = ds.manifest.get("dataset_checksum")
        self.max_seq_len = max_seq_len
        self.num_items, self.num_users = ds.num_entities("item"), ds.num_entities("user")
        self.feature_names = list(ds.seq_item_features)
        sparse = [f["name"] for f in ds.sparse_features]
        other = sorted(set(sparse) - {"user_id", "item_id", *self.feature_names})
        if other:
            raise DataError(f"{ds.path}: features {other} are neither ids nor item features of the history tokens")
        self.sparse_names = sparse
        self.schema = FeatureSchema.from_manifest({**ds.manifest, "dense_features": [], "actions": []})
        items = np.arange(self.num_items)
        looked_up = ds.lookup("item", items, ["item_id", *self.feature_names])
        self.item_embedding = looked_up["item_id"][0]
        self.item_features = {n: Jagged.from_lengths(*looked_up[n]) for n in self.feature_names}
        self.user_embedding = ds.lookup("user", np.arange(self.num_users), ["user_id"])["user_id"][0]
        self.event_items = ds.event_items
        starts, lengths = ds.timelines()
        self.timeline_start = starts
        self.user_items = Jagged(self.event_items, np.append(starts, starts[-1] + lengths[-1]))
        self.splits = {s: self._targets(ds, s) for s in SPLITS}
        train = self.splits["train"]
        # Training sees the train events only: negatives avoid exactly these (user, item) pairs.
        self.train_seen = np.unique(pair_keys(train.users, train.items, self.num_items))
        order = np.argsort(train.users, kind="stable")  # already grouped by user; stable keeps time order
        counts = np.bincount(train.users, minlength=self.num_users)
        self.train_sequences = Jagged.from_lengths(train.items[order], counts)

    def _targets(self, ds: Dataset, split: str) -> Targets:
        ex = ds.examples(split)
        start = np.maximum(ex.hist_start, ex.hist_end - self.max_seq_len)
        history = Jagged.from_lengths(self.event_items[jagged.ranges(start, ex.hist_end - start)], ex.hist_end - start)
        first = self.timeline_start[ex.user]
        before = Jagged.from_lengths(self.event_items[jagged.ranges(first, ex.event - first)], ex.event - first)
        return Targets(ex.user.copy(), self.event_items[ex.event], history, before)

    # -- negatives -------------------------------------------------------------------------------------

    def train_negatives(self, users: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
        """(len(users), count) items drawn uniformly (with replacement) among those the user has no train
        event with."""
        users = np.asarray(users, dtype=np.int64)
        items = rng.integers(self.num_items, size=(len(users), count))
        for _ in range(100):
            hit = contains(self.train_seen, pair_keys(users[:, None], items, self.num_items))
            if not hit.any():
                return items
            items[hit] = rng.integers(self.num_items, size=int(hit.sum()))
        raise DataError("cannot draw negatives: some users have a train event with almost every item")

    # -- model inputs ----------------------------------------------------------------------------------

    def _item_features(self, items: np.ndarray) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for name, feature in self.item_features.items():
            values, lengths = jagged.gather(feature.values, feature.offsets, items)
            out[name] = (torch.from_numpy(values), torch.from_numpy(lengths))
        return out

    def catalog(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, JaggedFeatures | None]:
        """Every item as `item_vectors` takes it: (embedding ids, item features), in dense item order, on `device`."""
        items = np.arange(self.num_items)
        features = (
            JaggedFeatures.from_dict(self._item_features(items), stride=len(items)).to(device)
            if self.feature_names
            else None
        )
        return torch.from_numpy(self.item_embedding).to(device), features

    def model_input(
        self,
        history: Jagged,
        users: np.ndarray | None = None,
        candidates: np.ndarray | None = None,
        history_index: np.ndarray | None = None,
    ) -> ModelInput:
        """One example per history row, or per `history_index` entry (examples sharing histories). With `users`
        and `candidates` (the pointwise ranker; one per example) the examples' sparse features are the user and
        the candidate item with its features; without them (retrieval) they are empty: the model sees the
        history alone."""
        lengths = history.lengths
        rows = len(history) if history_index is None else len(history_index)
        tokens = len(history.values)
        seq_features = None
        if self.feature_names:
            seq_features = JaggedFeatures.from_dict(self._item_features(history.values), stride=tokens)
        if candidates is None:
            empty = torch.zeros(0, dtype=torch.long)
            sparse = JaggedFeatures(
                self.sparse_names, empty, torch.zeros(len(self.sparse_names) * rows, dtype=torch.long)
            )
        else:
            ones = torch.ones(rows, dtype=torch.long)
            by_name = {
                "user_id": (torch.from_numpy(self.user_embedding[users]), ones),
                "item_id": (torch.from_numpy(self.item_embedding[candidates]), ones),
                **self._item_features(candidates),
            }
            sparse = JaggedFeatures.from_dict({n: by_name[n] for n in self.sparse_names}, stride=rows)
        positions = np.arange(tokens, dtype=np.int64) - np.repeat(history.offsets[:-1], lengths)
        return ModelInput(
            sparse_features=sparse,
            dense_features=torch.zeros(rows, 0),
            seq_offsets=torch.from_numpy(history.offsets.copy()),
            seq_item_ids=torch.from_numpy(self.item_embedding[history.values]),
            seq_timestamps=torch.from_numpy(positions),
            seq_actions=torch.zeros(tokens, 0),
            seq_item_features=seq_features,
            max_seq_len=int(lengths.max(initial=0)),
            timestamps=torch.from_numpy(
                (lengths if history_index is None else lengths[history_index]).astype(np.int64)
            ),
            history_index=None if history_index is None else torch.from_numpy(np.asarray(history_index, np.int64)),
        )
