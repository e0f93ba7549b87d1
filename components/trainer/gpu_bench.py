"""GPU training benchmark: a recipe (default `h200-bench`) on production-shaped batches staged on the device.

Batches are built as `ModelInput` with `JaggedFeatures` (no torchrec), synthetic by default or, with
`--dataset DIR`, collated in process from that dataset's train split (its schema; the batches the data service
would send, e.g. from `gemrec data synth --profile h200-bench`). A few distinct ones are staged up front and
rotated, so the numbers are the model + optimizer alone. Reports QPS, tokens/s, E2E MFU, per-layer local MFU
(each layer alone, forward + backward, compiled when the step is), the scaling ratio, the model's FLOP count
against `FlopCounterMode` on one batch, and a profiler table of where the step time goes.

    python -m gemrec.components.trainer.gpu_bench --recipe h200-bench --out DIR [--dataset DIR] [--set sec.key=val]

Also reports the peak memory of the timed steps and the memory plan (`parallel.activation_checkpoint`) and attention
(mask, rotary) it ran with; `train.local_mfu=false` and `bench.profile_steps=0` skip the per-layer pass and the
profiler. `--compare RUN.json ...` puts runs of one command side by side against the first (e.g. full, window and
block attention): step time, tokens/s, MFU, peak memory, and the tokens/s gain beside the FLOP ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gemrec.components.trainer.config import BenchConfig, load_recipe
from gemrec.components.trainer.mfu import (
    H200_BF16_DENSE_PEAK_FLOPS,
    H200_FP8_DENSE_PEAK_FLOPS,
    LayerMFU,
    device_peak,
    measure_local_mfu,
    measure_matmul_ceiling,
    total_flops,
)
from gemrec.components.trainer.training import peak_memory_gib, set_determinism, setup_training, timed_steps
from gemrec.model import FeatureSchema, ModelInput, model_flops, train_step
from gemrec.model.bench import count_host_syncs
from gemrec.model.synthetic import bench_schema, lognormal_lengths, random_input, random_labels
from gemrec.provenance import git_commit


def synthetic_schema(bench: BenchConfig) -> FeatureSchema:
    """The benchmark schema with the recipe's `[bench]` table sizes."""
    return bench_schema(bench.num_users, bench.num_items, bench.num_dense)


