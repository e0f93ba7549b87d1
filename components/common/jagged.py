"""Jagged arrays in numpy: `values` plus `offsets` (rows + 1), row i is values[offsets[i]:offsets[i+1]]."""

from __future__ import annotations

import numpy as np


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start + length) over rows, without a Python loop."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)


def gather(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, int64 lengths) of the selected rows, in row order; rows < 0 give empty rows."""
    rows = np.asarray(rows, dtype=np.int64)
    valid = rows >= 0
    safe = np.where(valid, rows, 0)
    starts = offsets[safe]
    lengths = np.where(valid, offsets[safe + 1] - starts, 0).astype(np.int64, copy=False)
    return values[ranges(starts, lengths)], lengths
