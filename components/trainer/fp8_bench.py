"""FP8 benchmark on the GPU: the MLP block and the MoE layer of `h200-bench`, bf16 against the block-scaled FP8
conversion (`precision.convert_to_fp8`) and peers, forward + backward; then the GEMMs and the quantization alone.

Peers: torchao 0.18's float8 training where it imports (Float8Linear row-wise and tensor-wise, its prototype
1x128/128x128 block-wise linear on cuBLAS and on its Triton GEMM), and torch._scaled_mm row-wise for the GEMMs.
Checks first (the FP8 ops against the fp32 result of the same quantized operands and against the exact fp32
block). Timings: triton.testing.do_bench medians; TFLOP/s count 2 FLOPs per multiply-add of the GEMMs alone.

    python -m gemrec.components.trainer.fp8_bench --out DIR [--tokens 196608] [--moe-tokens 13312] [--quick]
    python -m gemrec.components.trainer.fp8_bench --out DIR --quantize-only [--tokens 191237]   # per mode vs bytes
    python -m gemrec.components.trainer.fp8_bench --compare BF16/gpu_bench.json FP8/gpu_bench.json --out DIR \
        [--tracking-uri URI]     # (on any machine) the two gpu_bench runs' loss curves in one PNG, QPS and MFU ratios
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gemrec.components.trainer.config import Fp8Config
from gemrec.components.trainer.precision import after_step, convert_to_fp8
from gemrec.kernels import fp8
from gemrec.model.layers import Mlp
from gemrec.model.moe import MoEFeedForward
from torch import nn


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Block(nn.Module):
    """norm -> feed-forward, as in the model's layers (the residual add aside)."""

    def __init__(self, dim: int, ffn: nn.Module):
        super().__init__()
        self.norm, self.ffn = nn.LayerNorm(dim), ffn

    def forward(self, x):
        out = self.ffn(self.norm(x))
        return out[0] if isinstance(out, tuple) else out


