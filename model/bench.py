"""Model benchmark: correctness of the device paths, then forward/backward time of the whole model and of
each layer alone, on random production-shaped batches (torch embeddings, no torchrec, no data service).

    gemrec bench model --out DIR [--device cuda] [--batch-size 256] [--mean-len 512] [--max-len 3072]
                       [--set model.KEY=VALUE ...] [--set kernels.KEY=VALUE ...]

Checks (device vs a float32 reference on the same device): the kernels' attention ops against their
reference (`backend="reference"`), the MoE grouped path against the per-expert loop, bf16-autocast logits
against float32 logits; and host syncs inside one training step (CUDA sync debug mode). Writes
`model_bench.json` and prints a per-layer table (milliseconds, achieved TFLOP/s).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
import typing
import warnings
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from pathlib import Path

import torch
from gemrec.config import apply_overrides, build_sections
from gemrec.kernels import KernelOptions, gdpa, jagged_attention
from gemrec.model.capture import capture_layer_inputs
from gemrec.model.config import ModelConfig
from gemrec.model.gem import build_model, model_flops
from gemrec.model.step import train_step
from gemrec.model.synthetic import bench_schema, lognormal_lengths, random_input, random_labels

PRODUCTION = dict(
    arch="gem",
    embedding_backend="torch",
    embedding_dim=128,
    d_model=512,
    num_heads=4,
    seq_layers=4,
    nonseq_layers=2,
    interaction_layers=4,
    moe_every=2,
    moe_num_experts=8,
    moe_top_k=2,
    moe_hidden=2048,
    head_hidden=1024,
    pma_seeds=16,
)
LENGTH_SIGMA = 0.8  # of the lognormal history lengths


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12))


def _timer(device: torch.device):
    """Returns `measure(fn, repeats) -> median milliseconds` (CUDA events on a GPU, host clock on a CPU)."""

    def measure(fn, repeats: int) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return measure


def check_attention(device: torch.device, seed: int = 0) -> dict[str, float]:
    """The kernels' ops (Triton on CUDA) vs their float32 reference, bf16 inputs: the model's attention kinds."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.cat([torch.tensor([0, 1, 2]), torch.randint(1, 700, (13,), generator=gen)])
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device)
    total, max_len, heads, dim = int(lengths.sum()), int(lengths.max()), 4, 64
    ops: dict[str, Callable[..., torch.Tensor]] = {
        "softmax": jagged_attention,
        "silu": functools.partial(gdpa, activation="silu", normalize="kv_len"),
    }
    results = {}
    for kind, op in ops.items():
        for causal in (False, True):
            q, k, v = (torch.randn(total, heads, dim, generator=gen).to(device, torch.bfloat16) for _ in range(3))
            got = op(q, k, v, offsets, offsets, max_len, max_len, causal=causal)
            want = op(
                q.float(), k.float(), v.float(), offsets, offsets, max_len, max_len, causal=causal, backend="reference"
            )
            results[f"{kind}{'_causal' if causal else ''}"] = rel_error(got, want)
    seeds = torch.randn(16, heads, dim, generator=gen).to(device, torch.bfloat16)
    k, v = (torch.randn(total, heads, dim, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    shared = torch.tensor([0, 16], device=device)
    got = jagged_attention(seeds, k, v, shared, offsets, 16, max_len)
    want = jagged_attention(seeds.float(), k.float(), v.float(), shared, offsets, 16, max_len, backend="reference")
    results["shared_q"] = rel_error(got, want)
    return results


def check_moe(model, device: torch.device) -> float | None:
    from gemrec.model.moe import MoEFeedForward

    moe = next((m for m in model.modules() if isinstance(m, MoEFeedForward)), None)
    if moe is None:
        return None
    x = torch.randn(4096, moe.experts.dim, device=device)
    with torch.no_grad():
        x_sorted, counts, _ = moe.dispatch(x, moe.route(x)[1])
        with torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else nullcontext():
            fast = moe.experts(x_sorted, counts)
        reference = moe.experts._looped(x_sorted, counts)
    return rel_error(fast, reference)


SYNC_WARNING = "called a synchronizing CUDA operation"  # c10's warning in sync debug mode "warn"


def sync_sites(caught: Iterable[warnings.WarningMessage]) -> tuple[int, list[str]]:
    """The host syncs among recorded warnings, and where they came from (not the mode's own "prototype" notice)."""
    syncs = [w for w in caught if str(w.message).startswith(SYNC_WARNING)]
    return len(syncs), sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})


