"""`gemrec bench model`: the model alone, forward/backward per layer (see gemrec.model.bench)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gemrec.cli import CLIError


def register(groups: dict[str, argparse._SubParsersAction]) -> None:
    if "bench" not in groups:
        return
    p = groups["bench"].add_parser(
        "model",
        help="model forward/backward time per layer on production-shaped random batches",
        description="Checks the device paths (attention dispatch, MoE grouped GEMM, bf16), then times a "
        "training step and each layer alone; writes model_bench.json.",
    )
    add_arguments(p)
    p.set_defaults(func=cmd_bench_model)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="write model_bench.json here")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--mean-len", type=float, default=512.0, help="mean history length (lognormal)")
    parser.add_argument("--max-len", type=int, default=3072, help="history length cap")
    parser.add_argument("--num-users", type=int, default=1_000_000, help="rows of the user and item tables")
    parser.add_argument("--distinct-batches", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed training steps (median)")
    parser.add_argument("--layer-repeats", type=int, default=5)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a [model] or [kernels] setting, e.g. --set model.seq_attention=silu --set kernels.tma=false",
    )


def cmd_bench_model(args: argparse.Namespace) -> int:
    from gemrec.model.bench import production_config, run

    try:
        args.model_config, args.kernel_options = production_config(args.overrides)
        if args.batch_size < 1 or args.max_len < 1 or args.mean_len <= 0:
            raise ValueError("--batch-size, --max-len and --mean-len must be positive")
    except ValueError as err:
        raise CLIError(str(err)) from err
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CLIError("--device cuda but no CUDA device is available (use --device cpu)")
    run(args)
    return 0
