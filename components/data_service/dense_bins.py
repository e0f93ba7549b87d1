"""Quantile bins of the dense features over the train split: the manifest's `dense_bins`, the edges of the model's
piecewise-linear encoding (`model.dense_encoding = "ple"`).

Computed once when the dataset is prepared, from the train split's examples only, with the same collate that
training and serving use, so every consumer of the dataset encodes a value the same way.
"""

from __future__ import annotations

import numpy as np

# Quantile bins per dense feature (fewer where the feature has fewer distinct values): 64 fit gem's piecewise-linear
# tokens better than 32 (eval NE -0.0017 over 3 seeds on ml-latest-small, docs/benchmarks.md issue 21).
DENSE_BINS = 64
CHUNK = 65_536


def quantile_edges(values: np.ndarray, bins: int) -> list[float]:
    """Rising edges of at most `bins` bins at the quantiles of `values` (duplicates merged); a constant feature
    gets the one bin [v, v + 1]."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if not len(values):
        return [0.0, 1.0]
    edges = np.unique(np.quantile(values, np.linspace(0.0, 1.0, bins + 1)).astype(np.float32)).astype(float)
    return [float(edges[0]), float(edges[0]) + 1.0] if len(edges) < 2 else edges.tolist()


def dense_bins(dataset, bins: int = DENSE_BINS, split: str = "train") -> dict:
    """The manifest's `dense_bins` block of a dataset (a `Dataset`): {"split", "bins", "edges": {feature: [...]}}."""
    names = list(dataset.dense_features)
    n = dataset.num_examples(split)
    parts = [
        dataset.collate(split, np.arange(start, min(n, start + CHUNK)), max_seq_len=0).dense_features.numpy()
        for start in range(0, n, CHUNK)
    ]
    matrix = np.concatenate(parts) if parts else np.zeros((0, len(names)), np.float32)
    return {
        "split": split,
        "bins": bins,
        "edges": {name: quantile_edges(matrix[:, j], bins) for j, name in enumerate(names)},
    }
