"""Rank load balancing: split one global batch across ranks so per-rank attention cost is even.

The cost of an example with history length L is `L^2 + linear_weight * L`: the L^2 term is attention,
the linear term the per-token work (projections, MLPs, embeddings); `transformer_linear_weight` gives it for a
transformer layer (12 * d_model for a causal one with a 4x MLP). Every rank gets the same number of examples
(sizes differ by at most one in the last, short global batch), so step counts and per-rank batch shapes stay
equal.

Algorithm: LPT (longest processing time first) with a cardinality cap, then pairwise swaps between the
most and the least loaded rank while they lower the maximum.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

DEFAULT_LINEAR_WEIGHT = 512.0


def example_cost(lengths: np.ndarray, linear_weight: float = DEFAULT_LINEAR_WEIGHT) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths * lengths + linear_weight * lengths


def transformer_linear_weight(d_model: int, mlp_ratio: float, causal: bool) -> float:
    """`linear_weight` of a pre-norm transformer layer: per token (4 + 2 * mlp_ratio) * d_model^2 multiply-adds
    (q, k, v and output projections, the MLP) against 2 * d_model per visible query-key pair, of which there are
    about L^2 / 2 when causal and L^2 otherwise."""
    pairs_per_l2 = 0.5 if causal else 1.0
    return (4 + 2 * mlp_ratio) * d_model / (2 * pairs_per_l2)


def rank_sizes(total: int, world_size: int) -> np.ndarray:
    """Examples per rank: as equal as possible, the first ranks take the remainder."""
    sizes = np.full(world_size, total // world_size, dtype=np.int64)
    sizes[: total % world_size] += 1
    return sizes


def _lpt(cost: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    assign = np.empty(len(cost), dtype=np.int64)
    heap = [(0.0, rank) for rank in range(len(sizes)) if sizes[rank] > 0]
    heapq.heapify(heap)
    room = sizes.copy()
    for index in np.argsort(-cost, kind="stable"):
        load, rank = heapq.heappop(heap)
        assign[index] = rank
        room[rank] -= 1
        if room[rank] > 0:
            heapq.heappush(heap, (load + float(cost[index]), rank))
    return assign


def _refine(cost: np.ndarray, assign: np.ndarray, world_size: int, rounds: int) -> None:
    """Swap one example between the heaviest and the lightest rank while that lowers the heavier one."""
    for _ in range(rounds):
        loads = np.bincount(assign, weights=cost, minlength=world_size)
        heavy, light = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[heavy] - loads[light]
        if gap <= 0:
            return
        in_heavy, in_light = np.flatnonzero(assign == heavy), np.flatnonzero(assign == light)
        if len(in_heavy) == 0 or len(in_light) == 0:
            return
        # Moving delta = c_i - c_j from heavy to light is best at delta = gap / 2 and helps for 0 < delta < gap.
        light_sorted = in_light[np.argsort(cost[in_light], kind="stable")]
        light_costs = cost[light_sorted]
        targets = cost[in_heavy] - gap / 2
        pos = np.clip(np.searchsorted(light_costs, targets), 0, len(light_costs) - 1)
        best_i, best_j, best_score = -1, -1, gap
        for candidate in (pos, np.maximum(pos - 1, 0)):
            delta = cost[in_heavy] - light_costs[candidate]
            score = np.abs(gap - 2 * delta)  # new |load difference| of the pair
            score[(delta <= 0) | (delta >= gap)] = np.inf
            k = int(np.argmin(score))
            if score[k] < best_score:
                best_i, best_j, best_score = in_heavy[k], light_sorted[candidate[k]], score[k]
        if best_i < 0:
            return
        assign[best_i], assign[best_j] = light, heavy


@dataclass
class Partition:
    rows: list[np.ndarray]  # per rank: positions into the global batch, ascending
    cost_imbalance: float  # max / mean per-rank combined cost
    tokens_imbalance: float  # max / mean per-rank sum(L)
    sq_tokens_imbalance: float  # max / mean per-rank sum(L^2)
    naive_cost_imbalance: float  # combined cost of a contiguous split, for reference


def imbalance(per_rank: np.ndarray) -> float:
    mean = float(per_rank.mean()) if len(per_rank) else 0.0
    return float(per_rank.max()) / mean if mean > 0 else 1.0


def partition(
    lengths: np.ndarray, world_size: int, linear_weight: float = DEFAULT_LINEAR_WEIGHT, refine_rounds: int | None = None
) -> Partition:
    """Balanced split of one global batch of examples with history `lengths` across `world_size` ranks."""
    lengths = np.asarray(lengths, dtype=np.int64)
    sizes = rank_sizes(len(lengths), world_size)
    cost = example_cost(lengths, linear_weight)
    if world_size == 1:
        assign = np.zeros(len(lengths), dtype=np.int64)
    else:
        assign = _lpt(cost, sizes)
        _refine(cost, assign, world_size, refine_rounds if refine_rounds is not None else 2 * world_size)
    naive = np.repeat(np.arange(world_size), sizes)

    def sums(values, owner):
        return np.bincount(owner, weights=values.astype(np.float64), minlength=world_size)

    return Partition(
        rows=[np.flatnonzero(assign == r) for r in range(world_size)],
        cost_imbalance=imbalance(sums(cost, assign)),
        tokens_imbalance=imbalance(sums(lengths, assign)),
        sq_tokens_imbalance=imbalance(sums(lengths * lengths, assign)),
        naive_cost_imbalance=imbalance(sums(cost, naive)),
    )
