"""`gemrec data ...`: prepare, synthesize and inspect datasets; `gemrec bench data`."""

from __future__ import annotations

import argparse
from pathlib import Path


def _split_args(parser: argparse.ArgumentParser, split_by: str = "time") -> None:
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=0.1,
        help="the last fraction of time (or of events) that becomes the eval split (default 0.1)",
    )
    parser.add_argument(
        "--split-by",
        choices=("time", "events"),
        default=split_by,
        help=f"fraction of the time range or of the events (default {split_by})",
    )
    parser.add_argument(
        "--split-cutoff",
        type=int,
        default=None,
        metavar="UNIX_S",
        help="explicit cutoff: examples at or after it are eval",
    )
    parser.add_argument(
        "--valid-fraction",
        type=float,
        default=0.1,
        help="the last fraction of the train period (by --split-by) held out as the valid split that training "
        "stops early on (default 0.1; 0 = none)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")


def _split_config(args):
    from .builder import SplitConfig

    return SplitConfig(
        eval_fraction=args.eval_fraction, by=args.split_by, cutoff=args.split_cutoff, valid_fraction=args.valid_fraction
    )


def _run(fn):
    """Handler wrapper: dataset errors become one-line CLI errors."""

    def handler(args):
        from gemrec.cli import CLIError

        from .errors import DataError

        try:
            return fn(args)
        except DataError as err:
            raise CLIError(str(err)) from err

    return handler


def _print_summary(path: Path) -> None:
    from .stats import summary_lines

    for line in summary_lines(path):
        print(line)


def _prepare_movielens(args) -> int:
    from .movielens import prepare_movielens

    out = prepare_movielens(args.out, raw=args.raw, split=_split_config(args), overwrite=args.overwrite)
    _print_summary(out)
    return 0


def _names(values: list[str]) -> list[str]:
    """Repeated flags and comma-separated lists alike: --x a,b --x c -> [a, b, c]."""
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def _prepare_events(args) -> int:
    from .events import prepare_events

    out = prepare_events(
        args.out,
        args.events,
        args.label,
        users=args.users,
        items=args.items,
        context=_names(args.context),
        item_columns=_names(args.item_columns),
        user_columns=_names(args.user_columns),
        categorical=_names(args.categorical),
        numeric=_names(args.numeric),
        timestamp_unit=args.timestamp_unit,
        hash_over=args.hash_ids_over or None,
        name=args.name,
        split=_split_config(args),
        aggregate_category=args.aggregate_category,
        overwrite=args.overwrite,
    )
    _print_summary(out)
    return 0


def _prepare_s3rec(args) -> int:
    from .s3rec import prepare_s3rec

    max_history = None if args.max_history == 0 else args.max_history
    out = prepare_s3rec(args.out, args.raw, args.name, max_history=max_history, overwrite=args.overwrite)
    _print_summary(out)
    return 0


SYNTH_OPTIONS = [
    ("--events", int, "events to generate"),
    ("--seed", int, "random seed; the same seed gives the same bytes"),
    ("--mean-length", float, "mean events per user (lognormal; h200-bench: mean history length)"),
    ("--length-sigma", float, "lognormal sigma of user lengths: the tail"),
    ("--max-length", int, "longest user timeline"),
    ("--items", int, "catalog size"),
    ("--item-hash-buckets", int, "item_id embedding rows, ids hashed when the catalog is bigger (0: never)"),
    ("--zipf", float, "item popularity exponent"),
    ("--categories", int, "item categories"),
    ("--days", float, "time window of the log"),
    ("--phase-length", float, "mean events per interest phase (planted signal)"),
    ("--window", int, "look-back of the planted sequence signals, in events"),
]


def _synth(args) -> int:
    from .synth import SynthConfig, synthesize

    chosen = {flag[2:].replace("-", "_"): None for flag, _, _ in SYNTH_OPTIONS}
    config = SynthConfig.for_profile(
        args.profile, **{k: getattr(args, k) for k in chosen if getattr(args, k) is not None}
    )
    if config.item_hash_buckets == 0:
        config.item_hash_buckets = None
    out = synthesize(args.out, config, split=_split_config(args), overwrite=args.overwrite)
    _print_summary(out)
    return 0


def _stats(args) -> int:
    from .stats import print_stats

    print_stats(args.dir, plot=args.plot)
    return 0


def _bench(args) -> int:
    from .bench import run

    run(args.out, args.synth_events, args.seq_lens, args.batch_size, args.seconds, args.raw)
    return 0


