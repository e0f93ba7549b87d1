"""Encode categorical columns of side tables: strings (with `|` for multi-valued) to jagged int64 codes."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .builder import Categorical


def categorical_from_strings(
    name: str, values: pd.Series, sep: str | None = "|", drop: tuple[str, ...] = ("",)
) -> Categorical:
    """A Categorical over the rows of `values`: each cell split on `sep` (None: single value), stripped,
    `drop` values and missing cells give no value, repeats within a cell are kept once. Codes are dense
    indices of the sorted distinct values (their names are kept for vocab/features/)."""
    cells = values.reset_index(drop=True).astype("string").fillna("")
    parts = cells.str.split(sep, regex=False).explode() if sep else cells
    parts = parts.str.strip()
    row = np.asarray(parts.index, dtype=np.int64) if sep else np.arange(len(cells), dtype=np.int64)
    keep = ~parts.isin(drop).to_numpy()
    row, parts = row[keep], parts.to_numpy(dtype=object)[keep]
    codes, uniques = pd.factorize(parts, sort=True)
    pairs = pd.DataFrame({"row": row, "code": codes.astype(np.int64)}).drop_duplicates()
    pairs = pairs.sort_values(["row", "code"], kind="stable")
    lengths = np.bincount(pairs["row"].to_numpy(), minlength=len(cells)).astype(np.int64)
    offsets = np.zeros(len(cells) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Categorical(
        name,
        pairs["code"].to_numpy(dtype=np.int64),
        offsets,
        max(1, len(uniques)),
        value_names=[str(u) for u in uniques],
    )
