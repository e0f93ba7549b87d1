"""S3-Rec's preprocessed Amazon data (Beauty, Sports_and_Outdoors, ...): `<Name>.txt` and its item attributes.

Format (the public repository RUCAIBox/CIKM2020-S3Rec, `data/`): one line per user, `user item item ...`,
integers, the items in time order; `<Name>_item2attributes.json` maps each item to a list of attribute ids
(brand and categories), used as the multi-valued item feature `item_attributes`.

The files carry no timestamps: an event's timestamp is its position in the user's line (0, 1, 2, ...), so
"before" means "earlier in the line". Split: leave-one-out (the papers' protocol), last item `test`,
second-to-last `valid`, the rest `train`; histories keep the most recent `max_history` items (50 in the
papers). Every event is a positive interaction (label `interaction` = 1); negatives are the evaluation
protocol's business (`gemrec.components.trainer.seqrec`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .builder import Categorical, EventLog, SideTable, SplitConfig, build_dataset, file_sha256
from .errors import DataError

LABEL = "interaction"
ATTRIBUTES = "item_attributes"
PAPER_MAX_HISTORY = 50


def sequences_path(raw: Path, name: str) -> Path:
    return Path(raw) / f"{name}.txt"


def attributes_path(raw: Path, name: str) -> Path:
    return Path(raw) / f"{name}_item2attributes.json"


def read_sequences(path: Path) -> EventLog:
    """One event per item of every line; timestamps are positions within the line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not a text file ({err})") from err
    users, items, positions = [], [], []
    line_of_user: dict[int, int] = {}
    for line_no, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if len(fields) < 2:
            raise DataError(
                f"{path}: line {line_no}: expected 'user item item ...' (a user id and at least one item), "
                f"got {line.strip()[:80]!r}"
            )
        try:
            ids = [int(f) for f in fields]
        except ValueError:
            bad = next(f for f in fields if not f.lstrip("-").isdigit())
            raise DataError(f"{path}: line {line_no}: {bad[:40]!r} is not an integer id") from None
        user = ids[0]
        if user in line_of_user:
            raise DataError(f"{path}: line {line_no}: user {user} already has line {line_of_user[user]}")
        line_of_user[user] = line_no
        users.append(np.full(len(ids) - 1, user, dtype=np.int64))
        items.append(np.asarray(ids[1:], dtype=np.int64))
        positions.append(np.arange(len(ids) - 1, dtype=np.int64))
    if not users:
        raise DataError(f"{path}: no lines")
    items_all = np.concatenate(items)
    return EventLog(
        users=np.concatenate(users),
        items=items_all,
        timestamps=np.concatenate(positions),
        labels={LABEL: np.ones(len(items_all), dtype=np.int8)},
        actions={},
    )


def read_attributes(path: Path) -> SideTable:
    """`{item: [attribute, ...]}` as the multi-valued item feature `item_attributes` (dense codes)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object {{item: [attribute, ...]}}, got {type(data).__name__}")
    raw_items, lengths, values = [], [], []
    for key, attributes in data.items():
        try:
            raw_items.append(int(key))
        except ValueError:
            raise DataError(f"{path}: item key {key[:40]!r} is not an integer id") from None
        if not isinstance(attributes, list) or not all(
            isinstance(a, int) and not isinstance(a, bool) for a in attributes
        ):
            raise DataError(f"{path}: item {key}: attributes must be a list of integers, got {str(attributes)[:80]}")
        unique = sorted(set(attributes))
        lengths.append(len(unique))
        values.extend(unique)
    names, codes = np.unique(np.asarray(values, dtype=np.int64), return_inverse=True)
    offsets = np.zeros(len(raw_items) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    feature = Categorical(
        ATTRIBUTES,
        codes.astype(np.int64),
        offsets,
        max(1, len(names)),
        value_names=[str(n) for n in names],
    )
    return SideTable(source=str(path), raw_ids=np.asarray(raw_items, dtype=np.int64), categorical=[feature])


def prepare_s3rec(
    out: Path,
    raw: Path,
    name: str,
    max_history: int | None = PAPER_MAX_HISTORY,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """`raw/<name>.txt` (+ `raw/<name>_item2attributes.json` when present) -> dataset folder `out`."""
    raw = Path(raw)
    if not raw.is_dir():
        raise DataError(f"--raw {raw}: not a directory")
    seq_path, attr_path = sequences_path(raw, name), attributes_path(raw, name)
    events = read_sequences(seq_path)
    items = read_attributes(attr_path) if attr_path.is_file() else None
    checksums = {p.name: "sha256:" + file_sha256(p) for p in (seq_path, attr_path) if p.is_file()}
    return build_dataset(
        out,
        name=name,
        events=events,
        items=items,
        split=SplitConfig(by="leave_one_out"),
        max_history=max_history,
        input_checksums=checksums,
        extra={
            "source": {"raw_dir": str(raw), "format": "s3rec", "item_attributes": items is not None},
            "timestamps": "position of the event in its user's line (the format has no times)",
        },
        overwrite=overwrite,
        progress=progress,
    )