def register(groups: dict[str, argparse._SubParsersAction]) -> None:
    data = groups["data"]
    prepare = data.add_parser("prepare", help="turn raw events into a dataset folder (docs/data.md)")
    sources = prepare.add_subparsers(dest="source", metavar="SOURCE", required=True)

    movielens = sources.add_parser("movielens", help="MovieLens ml-latest-small")
    movielens.add_argument(
        "--raw",
        type=Path,
        default=None,
        help="unpacked ml-latest-small folder (default: $GEMREC_DATA_DIR/movielens-latest-small, "
        "../shared/data/movielens-latest-small, else download)",
    )
    movielens.add_argument("--out", type=Path, required=True, help="output dataset folder")
    _split_args(movielens)
    movielens.set_defaults(func=_run(_prepare_movielens))

    events = sources.add_parser("events", help="any CSV/Parquet event log (user_id, item_id, timestamp, ...)")
    events.add_argument("--events", type=Path, required=True, help="event log: user_id, item_id, timestamp, ...")
    events.add_argument("--users", type=Path, default=None, help="user side table keyed by user_id")
    events.add_argument("--items", type=Path, default=None, help="item side table keyed by item_id")
    events.add_argument(
        "--label",
        action="append",
        required=True,
        metavar="NAME[=EXPR]",
        help="a 0/1 column (click) or COLUMN OP VALUE (buy=behavior==buy, like=rating>=4); repeatable",
    )
    events.add_argument(
        "--context",
        action="append",
        default=[],
        metavar="COLUMN",
        help="event column known at request time (device, page): a feature of the target; repeatable",
    )
    for flag, text in (
        ("--item-columns", "item attributes in the events file (category, brand): item side features"),
        ("--user-columns", "user attributes in the events file (age bucket, country): user side features"),
        ("--categorical", "columns to treat as categories (one-hot actions, embedded side features)"),
        ("--numeric", "integer columns to treat as magnitudes even with many distinct values"),
    ):
        events.add_argument(flag, action="append", default=[], metavar="COL[,COL]", help=f"{text}; repeatable")
    events.add_argument(
        "--timestamp-unit",
        choices=("auto", "s", "ms", "us", "ns"),
        default="auto",
        help="unit of numeric timestamps (auto: told from their magnitude; date strings and Parquet timestamps "
        "are read as such)",
    )
    events.add_argument(
        "--hash-ids-over",
        type=int,
        default=5_000_000,
        metavar="N",
        help="hash id and value spaces with more than N distinct values into N buckets (0: never)",
    )
    events.add_argument(
        "--aggregate-category",
        default=None,
        metavar="FEATURE",
        help="an item feature (e.g. item_genres from the items file's genres column) whose values group items: "
        "adds the user's earlier means on the target item's categories as dense features",
    )
    events.add_argument("--name", default=None, help="dataset name (default: the events file name)")
    events.add_argument("--out", type=Path, required=True, help="output dataset folder")
    _split_args(events)
    events.set_defaults(func=_run(_prepare_events))

    s3rec = sources.add_parser(
        "s3rec", help="S3-Rec's Amazon sequences (Beauty, Sports_and_Outdoors): leave-one-out split"
    )
    s3rec.add_argument("--raw", type=Path, required=True, help="folder with NAME.txt and NAME_item2attributes.json")
    s3rec.add_argument("--name", required=True, help="data set name: the file stem, e.g. Beauty")
    s3rec.add_argument(
        "--max-history",
        type=int,
        default=50,
        help="most recent items kept in each history (default 50, the papers' protocol; 0: all)",
    )
    s3rec.add_argument("--out", type=Path, required=True, help="output dataset folder")
    s3rec.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    s3rec.set_defaults(func=_run(_prepare_s3rec))

    synth = data.add_parser("synth", help="seeded synthetic dataset with planted sequence signals (docs/data.md)")
    synth.add_argument("--out", type=Path, required=True, help="output dataset folder")
    synth.add_argument(
        "--profile",
        choices=("full", "h200-bench", "h200-long"),
        default="full",
        help="full: every feature, every event an example; h200-bench / h200-long: the schema and history lengths "
        "of the trainer's GPU benchmark with that recipe, one example per user (docs/data.md)",
    )
    for flag, kind, text in SYNTH_OPTIONS:
        synth.add_argument(flag, type=kind, default=None, help=f"{text} (default: the profile's)")
    _split_args(synth, split_by="events")
    synth.set_defaults(func=_run(_synth))

    stats = data.add_parser("stats", help="counts, label rates and history-length histogram of a dataset")
    stats.add_argument("dir", type=Path, help="dataset folder")
    stats.add_argument("--plot", type=Path, default=None, help="also write a PNG with the histogram and label rates")
    stats.set_defaults(func=_run(_stats))

    bench = groups["bench"].add_parser("data", help="prepare time and collation throughput per core")
    bench.add_argument("--synth-events", type=int, default=10_000_000, help="synthetic log size (0: skip)")
    bench.add_argument("--seq-lens", type=int, nargs="+", default=[256, 4096], help="max_seq_len values")
    bench.add_argument("--batch-size", type=int, default=1024)
    bench.add_argument("--seconds", type=float, default=3.0, help="measuring time per configuration")
    bench.add_argument("--raw", type=Path, default=None, help="ml-latest-small folder (default: as prepare)")
    bench.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    bench.set_defaults(func=_run(_bench))
