"""`gemrec train`, `gemrec bench quality` and `gemrec bench train`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from gemrec.cli import CLIError

log = logging.getLogger(__name__)


def register(groups: dict[str, argparse._SubParsersAction]) -> None:
    p = groups["_top"].add_parser(
        "train",
        help="train a model (alone or under torchrun)",
        description="Train `gem` or `dlrm` on a dataset directory or a data service; logs to MLflow (rank 0).",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", type=Path, help="dataset directory (gemrec data prepare|synth)")
    source.add_argument("--data-addr", metavar="HOST:PORT", help="gRPC data service address")
    _add_common(p)
    p.add_argument("--metrics-out", type=Path, help="write the final metrics as JSON here (rank 0)")
    p.add_argument(
        "--run-dir", type=Path, help="checkpoints go to RUN_DIR/checkpoints (default runs/train/<recipe>-<model>)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-log-model", action="store_true", help="do not log the model to MLflow")
    p.set_defaults(func=cmd_train)

    if "bench" in groups:
        q = groups["bench"].add_parser(
            "quality",
            help="gem vs dlrm vs base rate: NE per task, trained and evaluated in one run",
            description="Train every arm on the same data and eval split; print a markdown table.",
        )
        q.add_argument("--dataset", type=Path, required=True, help="dataset directory")
        _add_common(q, default_recipe="movielens")
        q.add_argument("--arms", default="gem,dlrm", help="comma-separated model arms (default gem,dlrm)")
        q.add_argument("--out", type=Path, help="write all arms' metrics as JSON here")
        q.set_defaults(func=cmd_bench_quality)

        g = groups["bench"].add_parser(
            "train",
            help="training QPS/MFU per layer + profiler table on synthetic production-shaped batches",
            description="The recipe's model on synthetic batches built as ModelInput (no torchrec, no data "
            "service): QPS, E2E and local MFU, per-layer table, profiler table (for the GPU).",
        )
        g.add_argument("--recipe", default="h200-bench", help="recipe name or .toml path (default h200-bench)")
        g.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
        g.add_argument("--out", type=Path, required=True, help="folder for gpu_bench.json, report.txt, profile.txt")
        g.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
        g.set_defaults(func=cmd_bench_train)


def _add_common(p: argparse.ArgumentParser, default_recipe: str | None = None) -> None:
    if default_recipe is None:
        p.add_argument("--recipe", required=True, help="recipe name (tiny, movielens, synth, h200-bench) or .toml path")
    else:
        p.add_argument("--recipe", default=default_recipe, help=f"recipe name or .toml path (default {default_recipe})")
    if default_recipe is None:
        p.add_argument("--model", choices=["gem", "dlrm"], help="override the recipe's model.arch")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe setting (repeatable), e.g. --set train.steps=50",
    )
    p.add_argument("--tracking-uri", help="MLflow store (default $MLFLOW_TRACKING_URI or sqlite:///mlruns.db)")
    p.add_argument("--experiment", default="gemrec", help="MLflow experiment name (default gemrec)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")


def cmd_train(args: argparse.Namespace) -> int:
    from gemrec.components.trainer.config import RecipeError, load_recipe
    from gemrec.components.trainer.run import run_training

    try:
        config = load_recipe(args.recipe, args.overrides, arch=args.model)
    except RecipeError as err:
        raise CLIError(str(err)) from err
    run_dir = args.run_dir or Path("runs") / "train" / f"{config.recipe}-{config.arch}"
    run_training(
        config,
        dataset=args.dataset,
        data_addr=args.data_addr,
        run_dir=run_dir,
        tracking_uri=args.tracking_uri,
        experiment=args.experiment,
        metrics_out=args.metrics_out,
        resume=args.resume,
        device=args.device,
        progress=not args.no_progress,
        log_model=not args.no_log_model,
    )
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from gemrec.components.trainer.config import RecipeError
    from gemrec.components.trainer.gpu_bench import run

    argv = ["--recipe", args.recipe, "--out", str(args.out)]
    for item in args.overrides:
        argv += ["--set", item]
    if args.device:
        argv += ["--device", args.device]
    try:
        run(argv)
    except RecipeError as err:
        raise CLIError(str(err)) from err
    return 0


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from gemrec.components.trainer.bench import run_quality_bench

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ("gem", "dlrm")]
    if bad or not arms:
        raise CLIError(f"--arms takes gem and/or dlrm, got {args.arms!r}")
    print(
        run_quality_bench(
            args.dataset, args.recipe, arms, args.overrides, args.tracking_uri, args.experiment, args.device, args.out
        )
    )
    return 0
