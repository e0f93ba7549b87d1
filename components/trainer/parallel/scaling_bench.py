"""Scaling benchmark: the `h200-bench` recipe (plain-torch embeddings, synthetic production-shaped batches) on
1..N GPUs under torchrun, through `parallelize` (FSDP2 over all ranks, optionally expert parallelism); run
without torchrun it trains the plain model on one device (the `gpu_bench` setup).

Weak scaling: every rank trains on a batch of the recipe's size, so the global batch grows with the world; the
ranks' batches are split from one global batch by attention cost, as the data service balances them.

    torchrun --nproc_per_node N -m gemrec.components.trainer.parallel.scaling_bench --out DIR [--set k=v ...]

The layout is the recipe's `[parallel]` section (`ParallelConfig`), changed like any other key: `--set parallel.ep=2`,
`--set parallel.dp_replicate=2`, `--set parallel.compile=false`, `--set parallel.reshard_after_forward=true`,
`--set parallel.param_dtype=` (empty: fp32 all-gathers), `--set parallel.reduce_dtype=float32`.

Writes DIR/scaling_w<N>[_ep<E>].json: QPS (all ranks), E2E MFU (model FLOPs of all ranks / time / (peak x N)),
step time, and from one profiled step per rank: compute imbalance (max/mean) and exposed communication.
The scaling ratio is E2E MFU at N GPUs / E2E MFU at 1 GPU with the same wrapper and FSDP dtype (the weak-scaling
efficiency; `report` computes it from the files of several runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def balanced_batches(
    schema, bench, batch_size: int, max_seq_len: int, rank: int, world: int, linear_weight: float
) -> list:
    """This rank's `bench.distinct_batches` batches, as the data service serves them: each step draws one global
    batch of `world x batch_size` history lengths (the same on every rank), splits it by cost
    (`gemrec.components.data_service.balance.partition` with `linear_weight`), and the rank draws its examples'
    other features."""
    from gemrec.components.data_service.balance import partition
    from gemrec.components.trainer.gpu_bench import synthetic_batch, synthetic_lengths

    lengths_gen = torch.Generator().manual_seed(1000)
    features_gen = torch.Generator().manual_seed(2000 + rank)
    batches = []
    for _ in range(bench.distinct_batches):
        lengths = synthetic_lengths(bench, world * batch_size, max_seq_len, lengths_gen)
        rows = partition(lengths.numpy(), world, linear_weight).rows[rank]
        batches.append(
            synthetic_batch(
                schema, bench, batch_size, max_seq_len, features_gen, lengths=lengths[torch.from_numpy(rows)]
            )
        )
    return batches


def run(argv: list[str]) -> dict:
    from gemrec.components.trainer.config import balance_linear_weight, load_recipe
    from gemrec.components.trainer.gpu_bench import synthetic_schema
    from gemrec.components.trainer.mfu import device_peak, total_flops
    from gemrec.components.trainer.parallel import ParallelConfig
    from gemrec.components.trainer.parallel.balance import RankBalance
    from gemrec.components.trainer.training import set_determinism, setup_training, timed_steps
    from gemrec.config import ConfigError
    from gemrec.model import model_flops

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="h200-bench")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="recipe override section.key=value, repeatable"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--trace",
        action="store_true",
        help="write the profiled step's Chrome trace per rank and its per-collective breakdown",
    )
    args = parser.parse_args(argv)
    try:
        config = load_recipe(args.recipe, args.overrides)
    except ConfigError as err:
        parser.error(str(err))
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, embedding_backend="torch"))

    launched = "WORLD_SIZE" in os.environ  # under torchrun: parallelize, also on 1 rank (same code path)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if launched:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)

    # The layout the result reports; without torchrun there is no wrapper and `train.compile` compiles the model.
    parallel = config.parallel if launched else ParallelConfig(compile=config.train.compile)
    bench = config.bench
    set_determinism(config.train.seed, False)
    schema = synthetic_schema(bench)
    training = setup_training(config, schema, device, bench.warmup_steps + bench.steps + 1, world if launched else None)
    layout = training.parallel.report.layout if training.parallel is not None else "single device, no wrapper"

    host = balanced_batches(
        schema, bench, config.data.batch_size, config.data.max_seq_len, rank, world, balance_linear_weight(config)
    )
    flops = [total_flops(model_flops(training.model, inp)) for inp, _ in host]
    batches = [(inp.to(device), labels.to(device)) for inp, labels in host]
    # The step before the timed window is profiled.
    balance = RankBalance(device, profile_every=10**9, trace_dir=args.out / "traces" if args.trace else None)
    state = {"i": 0}

    def step():
        inp, labels = batches[state["i"] % len(batches)]
        state["i"] += 1
        training.step(inp, labels)

    def barrier():
        if cuda:
            torch.cuda.synchronize(device)
        if launched:
            dist.barrier()

    for _ in range(bench.warmup_steps):
        step()
    barrier()
    with balance.step():  # profiled (not in the timed window)
        step()
    balance_metrics = balance.window()
    barrier()
    first = state["i"]
    seconds = timed_steps(step, bench.steps, barrier)
    local_flops = sum(flops[(first + k) % len(flops)] for k in range(bench.steps))
    totals = torch.tensor(
        [local_flops, float(config.data.batch_size * bench.steps)],
        dtype=torch.float64,
        device=device if cuda else "cpu",
    )
    if launched:
        dist.all_reduce(totals)
    peak = device_peak(device, training.bf16)
    result = {
        "world_size": world,
        "ep": parallel.ep,
        "dp_replicate": parallel.dp_replicate,
        "compile": parallel.compile,
        "reshard_after_forward": parallel.reshard_after_forward,
        "fsdp_param_dtype": (parallel.param_dtype or "float32") if launched else "-",
        "fsdp_reduce_dtype": (parallel.reduce_dtype or "param") if launched else "-",
        "layout": layout,
        "device": peak.device,
        "torch": torch.__version__,
        "recipe": config.recipe,
        "overrides": args.overrides,
        "batch_size_per_rank": config.data.batch_size,
        "steps": bench.steps,
        "step_ms": 1000 * seconds / bench.steps,
        "qps": float(totals[1]) / seconds,
        "mfu_e2e": float(totals[0]) / seconds / (peak.flops * world),
        "model_tflop_per_step_all_ranks": float(totals[0]) / bench.steps / 1e12,
        "peak_flops": peak.flops,
        "peak_source": peak.source,
        **{f"profiled_{k}": v for k, v in balance_metrics.items()},
        "collectives_rank0": balance.breakdowns[0] if balance.breakdowns else None,
    }
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        name = (
            f"scaling_w{world}"
            + ("_fsdp" if launched else "_plain")
            + (f"_ep{parallel.ep}" if parallel.ep > 1 else "")
            + (f"_rep{parallel.dp_replicate}" if parallel.dp_replicate > 1 else "")
            + (f"_{parallel.param_dtype}" if parallel.param_dtype and launched else "")
            + (f"_rs-{parallel.reduce_dtype}" if parallel.reduce_dtype and launched else "")
            + ("_compiled" if parallel.compile else "")
            + ("_zero2" if not parallel.reshard_after_forward and launched else "")
            + ".json"
        )
        (args.out / name).write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    if launched:
        dist.destroy_process_group()
    return result


def report(paths: list[Path]) -> str:
    """Markdown table of several runs; scaling ratio against the 1-GPU run of the same kind (compile, FSDP dtype)."""
    runs = sorted(
        (json.loads(p.read_text()) for p in paths),
        key=lambda r: (r.get("compile", False), r["world_size"], r["ep"], r["fsdp_param_dtype"]),
    )

    def base_for(run):
        ones = [r for r in runs if r["world_size"] == 1]
        same = [
            r
            for r in ones
            if r.get("compile", False) == run.get("compile", False) and r["fsdp_param_dtype"] == run["fsdp_param_dtype"]
        ]
        return (same or [None])[0]

    lines = [
        "| GPUs | layout | compile | FSDP params / reduce | QPS | step ms | E2E MFU | scaling ratio "
        "| rank imbalance | exposed comm ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        base = base_for(r)
        ratio = r["mfu_e2e"] / base["mfu_e2e"] if base else float("nan")
        lines.append(
            f"| {r['world_size']} | {'EP ' + str(r['ep']) + ', ' if r['ep'] > 1 else ''}{r['layout'].split(';')[0]} "
            f"| {'yes' if r.get('compile') else 'no'} | {r['fsdp_param_dtype']} / {r.get('fsdp_reduce_dtype', '-')} "
            f"| {r['qps']:.0f} | {r['step_ms']:.1f} | {100 * r['mfu_e2e']:.1f}% | {ratio:.3f} "
            f"| {r['profiled_rank_imbalance']:.3f} | {1000 * r['profiled_exposed_comm_s']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["report"]:
        print(report([Path(p) for p in sys.argv[2:]]))
    else:
        run(sys.argv[1:])
