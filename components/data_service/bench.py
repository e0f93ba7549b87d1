"""`gemrec bench data`: prepare time (ml-latest-small, a synthetic log) and collation throughput per core.

Collation runs on one thread (torch.set_num_threads(1); the numpy gathers are single-threaded), over
random example rows of the train split, at each max_seq_len. The peer is the obvious per-example loop
(slice each history, look up each history token's item features), checked to give the same history
tensors and measured in the same run. Throughput is per CPU-second of this
single-threaded process (so per core even on a busy machine); wall-clock throughput is recorded beside it.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
from gemrec.provenance import git_commit


def _timed(fn) -> tuple[object, dict]:
    """fn's result and its wall and CPU seconds (CPU: this process, all threads)."""
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, {
        "prepare_s": round(time.perf_counter() - start, 2),
        "prepare_cpu_s": round(time.process_time() - cpu, 2),
    }


def loop_collate(ds, split: str, rows: np.ndarray, max_seq_len: int) -> dict[str, np.ndarray]:
    """Peer: the obvious implementation, a Python loop per example (history slices) and per history token
    (item side features). Gives the history part of `collate`'s Batch; checked equal in `collation`."""
    data = ds._split(split)
    side = ds._side["item"]
    items, stamps, actions, lengths = [], [], [], []
    features = {name: ([], []) for name in ds.seq_item_features}
    for row in rows:
        end = data.hist_end[row]
        begin = max(data.hist_start[row], end - max_seq_len)
        history = ds._event_item[begin:end]
        items.append(side.embedding_id[history])
        stamps.append(ds._event_ts[begin:end])
        actions.append(ds._event_actions[begin:end])
        lengths.append(end - begin)
        for name, (values, counts) in features.items():
            feature = side.categorical[name]
            for item in history:
                values.append(feature.values[feature.offsets[item] : feature.offsets[item + 1]])
                counts.append(feature.offsets[item + 1] - feature.offsets[item])
    out = {
        "seq_item_ids": np.concatenate(items),
        "seq_timestamps": np.concatenate(stamps),
        "seq_actions": np.concatenate(actions),
        "lengths": np.asarray(lengths),
    }
    for name, (values, counts) in features.items():
        out[name] = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
        out[f"{name}.lengths"] = np.asarray(counts, dtype=np.int64)
    return out


def _same_history(batch, peer: dict[str, np.ndarray], names: list[str]) -> bool:
    same = all(
        np.array_equal(getattr(batch, key).numpy(), peer[key])
        for key in ("seq_item_ids", "seq_timestamps", "seq_actions")
    )
    same &= np.array_equal(batch.seq_lengths().numpy(), peer["lengths"])
    for name in names:
        same &= np.array_equal(batch.seq_item_features[name].values().numpy(), peer[name])
        same &= np.array_equal(batch.seq_item_features[name].lengths().numpy(), peer[f"{name}.lengths"])
    return bool(same)


def collation(ds, split: str, max_seq_len: int, batch_size: int, seconds: float, peer: bool) -> dict:
    rng = np.random.default_rng(0)
    n = ds.num_examples(split)
    rows = rng.integers(0, n, batch_size)
    batch = ds.collate(split, rows, max_seq_len)  # warm-up, and the peer's correctness check
    result = {"max_seq_len": max_seq_len, "batch_size": batch_size}
    if peer:
        result["peer_matches"] = _same_history(batch, loop_collate(ds, split, rows, max_seq_len), ds.seq_item_features)
    runs = [("collate", lambda rows: ds.collate(split, rows, max_seq_len))]
    if peer:
        runs.append(("python_loop", lambda rows: loop_collate(ds, split, rows, max_seq_len)))
    for name, fn in runs:
        examples = tokens = 0
        busy = 0.0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            rows = rng.integers(0, n, batch_size)
            cpu = time.process_time()
            fn(rows)
            busy += time.process_time() - cpu
            examples += batch_size
            tokens += int(ds.history_lengths(split, max_seq_len, rows).sum())
        elapsed = time.perf_counter() - start
        # Per core = per CPU-second of this single-threaded process: robust to other load on the machine.
        result[name] = {
            "examples_per_s": round(examples / busy),
            "tokens_per_s": round(tokens / busy),
            "wall_examples_per_s": round(examples / elapsed),
            "mean_tokens_per_example": round(tokens / max(1, examples), 1),
        }
    return result


def run(
    out: Path | None, synth_events: int, seq_lens: list[int], batch_size: int, seconds: float, raw: Path | None
) -> dict:
    import torch

    from .dataset import Dataset
    from .movielens import prepare_movielens
    from .synth import SynthConfig, synthesize

    torch.set_num_threads(1)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(short=True),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "machine": f"{platform.processor() or platform.machine()}, {_cpu_name()}",
        "datasets": {},
    }
    with tempfile.TemporaryDirectory(prefix="gemrec-bench-") as tmp:
        datasets = {}
        path, timing = _timed(lambda: prepare_movielens(Path(tmp) / "ml", raw=raw, progress=False))
        datasets["ml-latest-small"] = path
        report["datasets"]["ml-latest-small"] = timing
        if synth_events:
            path, timing = _timed(
                lambda: synthesize(Path(tmp) / "synth", SynthConfig(events=synth_events), progress=True)
            )
            datasets[f"synth-{synth_events}"] = path
            report["datasets"][f"synth-{synth_events}"] = timing
        for name, path in datasets.items():
            ds = Dataset.open(path)
            entry = report["datasets"][name]
            entry.update(
                events=ds.manifest["num_events"],
                users=ds.manifest["num_users"],
                history_p99=ds.manifest["max_seq_len"]["p99"],
                history_max=ds.manifest["max_seq_len"]["max"],
            )
            entry["collation"] = [collation(ds, "train", L, batch_size, seconds, peer=True) for L in seq_lens]
            print(json.dumps({name: entry}, indent=1), flush=True)
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    for line in markdown(report):
        print(line)
    return report


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def markdown(report: dict) -> list[str]:
    lines = [
        "| dataset | events | prepare s (CPU s) | max_seq_len | collate ex/s/core | tokens/s/core | wall ex/s | "
        "python-loop peer ex/s/core | tokens/example |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in report["datasets"].items():
        for c in entry["collation"]:
            peer = c.get("python_loop", {}).get("examples_per_s")
            peer = f"{peer:,}" if peer is not None else "-"
            lines.append(
                f"| {name} | {entry['events']:,} | {entry['prepare_s']} ({entry['prepare_cpu_s']}) | "
                f"{c['max_seq_len']} | "
                f"{c['collate']['examples_per_s']:,} | {c['collate']['tokens_per_s']:,} | "
                f"{c['collate']['wall_examples_per_s']:,} | "
                f"{peer} | {c['collate']['mean_tokens_per_example']} |"
            )
    return lines
