"""`gemrec pipeline run|compile|submit` and `gemrec ui`."""

import argparse
import os


def _error(message: str):
    from gemrec.cli import CLIError

    return CLIError(message)


def _run(args) -> int:
    from . import local
    from .services import ServiceError

    try:
        summary = local.run(
            args.recipe,
            args.data,
            nproc=args.nproc,
            runs_root=args.runs,
            tracking_uri=args.tracking_uri,
            feature_store=args.feature_store,
            redis_url=args.redis_url,
            feature_port=args.feature_port,
            data_port=args.data_port,
            ui_port=args.ui_port,
            verbose=args.verbose,
        )
    except (local.InputError, ServiceError, local.PipelineFailed) as err:
        raise _error(str(err)) from err
    local.print_summary(summary)
    return 0


def _compile(args) -> int:
    from .pipeline import compile_pipeline

    print(f"compiled gemrec-train for a KFP cluster: {compile_pipeline(args.output)}")
    return 0


def _submit(args) -> int:
    import json

    from .submit import submit

    try:
        arguments = json.loads(args.arguments) if args.arguments else {}
    except json.JSONDecodeError as err:
        raise _error(f"--arguments is not a JSON object: {err}") from err
    if not isinstance(arguments, dict):
        raise _error("--arguments must be a JSON object of pipeline parameters")
    try:
        run_id = submit(
            args.host,
            experiment=args.experiment,
            package=args.package,
            arguments=arguments,
            namespace=args.namespace,
            existing_token=os.environ.get("KFP_TOKEN"),
        )
    except Exception as err:
        raise _error(f"submitting to {args.host} failed: {type(err).__name__}: {err}") from err
    print(f"submitted run {run_id} to {args.host} (experiment {args.experiment})")
    return 0


def _ui(args) -> int:
    from .services import ServiceError
    from .ui import serve

    try:
        return serve(args.tracking_uri, args.port)
    except (FileNotFoundError, ServiceError) as err:
        raise _error(str(err)) from err


def register(groups: dict[str, argparse._SubParsersAction]) -> None:
    pipeline = groups["pipeline"]

    run = pipeline.add_parser("run", help="run the whole pipeline locally (kfp.local), outputs in ./runs/")
    run.add_argument("--recipe", default="movielens", help="training recipe (default: movielens)")
    run.add_argument(
        "--data", default=None, help="MovieLens ml-latest-small folder (ratings.csv) or a prepared dataset folder"
    )
    run.add_argument("--nproc", type=int, default=1, help="trainer processes (torchrun --nproc_per_node)")
    run.add_argument("--runs", default="runs", help="folder for run outputs (default: ./runs)")
    run.add_argument(
        "--tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db)"
    )
    run.add_argument("--feature-store", choices=("memory", "redis"), default="memory")
    run.add_argument("--redis-url", default="", help="Redis for --feature-store redis")
    run.add_argument("--feature-port", type=int, default=0, help="feature service port (default: a free one)")
    run.add_argument("--data-port", type=int, default=0, help="data service port (default: a free one)")
    run.add_argument("--ui-port", type=int, default=5000, help="port `gemrec ui` serves on (for the summary)")
    run.set_defaults(func=_run)

    comp = pipeline.add_parser("compile", help="write the pipeline IR YAML for a KFP cluster")
    comp.add_argument("-o", "--output", default="gemrec-train.yaml", help="output file (default: gemrec-train.yaml)")
    comp.set_defaults(func=_compile)

    sub = pipeline.add_parser("submit", help="submit the pipeline to a KFP server")
    sub.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://localhost:8080")
    sub.add_argument("--experiment", default="gemrec-train", help="KFP experiment (default: gemrec-train)")
    sub.add_argument("--package", default=None, help="a compiled IR YAML (default: compile now)")
    sub.add_argument("--arguments", default=None, help="pipeline parameters as JSON, e.g. '{\"num_nodes\": 2}'")
    sub.add_argument("--namespace", default=None, help="KFP profile namespace (multi-user installs)")
    sub.set_defaults(func=_submit)

    ui = groups["_top"].add_parser("ui", help="browse runs and models in the MLflow UI (127.0.0.1)")
    ui.add_argument("--port", type=int, default=5000, help="port (default: 5000)")
    ui.add_argument(
        "--tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns.db)"
    )
    ui.set_defaults(func=_ui)
