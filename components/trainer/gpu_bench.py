"""GPU training benchmark: a recipe (default `h200-bench`) on production-shaped synthetic batches.

Batches are built as `ModelInput` with `JaggedFeatures` (no torchrec, no data service: the GPU machine has
neither), a few distinct ones generated up front and rotated, so the numbers are the model + optimizer
alone. Reports QPS, tokens/s, E2E MFU, per-layer local MFU (each layer alone, forward + backward), the
scaling ratio, and a profiler table of where the step time goes.

    python -m gemrec.components.trainer.gpu_bench --recipe h200-bench --out DIR [--set section.key=value]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gemrec.components.trainer.config import load_recipe
from gemrec.components.trainer.mfu import (
    H200_BF16_DENSE_PEAK_FLOPS,
    device_peak,
    measure_local_mfu,
    measure_matmul_ceiling,
    total_flops,
)
from gemrec.components.trainer.optim import Optimizers, apply_sparse_optimizer
from gemrec.model import (
    FeatureSchema,
    JaggedFeatures,
    ModelInput,
    SparseFeature,
    build_model,
    model_flops,
)
from gemrec.model import loss as model_loss
from gemrec.model.bench import count_host_syncs


def synthetic_schema(bench) -> FeatureSchema:
    """user/item ids plus side features shaped like an ads model's (sizes from the recipe's [bench])."""
    sparse = [
        SparseFeature("user_id", bench.num_users, source="user"),
        SparseFeature("item_id", bench.num_items, source="item"),
        SparseFeature("item_category", 1000, source="item"),
        SparseFeature("item_brand", 50_000, source="item"),
        SparseFeature("item_tags", 20_000, multi_valued=True, source="item"),
        SparseFeature("user_interests", 1000, multi_valued=True, source="user"),
        SparseFeature("user_segment", 10_000, source="user"),
        SparseFeature("ctx_surface", 16, source="event"),
        SparseFeature("ctx_position", 64, source="event"),
    ]
    return FeatureSchema(
        sparse_features=tuple(sparse),
        seq_item_features=("item_category", "item_brand"),
        dense_features=tuple(f"dense_{i}" for i in range(bench.num_dense)),
        labels=("click", "convert"),
        actions=("click", "convert", "like", "dwell"),
    )


def _ids(gen: torch.Generator, n: int, rows: int) -> torch.Tensor:
    return torch.randint(0, rows, (n,), generator=gen, dtype=torch.long)


def synthetic_lengths(bench, batch_size: int, max_seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Lognormal history lengths (mean `bench.mean_seq_len`) capped at max_seq_len."""
    mu = math.log(bench.mean_seq_len) - bench.length_sigma**2 / 2
    lengths = torch.exp(mu + bench.length_sigma * torch.randn(batch_size, generator=gen)).long()
    return lengths.clamp(1, max_seq_len)


