"""`gemrec train`, `gemrec bench quality`, `gemrec bench seqrec`, `gemrec bench import` and `gemrec bench train`."""

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
    p.add_argument(
        "--no-tracking", action="store_true", help="no MLflow at all (machines without it); see --metrics-out"
    )
    p.set_defaults(func=cmd_train)

    if "bench" in groups:
        q = groups["bench"].add_parser(
            "quality",
            help="gem vs dlrm vs gbdt vs base rate: NE per task, trained and evaluated in one run",
            description="Train every arm on the same data and eval split; print a markdown table.",
        )
        q.add_argument("--dataset", type=Path, required=True, help="dataset directory")
        _add_common(q, default_recipe="movielens")
        q.add_argument(
            "--arms", default="gem,dlrm,gbdt", help="comma-separated model arms (default gem,dlrm,gbdt; may be empty)"
        )
        q.add_argument(
            "--variant",
            dest="variants",
            action="append",
            default=[],
            metavar="'NAME: SECTION.KEY=VALUE ...'",
            help="one more arm: the recipe's model with these overrides (repeatable), e.g. "
            "--variant 'window: model.seq_attention_mask=window model.seq_window=32'",
        )
        q.add_argument(
            "--seeds", help="comma-separated train.seed values; every arm runs with each (default: the recipe's)"
        )
        q.add_argument("--out", type=Path, help="write all arms' metrics as JSON here")
        q.set_defaults(func=cmd_bench_quality)

        s = groups["bench"].add_parser(
            "seqrec",
            help="leave-one-out next-item ranking (sampled-99 or full) against the published S3-Rec/ICLRec tables",
            description="Train GEM (pointwise ranker for sampled99, retrieval head for full) and the SASRec "
            "baseline on a leave-one-out dataset (gemrec data prepare s3rec), early-stopped on validation "
            "NDCG@10; test HR@{5,10,20}, NDCG@{5,10,20}, MRR; everything in one MLflow run.",
        )
        s.add_argument("--dataset", type=Path, required=True, help="leave-one-out dataset directory")
        s.add_argument("--protocol", choices=["sampled99", "full"], required=True, help="ranking protocol")
        _add_common(s, default_recipe="s3rec")
        s.add_argument("--arms", default="gem,sasrec", help="comma-separated arms among gem, sasrec (default both)")
        s.add_argument("--metrics-out", type=Path, help="write the results as JSON here")
        s.add_argument("--no-tracking", action="store_true", help="no MLflow run (for machines without mlflow)")
        s.set_defaults(func=cmd_bench_seqrec)

        i = groups["bench"].add_parser(
            "import",
            help="log results written with --no-tracking (a machine without MLflow) into MLflow, with their plots",
            description="One MLflow run per file: `gemrec bench seqrec --metrics-out` results and gpu_bench.json "
            "files (metrics, the loss of every step, the per-layer MFU or ranking-metrics PNG, the JSON itself).",
        )
        i.add_argument("files", nargs="+", type=Path, metavar="RESULT_JSON")
        i.add_argument("--tracking-uri", help="MLflow store (default $MLFLOW_TRACKING_URI or sqlite:///mlruns.db)")
        i.add_argument("--experiment", default="gemrec", help="MLflow experiment name (default gemrec)")
        i.add_argument("--commit", help="git_commit tag for files that do not name their commit")
        i.set_defaults(func=cmd_bench_import)

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
        p.add_argument("--model", help="override the recipe's model.arch (gem or dlrm)")
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
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.run import run_training
    from gemrec.config import ConfigError

    try:
        config = load_recipe(args.recipe, args.overrides, arch=args.model)
    except ConfigError as err:
        raise CLIError(str(err)) from err
    run_dir = args.run_dir or Path("runs") / "train" / f"{config.recipe}-{config.model.arch}"
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
        tracking=not args.no_tracking,
    )
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from gemrec.components.trainer.gpu_bench import run
    from gemrec.config import ConfigError

    argv = ["--recipe", args.recipe, "--out", str(args.out)]
    for item in args.overrides:
        argv += ["--set", item]
    if args.device:
        argv += ["--device", args.device]
    try:
        run(argv)
    except ConfigError as err:
        raise CLIError(str(err)) from err
    return 0


def cmd_bench_import(args: argparse.Namespace) -> int:
    from gemrec.components.trainer.result_import import ResultError, import_results
    from gemrec.components.trainer.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(args.tracking_uri)
    try:
        imported = import_results(args.files, uri, args.experiment, args.commit)
    except ResultError as err:
        raise CLIError(str(err)) from err
    for path, kind, run_id in imported:
        print(f"{path}: {kind} result -> MLflow run {run_id} ({uri}, experiment {args.experiment!r})")
    return 0


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from gemrec.components.trainer.bench import Arm, parse_variant, run_quality_bench
    from gemrec.config import ConfigError

    try:
        arms = [Arm(a.strip(), a.strip()) for a in args.arms.split(",") if a.strip()]
        arms += [parse_variant(text) for text in args.variants]
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    except ValueError as err:  # ConfigError included
        raise CLIError(str(err) if isinstance(err, ConfigError) else f"--seeds {args.seeds!r}: {err}") from err
    if not arms:
        raise CLIError(f"--arms takes gem and/or dlrm (or --variant), got {args.arms!r}")
    try:
        table = run_quality_bench(
            args.dataset,
            args.recipe,
            arms,
            args.overrides,
            args.tracking_uri,
            args.experiment,
            args.device,
            args.out,
            seeds,
        )
    except ConfigError as err:
        raise CLIError(str(err)) from err
    print(table)
    return 0


def cmd_bench_seqrec(args: argparse.Namespace) -> int:
    from gemrec.components.data_service.errors import DataError
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.seqrec import ARMS, run_seqrec_bench
    from gemrec.components.trainer.trainer import TrainingError
    from gemrec.config import ConfigError

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or sorted(set(arms) - set(ARMS)) or len(set(arms)) != len(arms):
        raise CLIError(f"--arms takes distinct names among {', '.join(ARMS)}, got {args.arms!r}")
    if not args.dataset.is_dir():
        raise CLIError(f"--dataset {args.dataset}: no such directory")
    try:
        config = load_recipe(args.recipe, args.overrides)
    except ConfigError as err:
        raise CLIError(str(err)) from err
    try:
        results = run_seqrec_bench(
            args.dataset,
            args.protocol,
            config,
            arms,
            tracking_uri=args.tracking_uri,
            experiment=args.experiment,
            tracking=not args.no_tracking,
            device=args.device,
            metrics_out=args.metrics_out,
        )
    except (DataError, TrainingError) as err:
        raise CLIError(str(err)) from err
    print(results["table"])
    return 0