def timed(fn, warmup=25, rep=150) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def fwd_bwd(block: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = block(x)
        y.backward(dy)
        after_step(block)  # delayed scaling: this step's amaxes into the history

    return run


def check_mlp(grad: str, gemm: str, device, gen) -> dict:
    tokens, dim, hidden = 8192, 1024, 4096
    mlp = Mlp(dim, hidden).to(device)
    x = torch.randn(tokens, dim, device=device, generator=gen, requires_grad=True)
    dy = torch.randn(tokens, dim, device=device, generator=gen)
    params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
    ref = F.linear(F.gelu(F.linear(x, *params[:2])), *params[2:])
    grads_ref = torch.autograd.grad(ref, [x, *params], dy)
    results = {}
    for backend in ("triton", "reference"):
        stats = fp8.Fp8Stats(fp8.MLP_ROLES, 0, device, collect=True)
        w1, b1, w2, b2 = params
        y = fp8.fp8_mlp(x, w1, b1, w2, b2, fp8.Fp8Recipe(fp8.fp8_format(grad), backend, gemm), stats)
        results[backend] = (y, torch.autograd.grad(y, [x, *params], dy))
    (yt, gt), (yr, gr) = results["triton"], results["reference"]
    return {
        "y_vs_emulation": rel(yt, yr),
        "y_vs_fp32": rel(yt, ref),
        "grads_vs_emulation (x, w1, b1, w2, b2)": [rel(a, b) for a, b in zip(gt, gr)],
        "grads_vs_fp32": [rel(a, b) for a, b in zip(gt, grads_ref)],
    }


def checks(device, log, full: bool) -> dict:
    """FP8 ops on real float8 against the emulation (same quantization, fp32 matmuls) and against fp32."""
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {}
    x = torch.randn(4096, 1024, device=device, generator=gen) * torch.logspace(-2, 2, 1024, device=device)
    modes: tuple[dict[str, Any], ...] = ({"rows": True, "cols": True}, {"tile": True, "cols": True})
    for fmt in (fp8.E4M3, fp8.E5M2) if full else ():
        for mode in modes:
            t = fp8.quantize(x, fmt, **mode)
            r = fp8.quantize(x, fmt, **mode, backend="reference")
            name = f"quantize_{fmt.name}_{'tile' if 'tile' in mode else 'rows_cols'}"
            out[name] = {
                k: {"max_abs_diff": float((t[k].float() - r[k].float()).abs().max())} for k in ("q", "s", "qt", "st")
            }
    for grad, gemm in (("e4m3", "triton"), ("e4m3", "cublas"), ("e5m2", "triton"))[: 3 if full else 2]:
        try:  # a failing variant is reported and the rest still run
            out[f"mlp_grad_{grad}_{gemm}"] = check_mlp(grad, gemm, device, gen)
        except Exception as exc:  # noqa: BLE001
            log(f"check mlp grad {grad} {gemm} GEMMs: failed {exc!r}")
    try:
        out["moe"] = check_moe(device, gen)
    except Exception as exc:  # noqa: BLE001
        log(f"check moe: failed {exc!r}")
    log(json.dumps(out, indent=1))
    return out


def check_moe(device, gen) -> dict:
    dim, hidden = 1024, 4096
    moe = MoEFeedForward(dim, hidden, 8, 2).to(device)
    x = torch.randn(4096, dim, device=device, generator=gen, requires_grad=True)
    dy = torch.randn(4096, dim, device=device, generator=gen)
    ref_y, _ = moe(x)  # fp32: the looped reference path
    ref_g = torch.autograd.grad(ref_y, [x, moe.experts.w1, moe.experts.w2], dy)
    conv = copy.deepcopy(moe)
    convert_to_fp8(conv, Fp8Config(), device)
    y, _ = conv(x)
    g = torch.autograd.grad(y, [x, conv.experts.w1, conv.experts.w2], dy)
    return {"y_vs_fp32": rel(y, ref_y), "grads_vs_fp32": [rel(a, b) for a, b in zip(g, ref_g)]}


def gemm_variants(a: torch.Tensor, w: torch.Tensor, ao_kernels, log) -> tuple[dict, torch.Tensor]:
    """name -> call of the GEMM a @ w.T in bf16 and each FP8 form; and the fp32 result of our quantized operands."""
    n = w.shape[0]
    aq = fp8.quantize(a, fp8.E4M3)
    wq = fp8.quantize(w, fp8.E4M3, tile=True)
    a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    ones_a, ones_b = torch.ones(a.shape[0], 1, device=a.device), torch.ones(1, n, device=a.device)
    variants = {
        "bf16 torch.mm": lambda: a @ w.T,
        "fp8 1x128/128x128 ours (Triton)": lambda: fp8.gemm(
            aq["q"], aq["s"], wq["q"], wq["s"], torch.bfloat16, b_tiles=True
        ),
        "fp8 row-wise torch._scaled_mm": lambda: torch._scaled_mm(a8, w8.T, ones_a, ones_b, out_dtype=torch.bfloat16),
    }
    if ao_kernels is not None:
        try:
            from torchao.prototype.blockwise_fp8_training.linear import _scaled_mm as ao_scaled_mm

            xa, xs = ao_kernels.triton_fp8_blockwise_act_quant_lhs(a, 128)
            wt, ws = ao_kernels.triton_fp8_blockwise_weight_quant_transposed_rhs(w, block_size=128)
            variants["fp8 1x128/128x128 torchao Triton"] = lambda: ao_kernels.triton_fp8_gemm_1x128_128x128(
                xa, wt, xs, ws, out_dtype=torch.bfloat16
            )
            one_by_128, tile = ao_kernels.BLOCKWISE_1X128_SCALING_TYPE, ao_kernels.BLOCKWISE_128X128_SCALING_TYPE
            variants["fp8 1x128/128x128 cuBLAS (F.scaled_mm via torchao)"] = lambda: ao_scaled_mm(
                xa, wt, xs, one_by_128, ws, tile, torch.bfloat16
            )
        except Exception as err:  # noqa: BLE001 - a peer that fails is reported, not fatal
            log(f"torchao block-wise GEMM setup failed: {err!r}")
    return variants, fp8.gemm(aq["q"], aq["s"], wq["q"], wq["s"], torch.float32, b_tiles=True, backend="reference")


def gemm_bench(device, tokens, log) -> list[dict]:
    rows: list[dict] = []
    gen = torch.Generator(device=device).manual_seed(1)
    try:
        from torchao.prototype.blockwise_fp8_training import kernels as ao_kernels
    except Exception as err:  # noqa: BLE001 - a peer that is not there is reported, not fatal
        ao_kernels = None
        log(f"torchao block-wise kernels unavailable: {err!r}")
    for k, n in ((1024, 4096), (4096, 1024)):
        flops = 2 * tokens * k * n
        a = torch.randn(tokens, k, device=device, generator=gen, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.05
        variants, ref = gemm_variants(a, w, ao_kernels, log)
        for name, fn in variants.items():
            try:
                error = rel(fn(), ref) if name.startswith("fp8 1x128") else None
                ms = timed(fn)
            except Exception as exc:  # noqa: BLE001
                log(f"{name} {tokens}x{k}->{n}: failed {exc!r}")
                continue
            rows.append(
                {"gemm": f"{tokens}x{k}->{n}", "variant": name, "ms": ms, "tflops": flops / ms / 1e9, "err": error}
            )
            log(f"gemm {tokens}x{k}->{n} {name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s err={error}")
        del variants, ref
    return rows


def measured_copy_rate(device) -> float:
    """Bytes per second read plus written by a copy of 1 GiB of bf16."""
    src = torch.empty(2**29, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / timed(lambda: dst.copy_(src)) * 1e3


def quantize_bench(device, tokens, moe_tokens, log) -> list[dict]:
    """`fp8.quantize` in each mode the training step calls, at its shapes (MLP: `tokens` x 1024 -> 4096; experts:
    `moe_tokens` x top-2 of 8 rows padded per expert, 4096 hidden), against the time its bytes take at the copy rate
    measured here (a bf16 copy of 1 GiB): inputs read once, q and qt written once (fp8; scales and sums aside). At 8
    and 16 warps a program (`fp8.QUANTIZE_WARPS`)."""
    copy_rate = measured_copy_rate(device)
    log(f"quantize: copy rate {copy_rate / 1e12:.2f} TB/s (bf16 copy of 1 GiB)")
    gen = torch.Generator(device=device).manual_seed(3)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, generator=gen, dtype=dtype)

    expert_rows = -(-(moe_tokens * 2 + 8 * 127) // 128) * 128  # as `fp8.group_layout` pads them
    x, dy = randn(tokens, 1024), randn(tokens, 1024)
    h, dg = randn(tokens, 4096), randn(tokens, 4096)
    h13, dg_e = randn(expert_rows, 2 * 4096), randn(expert_rows, 4096)
    e4m3 = fp8.E4M3
    cases: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {  # name -> (input, keyword arguments)
        "x rows+cols": (x, {"cols": True}),
        "gelu rows+cols": (h, {"cols": True, "act": "gelu"}),
        "grad_out rows+cols+colsum": (dy, {"cols": True, "colsum": True}),
        "gelu_bwd rows+cols+colsum": (dg, {"cols": True, "act": "gelu_bwd", "gate": h, "colsum": True}),
        "weight tile+cols (fp32)": (randn(4096, 1024, dtype=torch.float32), {"tile": True, "cols": True}),
        "swiglu rows+cols": (h13[:, :4096], {"cols": True, "act": "swiglu", "gate": h13[:, 4096:]}),
        "swiglu_bwd rows+cols": (dg_e, {"cols": True, "act": "swiglu_bwd", "gate": h13}),
    }
    out = []
    chosen = fp8.QUANTIZE_WARPS
    for name, (inp, kw) in cases.items():
        gate = kw.get("gate")
        read = inp.numel() * inp.element_size() + (gate.numel() * gate.element_size() if gate is not None else 0)
        written = 2 * inp.numel() * (2 if kw.get("act") == "swiglu_bwd" else 1)
        ideal = (read + written) / copy_rate * 1e3
        shape = "x".join(map(str, inp.shape))
        for warps in dict.fromkeys((chosen, 8, 16)):  # the module's choice first, then the alternative
            fp8.QUANTIZE_WARPS = warps
            try:
                ms = timed(lambda inp=inp, kw=kw: fp8.quantize(inp, e4m3, **kw))
            finally:
                fp8.QUANTIZE_WARPS = chosen
            row = {"quantize": name, "shape": shape, "warps": warps, "ms": ms, "ideal_ms": ideal}
            out.append({**row, "gb": (read + written) / 1e9})
            log(
                f"quantize {name} {shape} {warps} warps: {ms:.3f} ms; its bytes at the copy rate {ideal:.3f} ms "
                f"({ms / ideal:.1f}x)"
            )
    return out


def torchao_blocks(dim, hidden, device, log) -> dict[str, nn.Module]:
    """The MLP block converted by torchao's float8 training (where torchao imports)."""
    out: dict[str, nn.Module] = {}
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as err:  # noqa: BLE001
        log(f"torchao float8 unavailable: {err!r}")
        return out
    for recipe in ("rowwise", "tensorwise"):
        block = Block(dim, Mlp(dim, hidden)).to(device)
        convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name(recipe))
        out[f"torchao Float8Linear {recipe}"] = block
    try:
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        class AoBlockwiseMlp(Mlp):
            use_triton = False

            def forward(self, x):
                x = x.to(torch.bfloat16)
                h = fp8_blockwise_mm.apply(x, self.fc1.weight, 128, torch.bfloat16, self.use_triton) + self.fc1.bias
                g = F.gelu(h).to(torch.bfloat16)
                return fp8_blockwise_mm.apply(g, self.fc2.weight, 128, torch.bfloat16, self.use_triton) + self.fc2.bias

        for use_triton in (False, True):
            mlp = Mlp(dim, hidden)
            mlp.__class__ = AoBlockwiseMlp
            setattr(mlp, "use_triton", use_triton)  # noqa: B010 (the swapped-in class's flag)
            block = Block(dim, mlp).to(device)
            block.ffn.fc1.to(torch.bfloat16)
            block.ffn.fc2.to(torch.bfloat16)
            out[f"torchao block-wise {'Triton' if use_triton else 'cuBLAS'} (bf16 weights)"] = block
    except Exception as err:  # noqa: BLE001
        log(f"torchao block-wise linear unavailable: {err!r}")
    return out


def profile_table(step, path: Path, log) -> None:
    """CUDA time per kernel over 3 calls of `step` (where the FP8 block's time goes)."""
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the timings above stand without it
        log(f"profile {path.name}: failed {exc!r}")
        return
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
    path.write_text(table)
    log(table)


def time_variants(title: str, variants: dict, x, dy, flops: int, log, rows: list) -> None:
    for name, block in variants.items():
        try:
            ms = timed(fwd_bwd(block, x, dy))
        except Exception as exc:  # noqa: BLE001 - one failing variant must not cost the others
            log(f"{title} {name}: failed {exc!r}")
            continue
        rows.append({"block": title, "variant": name, "ms": ms, "tflops": flops / ms / 1e9})
        log(f"{title} | {name}: {ms:.2f} ms ({flops / ms / 1e9:.0f} TFLOP/s of GEMMs)")
        block.zero_grad(set_to_none=True)
        x.grad = None


def converted(block: nn.Module, device, **options) -> nn.Module:
    block = copy.deepcopy(block)
    convert_to_fp8(block, Fp8Config(**options), device)
    return block


def block_bench(device, tokens, moe_tokens, log, full: bool, out: Path) -> list[dict]:
    dim, hidden = 1024, 4096
    gen = torch.Generator(device=device).manual_seed(2)
    rows: list[dict] = []
    x = torch.randn(tokens, dim, device=device, generator=gen, requires_grad=True)
    dy = torch.randn(tokens, dim, device=device, generator=gen, dtype=torch.bfloat16)
    bf16 = Block(dim, Mlp(dim, hidden)).to(device)
    variants: dict[str, nn.Module] = {"bf16 (autocast, fp32 masters)": bf16}
    for gemm in fp8.GEMMS:
        variants[f"fp8 ours, {gemm} GEMMs, grad e4m3 dynamic"] = converted(bf16, device, gemm=gemm)
    if full:
        for grad, scaling in (("e5m2", "dynamic"), ("e4m3", "delayed"), ("e5m2", "delayed")):
            variants[f"fp8 ours, triton GEMMs, grad {grad} {scaling}"] = converted(
                bf16, device, grad_format=grad, scaling=scaling
            )
        variants.update(torchao_blocks(dim, hidden, device, log))
    title = f"MLP block {tokens} tokens {dim}->{hidden}->{dim}"
    time_variants(title, variants, x, dy, 3 * 2 * 2 * tokens * dim * hidden, log, rows)
    profile_table(fwd_bwd(variants["fp8 ours, triton GEMMs, grad e4m3 dynamic"], x, dy), out / "profile_mlp.txt", log)
    del variants
    x = torch.randn(moe_tokens, dim, device=device, generator=gen, requires_grad=True)
    dy = torch.randn(moe_tokens, dim, device=device, generator=gen, dtype=torch.bfloat16)
    bf16 = Block(dim, MoEFeedForward(dim, hidden, 8, 2)).to(device)
    variants = {"bf16 (torch._grouped_mm)": bf16, "fp8 ours grad e4m3": converted(bf16, device)}
    if full:
        variants["fp8 ours grad e5m2"] = converted(bf16, device, grad_format="e5m2")
    title = f"MoE layer {moe_tokens} tokens 8 experts top-2 {dim}/{hidden}"
    time_variants(title, variants, x, dy, 3 * 3 * 2 * moe_tokens * 2 * dim * hidden, log, rows)
    profile_table(fwd_bwd(variants["fp8 ours grad e4m3"], x, dy), out / "profile_moe.txt", log)
    return rows


def compare(bf16_json: Path, fp8_json: Path, out: Path, tracking_uri: str | None) -> dict:
    """bf16 vs fp8 `gpu_bench` runs: loss curves overlaid (PNG, an MLflow artifact when `tracking_uri`), QPS ratio,
    and the fp8 run's MFU against the bf16 and the FP8 peaks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {"bf16": json.loads(bf16_json.read_text()), "fp8": json.loads(fp8_json.read_text())}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], label=f"{name} ({run['precision']})")
    ax.set(xlabel="step", ylabel="training loss", title=f"{runs['bf16']['recipe']}: bf16 vs fp8")
    ax.legend()
    fig.savefig(out / "loss_bf16_vs_fp8.png", dpi=120, bbox_inches="tight")
    summary = {
        "qps_bf16": runs["bf16"]["qps"],
        "qps_fp8": runs["fp8"]["qps"],
        "qps_ratio": runs["fp8"]["qps"] / runs["bf16"]["qps"],
        "mfu_e2e_fp8_vs_bf16_peak": runs["fp8"]["mfu_e2e"],
        "mfu_e2e_fp8_vs_fp8_peak": runs["fp8"].get("mfu_e2e_vs_fp8_peak"),
        "final_loss_bf16": runs["bf16"]["final_loss"],
        "final_loss_fp8": runs["fp8"]["final_loss"],
    }
    (out / "compare.json").write_text(json.dumps(summary, indent=2))
    if tracking_uri:
        from gemrec.components.trainer.tracking import Tracker, resolve_tracking_uri

        name = f"{runs['bf16']['recipe']}-bf16-vs-fp8"
        tracker = Tracker(True, resolve_tracking_uri(tracking_uri), "gemrec", run_name=name)
        tracker.log_metrics({k: v for k, v in summary.items() if isinstance(v, float)}, step=0)
        tracker.log_figure(fig, "plots/loss_bf16_vs_fp8.png")
        tracker.finish()
    plt.close(fig)
    print(json.dumps(summary, indent=2))
    return summary


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=196_608, help="MLP block rows (h200-bench: 512 x 384)")
    parser.add_argument("--moe-tokens", type=int, default=13_312, help="MoE rows (h200-bench: 512 x 26 tokens)")
    parser.add_argument("--quick", action="store_true", help="e4m3 dynamic only: no peers, no GEMM-alone table")
    parser.add_argument("--quantize-only", action="store_true", help="only the quantization kernel per mode")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BF16_JSON", "FP8_JSON"), help="gpu_bench runs")
    parser.add_argument("--tracking-uri", help="with --compare: log the overlay and ratios to this MLflow store")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        bf16_json, fp8_json = args.compare
        return compare(bf16_json, fp8_json, args.out, args.tracking_uri)
    if not torch.cuda.is_available():
        parser.error("fp8_bench needs a CUDA GPU (Hopper or newer)")
    device = torch.device("cuda")
    log_path = args.out / "fp8_bench.log"
    log_path.write_text("")

    def log(text: str) -> None:
        print(text, flush=True)
        with log_path.open("a") as f:
            f.write(text + "\n")

    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    result: dict[str, Any] = {}
    if not args.quantize_only:
        result["checks"] = checks(device, log, full=not args.quick)
        result["blocks"] = block_bench(device, args.tokens, args.moe_tokens, log, not args.quick, args.out)
        result["gemms"] = None if args.quick else gemm_bench(device, args.tokens, log)
    if args.quantize_only or not args.quick:
        result["quantize"] = quantize_bench(device, args.tokens, args.moe_tokens, log)
    (args.out / "fp8_bench.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    run(sys.argv[1:])
    sys.exit(0)
