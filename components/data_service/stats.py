"""`gemrec data stats`: counts, label rates and the history-length histogram of a dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .builder import read_manifest


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(low, high, count) over power-of-two bins: [0,1), [1,2), [2,4), ..."""
    if len(lengths) == 0:
        return []
    edges = [0, 1]
    while edges[-1] <= lengths.max():
        edges.append(edges[-1] * 2)
    counts, _ = np.histogram(lengths, bins=edges)
    return [(edges[i], edges[i + 1], int(c)) for i, c in enumerate(counts)]


def summary_lines(path: Path) -> list[str]:
    m = read_manifest(path)
    counts = m["counts"]
    lines = [
        f"{m['name']} at {path}",
        f"  events {m['num_events']:,}  users {m['num_users']:,}  items {m['num_items']:,}  "
        f"(input {counts['input_events']:,}, duplicates dropped {counts['duplicates_dropped']:,}, "
        f"unsorted input rows {counts['unsorted_input_rows']:,})",
        f"  split by {m['split']['by']}"
        + (f" at cutoff {m['split']['cutoff']}" if "cutoff" in m["split"] else "")
        + (f" (valid from {m['split']['valid_cutoff']})" if "valid_cutoff" in m["split"] else ""),
    ]
    for split, info in m["splits"].items():
        rates = ", ".join(f"{n} {r:.4f}" for n, r in (m["label_rates"][split] or {}).items() if r is not None)
        lines.append(f"  {split:5s} {info['num_examples']:>12,} examples  label rates: {rates or '-'}")
    s = m["max_seq_len"]
    lines.append(f"  history length p50 {s['p50']}  p90 {s['p90']}  p99 {s['p99']}  max {s['max']}")
    features = ", ".join(
        f"{f['name']}({f['num_embeddings']}{'*' if f['multi_valued'] else ''})" for f in m["sparse_features"]
    )
    lines.append(f"  sparse (* multi-valued): {features}")
    lines.append(f"  dense: {', '.join(m['dense_features'])}   actions: {', '.join(m['actions'])}")
    source = m.get("source") or {}
    for column, use in (source.get("columns") or {}).items():
        lines.append(f"  column {column}: {use}")
    for warning in [*source.get("warnings", []), *split_warnings(m)]:
        lines.append(f"  warning: {warning}")
    return lines


def split_warnings(m: dict) -> list[str]:
    """Splits far smaller than asked for (an outlier timestamp stretching a split by time, a cutoff at an end)."""
    split, sizes = m["split"], {name: int(info["num_examples"]) for name, info in m["splits"].items()}
    total = sum(sizes.values())
    if split.get("by") in ("time", "events") and "eval_fraction" in split:
        fraction = float(split["eval_fraction"])
        expected = {"train": (1 - fraction) * total, "eval": fraction * total}
        tiny = [s for s, n in sizes.items() if expected.get(s, 0) >= 1 and n < 0.1 * expected[s]]
    else:
        tiny = [s for s, n in sizes.items() if n == 0 and total]
    first, last = m.get("time_range", [None, None])
    return [
        f"split {name} has {sizes[name]:,} of {total:,} examples (split by {split.get('by')} at cutoff "
        f"{split.get('cutoff')}, events from {first} to {last}): check the timestamps for outliers, or use "
        "--split-by events or --split-cutoff"
        for name in tiny
    ]


def print_stats(path: Path, plot: Path | None = None) -> None:
    from .dataset import Dataset

    ds = Dataset.open(path)
    for line in summary_lines(path):
        print(line)
    print("  history length histogram (all splits):")
    lengths = np.concatenate([ds.history_lengths(s) for s in ds.splits])
    hist = length_histogram(lengths)
    top = max((c for _, _, c in hist), default=1) or 1
    for low, high, count in hist:
        label = f"{low}" if high == low + 1 else f"{low}-{high - 1}"
        print(f"    {label:>13s} {count:>12,} {'#' * max(0, round(40 * count / top))}")
    if plot is not None:
        _plot(ds, plot)
        print(f"  plot written to {plot}")


def _plot(ds, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_len, ax_rate) = plt.subplots(1, 2, figsize=(11, 4))
    for split in ds.splits:
        lengths = ds.history_lengths(split)
        if len(lengths):
            bins = np.unique(np.geomspace(1, max(2, lengths.max() + 1), 40).astype(int))
            ax_len.hist(np.maximum(lengths, 1), bins=bins, alpha=0.6, label=split)
    ax_len.set_xscale("log")
    ax_len.set_yscale("log")
    ax_len.set_xlabel("history length (events before the target)")
    ax_len.set_ylabel("examples")
    ax_len.legend()
    rates = ds.manifest["label_rates"]
    labels = list(ds.label_names)
    width = 0.8 / max(1, len(rates))
    for i, (split, values) in enumerate(rates.items()):
        ax_rate.bar(np.arange(len(labels)) + i * width, [values[n] or 0 for n in labels], width, label=split)
    ax_rate.set_xticks(np.arange(len(labels)) + width * (len(rates) - 1) / 2, labels)
    ax_rate.set_ylabel("positive rate")
    ax_rate.legend()
    fig.suptitle(f"{ds.manifest['name']}: {ds.manifest['num_events']:,} events")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
