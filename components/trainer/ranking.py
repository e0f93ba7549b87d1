"""Leave-one-out ranking protocols of the sequential-recommendation papers: metrics, candidates, negatives.

Each evaluated user has one target item (its `valid` or `test` event). A model scores candidates; the target's
rank is the number of *other* candidates scoring at least as high (0 = first; ties count against the target,
so a model that scores everything alike ranks last, never first). Then, averaged over users:

    HR@k   = [rank < k]                        (hit ratio; = recall@k with one relevant item)
    NDCG@k = [rank < k] / log2(rank + 2)       (one relevant item: the ideal DCG is 1)
    MRR    = 1 / (rank + 1)                    (over the whole candidate list, no cut-off)

Protocols:
- sampled-99: candidates = the target + 99 items the user never interacted with (over the whole sequence),
  drawn uniformly without replacement by a seeded generator (S3-Rec's `generate_test.py`, "random");
- full: every item of the catalog; the items of the user's history (everything before the target, also
  beyond the model's history cap) are removed from the ranking; a target removed that way is a miss.
"""

from __future__ import annotations

import numpy as np
import torch

KS = (5, 10, 20)
SAMPLED_NEGATIVES = 99


def target_ranks(scores: torch.Tensor, target: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
    """0-based rank of each row's target column among the row's candidates, (U,) int64.

    `scores` (U, C); `target` (U,) column of the target; `masked` (U, C) True for candidates removed from the
    ranking (scored -inf: they rank below everything, and a masked target ranks last)."""
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    rows = torch.arange(len(scores), device=scores.device)
    target_score = scores[rows, target]
    at_least = scores >= target_score[:, None]
    at_least[rows, target] = False
    return at_least.sum(1)


def ranking_metrics(ranks: np.ndarray, ks: tuple[int, ...] = KS) -> dict[str, float]:
    """`hr@k`, `ndcg@k` for every k, `mrr` and `users` over the given 0-based ranks."""
    ranks = np.asarray(ranks, dtype=np.float64)
    if ranks.size == 0:
        raise ValueError("ranking metrics of no users")
    out: dict[str, float] = {}
    for k in ks:
        hit = ranks < k
        out[f"hr@{k}"] = float(hit.mean())
        out[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0).mean())
    out["mrr"] = float((1.0 / (ranks + 1.0)).mean())
    out["users"] = int(ranks.size)
    return out


def sample_unseen(
    seen_values: np.ndarray, seen_offsets: np.ndarray, num_items: int, count: int, seed: int
) -> np.ndarray:
    """(U, count) items per user, uniform without replacement over the items not in the user's row of the
    jagged `seen` (values in [0, num_items)); reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    users = len(seen_offsets) - 1
    out = np.empty((users, count), dtype=np.int64)
    for u in range(users):
        seen = seen_values[seen_offsets[u] : seen_offsets[u + 1]]
        if num_items - len(np.unique(seen)) < count:
            raise ValueError(f"user row {u} has seen {len(seen)} of {num_items} items: fewer than {count} unseen")
        # A uniform random subset in random order; dropping the seen ones leaves a uniform subset of the rest.
        draw = rng.choice(num_items, size=min(num_items, count + len(seen)), replace=False)
        out[u] = draw[~np.isin(draw, seen)][:count]
    return out
