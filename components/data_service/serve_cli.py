"""`gemrec serve data` and `gemrec bench services`."""

from __future__ import annotations

from gemrec.components.common.grpc_server import add_server_args, add_token_args

DATA_PORT = 50052


def serve_data(args) -> int:
    from gemrec.cli import CLIError
    from gemrec.components.common.grpc_server import Server, options_from_args, token_from_args

    from .dataset import Dataset
    from .errors import DataError
    from .service import DataLoaderCore, register

    options = options_from_args(args)
    if args.linear_weight < 0:
        raise CLIError(f"--linear-weight must be >= 0, got {args.linear_weight}")
    try:
        dataset = Dataset.open(args.dataset)
    except DataError as err:
        raise CLIError(str(err)) from None
    features = None
    if args.features:
        from gemrec.components.feature_service.client import FeatureClient

        features = FeatureClient(
            args.features,
            token=token_from_args(args, "--features-token"),
            tls_ca=args.features_tls_ca,
            timeout_s=args.features_timeout_s,
            expect_checksum=dataset.manifest.get("dataset_checksum"),
        )
        try:
            checksum = features.info()["dataset_checksum"]
        except Exception as err:
            raise CLIError(f"feature service at {args.features} is not reachable: {err}") from None
        if checksum != dataset.manifest.get("dataset_checksum"):
            raise CLIError(f"feature service at {args.features} serves another dataset ({checksum})")
    core = DataLoaderCore(
        dataset,
        features,
        linear_weight=args.linear_weight,
        prefetch=args.prefetch,
        workers=args.workers,
        max_message_mb=options.max_message_mb,
    )
    server = Server(options, register(core), on_drain=core.draining.set)
    source = f"features from {args.features}" if args.features else "in-process features"
    print(f"data service ({source}) listening on {options.host}:{server.port}", flush=True)
    server.wait()
    return 0


def bench_services(args) -> int:
    from .bench_services import run

    return run(args)


def register(groups) -> None:
    serve = groups["serve"]
    p = serve.add_parser("data", help="run the gRPC data-loading service (gemrec.v1.DataLoaderService)")
    p.add_argument("--dataset", required=True, help="dataset directory (gemrec data prepare|synth)")
    add_server_args(p, DATA_PORT, default_workers=64)  # one thread per open stream
    p.add_argument("--features", metavar="ADDR", help="take user/item features from this feature service")
    p.add_argument("--features-tls-ca", help="PEM to trust for a TLS feature service")
    add_token_args(p, "--features-token", "bearer token for the feature service")
    p.add_argument("--features-timeout-s", type=float, default=10.0, help="deadline of each feature lookup")
    p.add_argument(
        "--linear-weight",
        type=float,
        default=512.0,
        help="rank balancing cost per example: L^2 + linear_weight * L (a causal transformer with a 4x MLP: "
        "12 x d_model)",
    )
    p.add_argument("--prefetch", type=int, default=2, help="batches built ahead per stream")
    p.add_argument("--workers", type=int, default=4, help="collate threads")
    p.set_defaults(func=serve_data)

    b = groups["bench"].add_parser("services", help="feature service latency/throughput, data stream MB/s")
    b.add_argument("--dataset", help="MovieLens-style dataset for the feature service (default: prepare one)")
    b.add_argument("--out", default="runs/bench-services", help="work folder (datasets, results JSON)")
    b.add_argument("--requests", type=int, default=2000, help="requests per latency measurement")
    b.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput measurement")
    b.add_argument("--skip-redis", action="store_true", help="memory store only")
    b.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="concurrent client processes")
    b.add_argument("--synth-events", type=int, default=300_000, help="events of the synthetic stream dataset")
    b.add_argument("--batch-size", type=int, default=256, help="data stream batch size")
    b.add_argument("--load", action="store_true", help="sustained feature-service load only: req/s, p99, errors, RSS")
    b.add_argument("--load-s", type=float, default=60.0, help="seconds of each --load run")
    b.add_argument("--load-clients", type=int, nargs="+", default=[16, 32], help="client processes of --load runs")
    b.set_defaults(func=bench_services)