def synthetic_batch(
    schema: FeatureSchema,
    bench,
    batch_size: int,
    max_seq_len: int,
    gen: torch.Generator,
    lengths: torch.Tensor | None = None,
):
    """(ModelInput on the host, labels) with the given history `lengths`, else drawn by `synthetic_lengths`."""
    if lengths is None:
        lengths = synthetic_lengths(bench, batch_size, max_seq_len, gen)
    elif len(lengths) != batch_size:
        raise ValueError(f"synthetic_batch: {len(lengths)} lengths for a batch of {batch_size}")
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    tokens = int(offsets[-1])
    per_key = {}
    for f in schema.sparse_features:
        counts = (
            torch.randint(1, 5, (batch_size,), generator=gen)
            if f.multi_valued
            else torch.ones(batch_size, dtype=torch.long)
        )
        per_key[f.name] = (_ids(gen, int(counts.sum()), f.num_embeddings), counts)
    seq_features = {
        name: (_ids(gen, tokens, schema.feature(name).num_embeddings), torch.ones(tokens, dtype=torch.long))
        for name in schema.seq_item_features
    }
    now = 1_700_000_000
    inp = ModelInput(
        sparse_features=JaggedFeatures.from_dict(per_key, stride=batch_size),
        dense_features=torch.randn(batch_size, schema.num_dense, generator=gen),
        seq_offsets=offsets,
        seq_item_ids=_ids(gen, tokens, schema.feature("item_id").num_embeddings),
        seq_timestamps=now - torch.randint(1, 90 * 86400, (tokens,), generator=gen),
        seq_actions=(torch.rand(tokens, schema.num_actions, generator=gen) < 0.3).float(),
        seq_item_features=JaggedFeatures.from_dict(seq_features, stride=tokens),
        max_seq_len=int(lengths.max()),
        timestamps=torch.full((batch_size,), now, dtype=torch.long),
    )
    labels = (torch.rand(batch_size, schema.num_tasks, generator=gen) < 0.3).float()
    return inp, labels


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


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="h200-bench")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trace", action="store_true", help="also write the profiled steps' Chrome trace")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    config = load_recipe(args.recipe, args.overrides)
    bench = config.bench
    device = torch.device(args.device)
    torch.manual_seed(config.train.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    schema = synthetic_schema(bench)
    model_config = dataclasses.replace(config.model, embedding_backend="torch")
    model = build_model(model_config, schema).to(device)
    sparse_kind = apply_sparse_optimizer(model, config.optim)
    train_model = torch.compile(model) if config.train.compile else model
    total_steps = bench.warmup_steps + bench.steps
    optimizers = Optimizers(model, config.optim, total_steps)
    bf16 = config.train.precision in ("auto", "bf16") and device.type == "cuda" or config.train.precision == "bf16"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    gen = torch.Generator().manual_seed(config.train.seed)
    host = [
        synthetic_batch(schema, bench, config.data.batch_size, config.data.max_seq_len, gen)
        for _ in range(bench.distinct_batches)
    ]
    flops = [total_flops(model_flops(model, inp)) for inp, _ in host]
    batches = [(inp.to(device), labels.to(device)) for inp, labels in host]
    tokens = [inp.num_tokens for inp, _ in host]
    state = {"i": 0, "losses": []}

    def step():
        inp, labels = batches[state["i"] % len(batches)]
        state["i"] += 1
        with autocast():
            out = train_model(inp)
        loss = model_loss(out, labels)
        loss.backward()
        optimizers.clip_and_step()
        state["losses"].append(loss.detach())

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(bench.warmup_steps):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    start_index = state["i"]
    t0 = time.perf_counter()
    for _ in range(bench.steps):
        step()
    sync()
    seconds = time.perf_counter() - t0
    losses = torch.stack(state["losses"]).float().cpu()
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

    inp0, _ = batches[0]
    local, layers = measure_local_mfu(
        model,
        model_flops(model, host[0][0]),
        lambda: model(inp0),
        peak.flops,
        device,
        autocast,
        repeats=max(3, config.train.local_mfu_repeats),
    )
    step_ms = 1000 * seconds / bench.steps
    host_syncs, sync_sites = count_host_syncs(step) if device.type == "cuda" else (0, [])
    table, graphs_per_step = profile_steps(
        step, bench.profile_steps, device, args.out / "trace.json.gz" if args.trace else None
    )
    result = {
        "recipe": config.recipe,
        "device": peak.device,
        "torch": torch.__version__,
        "precision": "bf16 autocast" if bf16 else "fp32",
        "compile": config.train.compile,
        "sparse_optimizer": sparse_kind,
        "batch_size": config.data.batch_size,
        "max_seq_len": config.data.max_seq_len,
        "mean_tokens_per_batch": float(np.mean(tokens)),
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
        "mfu_local": local,
        "scaling_ratio": e2e / local if local else float("nan"),
        "layers": [
            {
                "name": r.name,
                "tflop": r.flops / 1e12,
                "ms": 1000 * r.seconds,
                "mfu": r.mfu,
                "share_of_step": 1000 * r.seconds / step_ms,
            }
            for r in layers
        ],
        "final_loss": float(losses[-1]),
        "host_syncs_per_step": host_syncs,
        "host_sync_sites": sync_sites,
        "compiled_graphs_per_step": graphs_per_step,
        "datasheet_peak_h200": H200_BF16_DENSE_PEAK_FLOPS,
    }
    (args.out / "gpu_bench.json").write_text(json.dumps(result, indent=2))
    (args.out / "profile.txt").write_text(table)
    lines = [f"{k}: {v}" for k, v in result.items() if k != "layers"]
    lines.append("layer | TFLOP | ms (fwd+bwd alone) | MFU | share of step")
    lines += [
        f"{r['name']} | {r['tflop']:.3f} | {r['ms']:.2f} | {100 * r['mfu']:.1f}% | {100 * r['share_of_step']:.1f}%"
        for r in result["layers"]
    ]
    report = "\n".join(lines)
    (args.out / "report.txt").write_text(report + "\n\n" + table)
    print(table)
    print(report)
    return result


if __name__ == "__main__":
    run(sys.argv[1:])
    sys.exit(0)
