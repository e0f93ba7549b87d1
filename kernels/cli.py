"""`gemrec bench kernels`: correctness, then timings of the attention kernels against PyTorch peers."""

import argparse
import dataclasses
from pathlib import Path


def _bench_kernels(args: argparse.Namespace) -> int:
    import torch
    from gemrec.cli import CLIError
    from gemrec.kernels.bench import CONFIGS, format_row, run_benchmark

    options = kernel_options(args)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise CLIError(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    if args.static:
        import json

        from gemrec.kernels.aot import static_report

        rows = static_report(names, options, progress=lambda line: print(line, flush=True))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "kernels_static.json").write_text(json.dumps(rows, indent=2))
        print(f"wrote {Path(args.out) / 'kernels_static.json'}")
        return 0
    if not torch.cuda.is_available():
        raise CLIError(
            "bench kernels needs a CUDA GPU (the Triton kernels run compiled only there; "
            "--static compiles them for sm_90 without one)"
        )
    if args.host_only:
        from gemrec.kernels.bench import host_benchmark

        host_benchmark(names, Path(args.out), options, seed=args.seed, progress=lambda line: print(line, flush=True))
        print(f"wrote {Path(args.out) / 'kernels_host.json'} and kernels_host_timeline.txt")
        return 0
    if args.profile:
        from gemrec.kernels.bench import profile_ours

        profile_ours(
            names, options, seed=args.seed, progress=lambda line: print(line, flush=True), out_dir=Path(args.out)
        )
        return 0
    rows = run_benchmark(
        names,
        Path(args.out),
        options,
        seed=args.seed,
        with_peers=not args.no_peers,
        progress=lambda line: print(line, flush=True),
        fp8_vs_bf16=args.fp8_vs_bf16,
        fwd_only=args.fwd_only,
    )
    print("\n".join(format_row(r) for r in rows))
    print(f"wrote {Path(args.out) / 'kernels_bench.json'} and kernels_bench.md")
    return 0


def kernel_options(args: argparse.Namespace):
    """The `KernelOptions` of the parsed flags (one flag per field)."""
    from gemrec.kernels.options import KernelOptions

    return KernelOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(KernelOptions)})


def register(groups: dict) -> None:
    p = groups["bench"].add_parser("kernels", help="jagged attention / GDPA kernels vs FlexAttention, SDPA, compile")
    p.add_argument(
        "--configs", default="A,B,C-cross,C-pma", help="comma-separated configs (A, B, C-cross, C-pma, long, mixed)"
    )
    p.add_argument("--out", default="runs/bench-kernels", help="folder for kernels_bench.json/.md")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-peers", action="store_true", help="time only our kernels")
    p.add_argument(
        "--profile",
        action="store_true",
        help="only profile ours (fwd+bwd): per-kernel device times, the host timeline, Chrome traces in --out",
    )
    p.add_argument(
        "--fp8-vs-bf16",
        action="store_true",
        help="also time ours with the FP8 forward (KernelOptions.fp8) beside ours as the options say",
    )
    p.add_argument("--fwd-only", action="store_true", help="time the forward only (no fwd+bwd columns)")
    p.add_argument(
        "--host-only",
        action="store_true",
        help="only the host microseconds per eager call of ours (fwd, fwd+bwd, fwd+bwd on the calling thread; 200 "
        "calls back to back, unsynchronized) and each fwd+bwd's host timeline; with --no-autotune it takes seconds",
    )
    p.add_argument(
        "--static",
        action="store_true",
        help="no GPU needed: compile every kernel and candidate tile for sm_90, report registers, "
        "spill stack, shared memory and SASS instruction counts",
    )
    from gemrec.kernels.options import KernelOptions

    defaults = KernelOptions()
    for field in dataclasses.fields(KernelOptions):
        p.add_argument(
            f"--{field.name.replace('_', '-')}",
            dest=field.name,
            action=argparse.BooleanOptionalAction,
            default=getattr(defaults, field.name),
            help=f"KernelOptions.{field.name} (default: {'on' if getattr(defaults, field.name) else 'off'})",
        )
    p.set_defaults(func=_bench_kernels)


if __name__ == "__main__":  # `python -m gemrec.kernels.cli [args]`: the bench without the other packages' CLIs
    import sys

    root = argparse.ArgumentParser(prog="gemrec bench")
    register({"bench": root.add_subparsers(dest="bench_command", required=True)})
    parsed = root.parse_args(["kernels", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
