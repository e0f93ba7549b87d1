"""`gemrec data ...`: prepare, synthesize and inspect datasets; `gemrec bench data`."""

from __future__ import annotations

import argparse
from pathlib import Path


def _split_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--eval-fraction", type=float, default=0.1,
                        help="the last fraction of time (or of events) that becomes the eval split (default 0.1)")
    parser.add_argument("--split-by", choices=("time", "events"), default="time",
                        help="fraction of the time range (default) or of the events")
    parser.add_argument("--split-cutoff", type=int, default=None, metavar="UNIX_S",
                        help="explicit cutoff: examples at or after it are eval")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")


def _split_config(args):
    from .builder import SplitConfig

    return SplitConfig(eval_fraction=args.eval_fraction, by=args.split_by, cutoff=args.split_cutoff)


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


def register(groups: dict[str, argparse._SubParsersAction]) -> None:
    data = groups["data"]
    prepare = data.add_parser("prepare", help="turn raw events into a dataset folder (docs/data.md)")
    sources = prepare.add_subparsers(dest="source", metavar="SOURCE", required=True)

    movielens = sources.add_parser("movielens", help="MovieLens ml-latest-small")
    movielens.add_argument("--raw", type=Path, default=None,
                           help="unpacked ml-latest-small folder (default: $GEMREC_DATA_DIR/movielens-latest-small, "
                                "../shared/data/movielens-latest-small, else download)")
    movielens.add_argument("--out", type=Path, required=True, help="output dataset folder")
    _split_args(movielens)
    movielens.set_defaults(func=_run(_prepare_movielens))