def count_host_syncs(step) -> tuple[int, list[str]]:
    """Host syncs CUDA's sync debug mode reports during one step (with where they came from)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return sync_sites(caught)


def _first_tensor(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def run(args) -> dict:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    config = args.model_config
    schema = bench_schema(args.num_users, args.num_users)
    torch.manual_seed(0)
    model = build_model(config, schema, args.kernel_options).to(device)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if device.type == "cuda" else nullcontext
    inputs = []
    for i in range(args.distinct_batches):
        gen = torch.Generator().manual_seed(i)
        lengths = lognormal_lengths(args.batch_size, args.mean_len, LENGTH_SIGMA, args.max_len, gen)
        inp = random_input(schema, args.batch_size, args.max_len, lengths=lengths, generator=gen)
        inputs.append((inp.to(device), random_labels(args.batch_size, schema.num_tasks, gen).to(device)))
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": config.to_dict(),
        "kernel_options": args.kernel_options.to_dict(),
        "batch_size": args.batch_size,
        "tokens_per_batch": [inp.num_tokens for inp, _ in inputs],
        "max_seq_len": [inp.max_seq_len for inp, _ in inputs],
        "params": sum(p.numel() for p in model.parameters()),
    }
    print(f"device {report['device']}, {report['params'] / 1e6:.1f}M params, tokens/batch {report['tokens_per_batch']}")

    report["check_attention_rel_error"] = check_attention(device)
    report["check_moe_grouped_rel_error"] = check_moe(model, device)
    with torch.no_grad():
        inp0 = inputs[0][0]
        full = model(inp0).logits
        with autocast():
            low = model(inp0).logits
    report["check_bf16_logits_rel_error"] = rel_error(low, full)
    print("checks:", json.dumps({k: v for k, v in report.items() if k.startswith("check")}, indent=None))

    counter = {"i": 0}

    def step():
        inp, labels = inputs[counter["i"] % len(inputs)]
        counter["i"] += 1
        train_step(model, inp, labels, autocast=autocast)  # forward + backward: the model alone, no optimizer

    if device.type == "cuda":
        step()
        syncs, where = count_host_syncs(step)
        report["host_syncs_per_step"] = {"count": syncs, "where": where}
        print(f"host syncs in one step: {syncs} at {where}")

    measure = _timer(device)
    step_ms = measure(step, args.steps)
    flops = [model_flops(model, inp) for inp, _ in inputs]
    step_flops = statistics.mean(sum(f + b for f, b in fl.values()) for fl in flops)
    tokens = statistics.mean(inp.num_tokens for inp, _ in inputs)
    report["step_ms"] = step_ms
    report["examples_per_s"] = args.batch_size / step_ms * 1e3
    report["tokens_per_s"] = tokens / step_ms * 1e3
    report["step_tflop"] = step_flops / 1e12
    report["achieved_tflops"] = step_flops / step_ms / 1e9
    print(
        f"step {step_ms:.1f} ms, {report['examples_per_s']:.0f} examples/s, {report['tokens_per_s'] / 1e6:.2f}M tok/s, "
        f"{report['achieved_tflops']:.1f} TFLOP/s achieved ({report['step_tflop']:.2f} TFLOP/step)"
    )

    # Each layer alone, on the inputs it saw in a real forward: forward, then forward + backward.
    layer_flops = flops[0]
    captured = capture_layer_inputs(model, list(layer_flops), lambda: model(inp0))
    modules = dict(model.named_modules())
    layers = []
    for name, (fwd_flops, bwd_flops) in layer_flops.items():
        module, (largs, lkwargs) = modules[name], captured[name]

        def forward(module=module, largs=largs, lkwargs=lkwargs):
            with autocast():
                return _first_tensor(module(*largs, **lkwargs))

        def forward_backward(forward=forward):
            out = forward()
            out.float().sum().backward()

        with torch.no_grad():
            fwd_ms = measure(forward, args.layer_repeats)
        both_ms = measure(forward_backward, args.layer_repeats)
        layers.append(
            {
                "layer": name,
                "fwd_ms": fwd_ms,
                "fwd_bwd_ms": both_ms,
                "tflop": (fwd_flops + bwd_flops) / 1e12,
                "tflops": (fwd_flops + bwd_flops) / both_ms / 1e9,
            }
        )
    report["layers"] = layers
    print(f"{'layer':<18}{'fwd ms':>10}{'fwd+bwd ms':>12}{'TFLOP':>9}{'TFLOP/s':>9}")
    for row in layers:
        print(
            f"{row['layer']:<18}{row['fwd_ms']:>10.2f}{row['fwd_bwd_ms']:>12.2f}{row['tflop']:>9.3f}{row['tflops']:>9.1f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_bench.json").write_text(json.dumps(report, indent=2))
    return report


def production_config(overrides: Iterable[str] = ()) -> tuple[ModelConfig, KernelOptions]:
    """`PRODUCTION` and the kernels' options with `model.key=value` / `kernels.key=value` overrides, read and checked
    by the one config parser."""
    raw = apply_overrides({"model": PRODUCTION}, overrides)
    sections = build_sections(raw, {"model": ModelConfig, "kernels": KernelOptions})
    return typing.cast(ModelConfig, sections["model"]), typing.cast(KernelOptions, sections["kernels"])


def main(argv: list[str] | None = None) -> dict:
    import argparse

    from gemrec.model.cli import add_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.model_config, args.kernel_options = production_config(args.overrides)
    return run(args)


if __name__ == "__main__":
    main()
