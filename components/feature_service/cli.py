"""`gemrec serve features` and `gemrec serve materialize`."""

from __future__ import annotations

import json
from pathlib import Path

from gemrec.components.common.grpc_server import add_server_args

FEATURES_PORT = 50051


def _check_dataset(path: str) -> Path:
    from gemrec.cli import CLIError

    dataset = Path(path)
    if not (dataset / "manifest.json").is_file():
        raise CLIError(f"{dataset}: not a dataset directory (no manifest.json); run `gemrec data prepare` first")
    return dataset


def _store(args):
    from gemrec.cli import CLIError

    from .store import MemoryStore, RedisStore

    dataset = _check_dataset(args.dataset)
    if args.store == "memory":
        return MemoryStore(dataset)
    manifest = json.loads((dataset / "manifest.json").read_text())
    try:
        return RedisStore(args.redis_url, manifest.get("dataset_checksum"), manifest.get("name"))
    except FileNotFoundError as err:
        raise CLIError(str(err)) from None
    except Exception as err:  # redis.ConnectionError and friends
        raise CLIError(f"cannot use redis at {args.redis_url}: {err}") from None


def serve_features(args) -> int:
    from gemrec.components.common.grpc_server import Server, options_from_args

    from .service import FeatureServiceCore, register

    options = options_from_args(args)
    core = FeatureServiceCore(_store(args), max_ids=args.max_ids, max_response_mb=options.max_message_mb)
    server = Server(options, register(core), health_hook=core.bind_health)
    print(f"feature service ({core.store.kind} store) listening on {options.host}:{server.port}", flush=True)
    server.wait()
    return 0


def materialize_cmd(args) -> int:
    from gemrec.cli import CLIError

    from .store import MemoryStore, materialize

    store = MemoryStore(_check_dataset(args.dataset))
    try:
        report = materialize(store, args.redis_url, chunk=args.chunk)
    except Exception as err:
        if type(err).__module__.startswith("redis"):
            raise CLIError(f"cannot write to redis at {args.redis_url}: {err}") from None
        raise
    print(json.dumps(report))
    return 0


def register(groups) -> None:
    serve = groups["serve"]
    p = serve.add_parser("features", help="run the gRPC feature service (gemrec.v1.FeatureService)")
    p.add_argument("--dataset", required=True, help="dataset directory (gemrec data prepare|synth)")
    add_server_args(p, FEATURES_PORT)
    p.add_argument("--store", choices=["memory", "redis"], default="memory")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--max-ids", type=int, default=65536, help="ids (or users) per request")
    p.set_defaults(func=serve_features)

    m = serve.add_parser("materialize", help="write a dataset's features and timelines into Redis (pipelined)")
    m.add_argument("--dataset", required=True)
    m.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    m.add_argument("--chunk", type=int, default=4096, help="ids per pipelined HSET")
    m.set_defaults(func=materialize_cmd)