def synthetic_lengths(bench: BenchConfig, batch_size: int, max_seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Lognormal history lengths (mean `bench.mean_seq_len`, sigma `bench.length_sigma`) capped at max_seq_len."""
    return lognormal_lengths(batch_size, bench.mean_seq_len, bench.length_sigma, max_seq_len, gen)


def synthetic_batch(
    schema: FeatureSchema,
    bench: BenchConfig,
    batch_size: int,
    max_seq_len: int,
    gen: torch.Generator,
    lengths: torch.Tensor | None = None,
) -> tuple[ModelInput, torch.Tensor]:
    """(ModelInput on the host, labels) with the given history `lengths`, else drawn by `synthetic_lengths`."""
    if lengths is None:
        lengths = synthetic_lengths(bench, batch_size, max_seq_len, gen)
    inp = random_input(schema, batch_size, max_seq_len, lengths=lengths, generator=gen)
    return inp, random_labels(batch_size, schema.num_tasks, gen)


def dataset_batches(dataset: Path, config, count: int) -> tuple[FeatureSchema, list[tuple[ModelInput, torch.Tensor]]]:
    """The dataset's schema and its first `count` training batches (host, as the trainer reads them in process)."""
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.trainer.data import DatasetStream, to_model_input

    ds = Dataset.open(dataset)
    stream = DatasetStream(ds, config.data.batch_size, config.data.max_seq_len, config.train.seed, prefetch=0)
    batches = [(to_model_input(batch), batch.labels) for _, batch in zip(range(count), stream)]
    return FeatureSchema.from_manifest(ds.manifest), batches


def flop_count_check(model, inp: ModelInput, labels: torch.Tensor, autocast) -> dict:
    """The model's FLOP count of one batch against `FlopCounterMode` over the same forward + backward (eager)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        train_step(model, inp, labels, autocast=autocast)
    model.zero_grad(set_to_none=True)
    counted, measured = total_flops(model_flops(model, inp)), counter.get_total_flops()
    return {"model": counted, "flop_counter": measured, "model_over_counter": counted / measured}


def profile_steps(step, steps: int, device: torch.device, trace: Path | None = None) -> tuple[str, float]:
    """(the profiler's op table, compiled graphs run per step). More than one graph per step means
    torch.compile broke the model into pieces (each break also materialises tensors and runs Python between)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    graphs = sum(e.name == "CompiledFunction" for e in prof.events()) / max(steps, 1)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=60), graphs


def attention_label(run: dict) -> str:
    """How a run's sequence tower attended, e.g. "window 1024, rope fused"."""
    a = run["attention"]
    size = {"window": f" {a['window']}", "block": f" {a['block']}"}.get(a["mask"], "")
    return f"{a['mask']}{size}, rope {a['rope']}"


def compare(paths: list[Path], out: Path) -> dict:
    """Runs of one command side by side against the first: a gain in tokens/s from fewer FLOPs (a window or block
    mask) is worth its FLOP ratio when `gain_over_flop_ratio` reaches 1 (the issue's target: 0.9)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    base = runs[0]
    rows = [
        {
            "run": str(path),
            "attention": attention_label(r),
            "activation_checkpointed": r.get("activation_checkpointed", []),
            "step_ms": r["step_ms"],
            "tokens_per_s": r["tokens_per_s"],
            "mfu_e2e": r["mfu_e2e"],
            "peak_memory_gib": r.get("peak_memory_gib"),
            "model_tflop_per_step": r["model_tflop_per_step"],
            "flop_ratio": base["model_tflop_per_step"] / r["model_tflop_per_step"],
            "tokens_per_s_gain": r["tokens_per_s"] / base["tokens_per_s"],
        }
        for path, r in zip(paths, runs)
    ]
    for row in rows:
        row["gain_over_flop_ratio"] = row["tokens_per_s_gain"] / row["flop_ratio"]

    def memory(gib: float | None) -> str:
        return "-" if gib is None else f"{gib:.1f}"

    lines: list[str] = [
        f"{base['recipe']}: batch {base['batch_size']}, max {base['max_seq_len']}, "
        f"{base['mean_tokens_per_batch']:.0f} tokens per batch, compile {base['compile']}, {base['device']}",
        "",
        "| attention | step ms | tokens/s | E2E MFU | peak GiB | TFLOP/step | FLOP ratio | tok/s gain | gain / ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {row['attention']} | {row['step_ms']:.1f} | {row['tokens_per_s']:,.0f} | {100 * row['mfu_e2e']:.1f}% | "
        f"{memory(row['peak_memory_gib'])} | {row['model_tflop_per_step']:.2f} | {row['flop_ratio']:.2f}x | "
        f"{row['tokens_per_s_gain']:.2f}x | {row['gain_over_flop_ratio']:.2f} |"
        for row in rows
    ]
    table = "\n".join(lines)
    summary = {"rows": rows, "table": table}
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(summary, indent=2))
    (out / "compare.md").write_text(table + "\n")
    print(table)
    return summary


def progress(start: float, phase: str) -> None:
    """One line per phase on stderr, so a run stopped by a time limit shows where it was."""
    print(f"[gpu_bench +{time.perf_counter() - start:.0f}s] {phase}", file=sys.stderr, flush=True)


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="h200-bench")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trace", action="store_true", help="also write the profiled steps' Chrome trace")
    parser.add_argument("--dataset", type=Path, help="stage batches of this dataset's train split (its schema)")
    parser.add_argument("--compare", nargs="+", type=Path, metavar="RUN_JSON", help="gpu_bench.json files to compare")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(args.compare, args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    config = load_recipe(args.recipe, args.overrides)
    # The GPU machine has no torchrec: plain torch embeddings, the rest of the recipe as it is.
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, embedding_backend="torch"))
    bench = config.bench
    device = torch.device(args.device)
    set_determinism(config.train.seed, False)
    if args.dataset is not None:
        schema, host = dataset_batches(args.dataset, config, bench.distinct_batches)
    else:
        schema, gen = synthetic_schema(bench), torch.Generator().manual_seed(config.train.seed)
        host = [
            synthetic_batch(schema, bench, config.data.batch_size, config.data.max_seq_len, gen)
            for _ in range(bench.distinct_batches)
        ]
    progress(start, f"batches built ({len(host)}); setting up the model on {device}")
    training = setup_training(config, schema, device, bench.warmup_steps + bench.steps)
    model, bf16, autocast = training.model, training.bf16, training.autocast
    flops = [total_flops(model_flops(model, inp)) for inp, _ in host]
    batches = [(inp.to(device), labels.to(device)) for inp, labels in host]
    tokens = [inp.num_tokens for inp, _ in host]
    step_losses: list[torch.Tensor] = []

    def step():
        inp, labels = batches[len(step_losses) % len(batches)]
        step_losses.append(training.step(inp, labels).loss)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    peak_memory_gib(device)  # count from here: the model, optimizer state and batches are in
    progress(start, f"{bench.warmup_steps} warm-up steps (compile {config.train.compile})")
    warmup_s = timed_steps(step, bench.warmup_steps, sync)
    warmup_memory = peak_memory_gib(device)  # compilation and autotuning included
    start_index = len(step_losses)
    progress(start, f"{bench.steps} timed steps")
    seconds = timed_steps(step, bench.steps, sync)
    step_ms = 1000 * seconds / bench.steps
    step_memory = peak_memory_gib(device)
    losses = torch.stack(step_losses).float().cpu()
    if not bool(torch.isfinite(losses).all()):
        raise RuntimeError(f"non-finite loss in the benchmark: {losses.tolist()}")
    idx = [(start_index + k) % len(batches) for k in range(bench.steps)]
    step_flops = sum(flops[i] for i in idx)
    examples = config.data.batch_size * bench.steps
    peak = device_peak(device, bf16)
    measured = (
        measure_matmul_ceiling(device, torch.bfloat16 if bf16 else torch.float32, n=8192, seconds=2.0)
        if device.type == "cuda"
        else peak.flops
    )
    e2e = step_flops / seconds / peak.flops

    inp0, labels0 = batches[0]
    progress(start, f"step {step_ms:.1f} ms, E2E MFU {100 * e2e:.1f}%; FLOP-count check")
    flop_check = flop_count_check(model, inp0, labels0, autocast)
    local, layers = None, list[LayerMFU]()
    if config.train.local_mfu:
        progress(start, "local MFU per layer")
        local, layers = measure_local_mfu(
            model,
            model_flops(model, host[0][0]),
            lambda: model(inp0),
            peak.flops,
            device,
            autocast,
            repeats=max(3, config.train.local_mfu_repeats),
            compile=config.train.compile,
        )
    progress(start, "host syncs and profile")
    host_syncs, sync_sites = count_host_syncs(step) if device.type == "cuda" else (0, [])
    table, graphs_per_step = "", None
    if bench.profile_steps:
        table, graphs_per_step = profile_steps(
            step, bench.profile_steps, device, args.out / "trace.json.gz" if args.trace else None
        )
    m = config.model
    window, block = m.seq_mask
    layer_rows: list[dict[str, Any]] = [
        {
            "name": r.name,
            "tflop": r.flops / 1e12,
            "ms": 1000 * r.seconds,
            "mfu": r.mfu,
            "share_of_step": 1000 * r.seconds / step_ms,
        }
        for r in layers
    ]
    result: dict[str, Any] = {
        "recipe": config.recipe,
        "batches": f"dataset {args.dataset}" if args.dataset is not None else "synthetic",
        "device": peak.device,
        "torch": torch.__version__,
        "precision": config.train.precision + (" (bf16 autocast)" if bf16 else " (fp32)"),
        "fp8_modules": training.fp8_modules,
        "compile": config.train.compile,
        "sparse_optimizer": training.sparse_optimizer,
        "batch_size": config.data.batch_size,
        "max_seq_len": config.data.max_seq_len,
        "mean_tokens_per_batch": float(np.mean(tokens)),
        "attention": {"mask": m.seq_attention_mask, "window": window, "block": block, "rope": m.rope},
        "activation_checkpointed": training.checkpointed,
        "peak_memory_gib": step_memory,  # the timed steps' (None off CUDA)
        "peak_memory_gib_warmup": warmup_memory,
        "params": sum(p.numel() for p in model.parameters()),
        "steps": bench.steps,
        "warmup_seconds": warmup_s,
        "step_ms": step_ms,
        "qps": examples / seconds,
        "tokens_per_s": sum(tokens[i] for i in idx) / seconds,
        "model_tflop_per_step": step_flops / bench.steps / 1e12,
        "peak_flops": peak.flops,
        "peak_source": peak.source,
        "measured_matmul_flops": measured,
        "mfu_e2e": e2e,
        "mfu_e2e_vs_measured": step_flops / seconds / measured,
        "mfu_e2e_vs_fp8_peak": step_flops / seconds / H200_FP8_DENSE_PEAK_FLOPS if "H200" in peak.device else None,
        "mfu_local": local,
        "local_mfu_compiled": config.train.compile,
        "scaling_ratio": e2e / local if local else None,
        "flop_count": flop_check,
        "layers": layer_rows,
        "final_loss": float(losses[-1]),
        "losses": losses.tolist(),  # every step, warm-up included (bf16 vs fp8 overlay: fp8_bench --compare)
        "host_syncs_per_step": host_syncs,
        "host_sync_sites": sync_sites,
        "compiled_graphs_per_step": graphs_per_step,
        "datasheet_peak_h200": H200_BF16_DENSE_PEAK_FLOPS,
        "git_commit": git_commit(),
    }
    (args.out / "gpu_bench.json").write_text(json.dumps(result, indent=2))
    (args.out / "profile.txt").write_text(table)
    lines = [f"{k}: {v}" for k, v in result.items() if k not in ("layers", "losses")]
    lines.append("layer | TFLOP | ms (fwd+bwd alone) | MFU | share of step")
    lines += [
        f"{r['name']} | {r['tflop']:.3f} | {r['ms']:.2f} | {100 * r['mfu']:.1f}% | {100 * r['share_of_step']:.1f}%"
        for r in layer_rows
    ]
    report = "\n".join(lines)
    (args.out / "report.txt").write_text(report + "\n\n" + table)
    print(table)
    print(report)
    return result


if __name__ == "__main__":
    run(sys.argv[1:])
    sys.exit(0)
