"""FP8 benchmark on the GPU: the MLP block and the MoE layer of `h200-bench`, bf16 against the block-scaled FP8
conversion (`precision.convert_to_fp8`) and peers, forward + backward; then the GEMMs and the quantization alone.

Peers: torchao 0.18's float8 training where it imports (Float8Linear row-wise and tensor-wise, its prototype
1x128/128x128 block-wise linear on cuBLAS and on its Triton GEMM), and torch._scaled_mm row-wise for the GEMMs.
Checks first (the FP8 ops against the fp32 result of the same quantized operands and against the exact fp32
block). Timings: triton.testing.do_bench medians; TFLOP/s count 2 FLOPs per multiply-add of the GEMMs alone.
`--gemm-sweep` instead times our block-scaled GEMM kernel over tile configs and structural variants at each GEMM
of the MLP block, against bf16 torch.mm, cuBLAS's block-scaled F.scaled_mm and row-wise torch._scaled_mm
(`gemm_sweep.json`; on the CPU under TRITON_INTERPRET=1 too: the plumbing, by the host clock).

    python -m gemrec.components.trainer.fp8_bench --out DIR [--tokens 196608] [--moe-tokens 13312] [--quick]
    python -m gemrec.components.trainer.fp8_bench --out DIR --quantize-only [--tokens 191237]   # per mode vs bytes
    python -m gemrec.components.trainer.fp8_bench --out DIR --gemm-sweep [--sweep-budget 170]   # our GEMM's tiles
    python -m gemrec.components.trainer.fp8_bench --compare BF16/gpu_bench.json FP8/gpu_bench.json --out DIR \
        [--tracking-uri URI]     # (on any machine) the two gpu_bench runs' loss curves in one PNG, QPS and MFU ratios
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gemrec.components.trainer.config import Fp8Config
from gemrec.components.trainer.precision import after_step, convert_to_fp8
from gemrec.kernels import fp8
from gemrec.kernels.aot import HOPPER_SHARED_MEMORY
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


def wall_time(fn, reps=3) -> float:
    """Median milliseconds of `fn` by the host clock (the CPU's stand-in for `timed`)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[reps // 2]


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


# -- GEMM sweep: our kernel's tile configs at each GEMM of the MLP block, against the references -------------------


@dataclass
class SweepSite:
    """One GEMM call of the MLP block (`fp8._Fp8Mlp`) at the sweep's shapes: `ours(config)` runs our kernel with a
    fixed tile config (None: as the op runs it) and returns its output; `refs` the peers' calls."""

    name: str
    m: int
    n: int
    k: int
    ours: Callable[[dict | None], Any]
    refs: dict[str, Callable[[], Any]]

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def kind(self) -> str:
        """rows (a weight gradient: both operands 1x128-scaled) | weight (a weight's 128x128 tile scales)"""
        return "rows" if self.name.startswith("dw") else "weight"


def sweep_operands(tokens: int, jagged: int, dim: int, hidden: int, device) -> dict[str, Any]:
    """The MLP block's operands as its forward and backward quantize them (random data, bf16 activations and
    gradients, fp32 weights), at `tokens` rows and, for the weight gradients, at `jagged` rows too."""
    gen = torch.Generator(device=device).manual_seed(4)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    e4m3 = fp8.E4M3
    bf = {"x": randn(tokens, dim), "h": randn(tokens, hidden), "dy": randn(tokens, dim), "dh": randn(tokens, hidden)}
    ops: dict[str, Any] = {"bf16": bf, "b1": randn(hidden, dtype=torch.float32), "b2": randn(dim, dtype=torch.float32)}
    ops["w1_bf16"], ops["w2_bf16"] = randn(hidden, dim, scale=0.03), randn(dim, hidden, scale=0.015)
    ops["w1"] = fp8.quantize(ops["w1_bf16"].float(), e4m3, tile=True, cols=True)
    ops["w2"] = fp8.quantize(ops["w2_bf16"].float(), e4m3, tile=True, cols=True)
    for rows, suffix in ((tokens, ""), (jagged, "_j")):
        ops["x" + suffix] = fp8.quantize(bf["x"][:rows], e4m3, cols=True)
        ops["g" + suffix] = fp8.quantize(bf["h"][:rows], e4m3, cols=True, act="gelu")
        ops["dy" + suffix] = fp8.quantize(bf["dy"][:rows], e4m3, cols=True)
        ops["dh" + suffix] = fp8.quantize(bf["dh"][:rows], e4m3, cols=True)
    return ops


def sweep_sites(ops: dict[str, Any], tokens: int, jagged: int) -> list[SweepSite]:
    """The six GEMMs of the MLP block's forward and backward, the weight gradients at `tokens` and at `jagged` rows.
    References: bf16 torch.mm of the same product, cuBLAS's block-scaled F.scaled_mm as `fp8._weight_gemm`/
    `fp8._rows_gemm` call it (K a multiple of 128), torch._scaled_mm row-wise (K a multiple of 16)."""
    bf, w1, w2, bf16, f32 = ops["bf16"], ops["w1"], ops["w2"], torch.bfloat16, torch.float32
    dim, hidden = w1["q"].shape[1], w1["q"].shape[0]
    cublas = fp8.Fp8Recipe(gemm="cublas")

    def rowwise(a: torch.Tensor, b: torch.Tensor) -> Callable[[], Any]:
        ones_a = torch.ones(a.shape[0], 1, device=a.device)
        ones_b = torch.ones(1, b.shape[0], device=a.device)
        return lambda: torch._scaled_mm(a, b.T, ones_a, ones_b, out_dtype=bf16)

    def weight_site(name, a, w, wq, out_dtype, bias=None):
        """a (M, K) 1x128-scaled times a weight's 128x128 tiles `wq` (N, K); bf16 peer a_bf16 @ w."""
        aq, a_bf16 = a

        def ours(config):
            return fp8.gemm(aq["q"], aq["s"], wq[0], wq[1], out_dtype, bias=bias, b_tiles=True, config=config)

        m, k = aq["q"].shape
        refs: dict[str, Callable[[], Any]] = {"bf16 torch.mm": lambda: a_bf16 @ w}
        if aq["q"].is_cuda:
            refs["cuBLAS block-scaled F.scaled_mm"] = lambda: fp8._weight_gemm(
                aq["q"], aq["s"], wq[0], wq[1], out_dtype, cublas, bias=bias
            )
            refs["row-wise torch._scaled_mm"] = rowwise(aq["q"], wq[0])
        return SweepSite(name, m, wq[0].shape[0], k, ours, refs)

    def weight_gradient_site(name, a, b, a_bf16, b_bf16):
        """a (M, K) @ b (N, K)^T over the tokens K, both 1x128-scaled along K (`quantize`'s "qt")."""

        def ours(config):
            return fp8.gemm(a["qt"], a["st"], b["qt"], b["st"], f32, config=config)

        m, k = a["qt"].shape
        refs: dict[str, Callable[[], Any]] = {"bf16 torch.mm": lambda: a_bf16.T @ b_bf16}
        if k % fp8.BLOCK == 0 and a["qt"].is_cuda:
            refs["cuBLAS block-scaled F.scaled_mm"] = lambda: fp8._rows_gemm(
                a["qt"], a["st"], b["qt"], b["st"], f32, cublas
            )
        if k % 16 == 0 and a["qt"].is_cuda:
            refs["row-wise torch._scaled_mm"] = rowwise(a["qt"], b["qt"])
        return SweepSite(name, m, b["qt"].shape[0], k, ours, refs)

    w1_tiles, w2_tiles = (w1["q"], w1["s"]), (w2["q"], w2["s"])
    w1t_tiles, w2t_tiles = (w1["qt"], w1["st"]), (w2["qt"], w2["st"])
    x, g, dy, dh = [(ops[n], bf[b]) for n, b in (("x", "x"), ("g", "h"), ("dy", "dy"), ("dh", "dh"))]
    sites = [
        weight_site("fc1_fwd", x, ops["w1_bf16"].T, w1_tiles, bf16, ops["b1"]),
        weight_site("fc2_fwd", g, ops["w2_bf16"].T, w2_tiles, bf16, ops["b2"]),
        weight_site("fc2_dgrad", dy, ops["w2_bf16"], w2t_tiles, bf16),
        weight_site("fc1_dgrad", dh, ops["w1_bf16"], w1t_tiles, f32),
    ]
    for rows, suffix in ((tokens, ""), (jagged, "_j")):
        sites.append(
            weight_gradient_site(
                f"dw2 K={rows}", ops["dy" + suffix], ops["g" + suffix], bf["dy"][:rows], bf["h"][:rows]
            )
        )
        sites.append(
            weight_gradient_site(
                f"dw1 K={rows}", ops["dh" + suffix], ops["x" + suffix], bf["dh"][:rows], bf["x"][:rows]
            )
        )
    assert all(s.k in (dim, hidden, tokens, jagged) for s in sites)
    return sites


# (BLOCK_M, BLOCK_N, warps) per kind of site that compile for sm_90 unspilled at 2-5 stages (the weight gradients'
# masked last K block costs registers: there 64- and 256-wide tiles spill unless loaded by TMA), likeliest first;
# tests/kernels/test_fp8_sm90_compile.py compiles them. A weight's tile scales: at most 128 wide (`fp8._config_fits`)
SWEEP_TILES = {
    "weight": [(128, 128, 8), (64, 128, 4), (128, 64, 4), (64, 64, 4), (128, 64, 8)],
    "rows": [(128, 128, 8), (128, 64, 8), (64, 64, 4)],
}
SWEEP_TMA_TILES = [(128, 128, 8), (64, 128, 4), (128, 64, 4), (64, 256, 8)]  # "rows": by TMA, unspilled


def sweep_configs(kind: str) -> list[dict]:
    """Our kernel's candidate configs (`fp8.GEMM_CONFIG_KEYS`) for a kind of site (`SweepSite.kind`), likeliest
    first (a time budget may cut the tail): the leading tiles of `SWEEP_TILES` at 3 stages; the same tiles loaded by
    TMA (the weight gradients: `SWEEP_TMA_TILES` at 3 and 4 stages); GROUP_SIZE_M 4 and 16 on the first tile; then
    the rest of the tiles at 3, 4, 2 and 5 stages where the stages fit the shared memory. The warp-specialized TMA
    loop (wrong results at 128x64, slower everywhere) and the deferred scaling (slower everywhere) were dropped after
    the sweep of 2026-12-02 09:24 UTC (docs/benchmarks.md)."""

    def fits(bm, bn, stages):
        return stages * (bm + bn) * fp8.BLOCK <= HOPPER_SHARED_MEMORY

    tiles = SWEEP_TILES[kind]
    grid = [
        {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        for stages in (3, 4, 2, 5)
        for bm, bn, warps in tiles
        if fits(bm, bn, stages)
    ]
    lead = grid[: min(3, len(tiles))]
    if kind == "rows":
        tma = [
            {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "TMA": True}
            for stages in (3, 4)
            for bm, bn, warps in SWEEP_TMA_TILES
            if fits(bm, bn, stages)
        ]
    else:
        tma = [{**t, "TMA": True} for t in lead]
    groups = [{**lead[0], "GROUP_SIZE_M": g} for g in (4, 16)]
    return lead + tma + groups + grid[len(lead) :]


def gemm_sweep(
    sites: list[SweepSite], log, *, budget_s: float, timer=None, configs=sweep_configs, progress=None
) -> dict[str, Any]:
    """Time the references at every site, then our kernel at every site and config, one config rank across all sites
    at a time (so a cut by `budget_s`, compile time included, drops every site's least likely configs); each config's
    output is checked against the op's default launch (`err`, relative L2: the accumulation order is the same, so 0
    unless the variant is wrong). Every site's first config runs whatever the budget. `progress(rows)` after each
    rank (a hang in a variant keeps what came before)."""
    timer = timer or (lambda fn: timed(fn, warmup=10, rep=60))
    start = time.monotonic()
    rows: list[dict] = []
    skipped: list[dict] = []

    def record(site: SweepSite, variant: str, config: dict | None, fn, err: float | None, started: float) -> None:
        ms = timer(fn)
        row = {"site": site.name, "m": site.m, "n": site.n, "k": site.k, "variant": variant, "config": config}
        row |= {"ms": ms, "tflops": site.flops / ms / 1e9, "err": err, "s": time.monotonic() - started}
        rows.append(row)
        tiles = " ".join(f"{k}={v}" for k, v in (config or {}).items())
        error = "" if err is None else f" err {err:.1e}"
        log(f"sweep {site.name:20s} {variant:40s} {tiles:62s} {ms:8.3f} ms {row['tflops']:6.0f} TFLOP/s{error}")

    defaults = {}
    for site in sites:
        for name, fn in site.refs.items():
            try:
                record(site, name, None, fn, None, time.monotonic())
            except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
                log(f"sweep {site.name} {name}: failed {exc!r}")
        started = time.monotonic()
        defaults[site.name] = site.ours(None).float()
        record(site, "ours (as the op runs it)", None, lambda site=site: site.ours(None), None, started)
    ranked = {site.name: configs(site.kind) for site in sites}
    for rank in range(max(len(c) for c in ranked.values())):
        for site in sites:
            if rank >= len(ranked[site.name]):
                continue
            config = ranked[site.name][rank]
            if rank and time.monotonic() - start > budget_s:
                skipped.append({"site": site.name, "config": config})
                continue
            started = time.monotonic()
            try:
                err = rel(site.ours(config).float(), defaults[site.name])
                record(site, "ours", config, lambda site=site, config=config: site.ours(config), err, started)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile or run costs only itself
                log(f"sweep {site.name} {config}: failed {str(exc)[:300]!r}")
        if progress is not None:
            progress(rows)
    best = {}
    for site in sites:
        mine = [r for r in rows if r["site"] == site.name and r["variant"] == "ours" and (r["err"] or 0) < 1e-3]
        if mine:
            top = min(mine, key=lambda r: r["ms"])
            best[site.name] = {"config": top["config"], "ms": top["ms"], "tflops": top["tflops"]}
            log(f"sweep best {site.name}: {top['ms']:.3f} ms {top['tflops']:.0f} TFLOP/s {top['config']}")
    if skipped:
        log(f"sweep: {len(skipped)} (site, config) pairs skipped past the {budget_s:.0f} s budget")
    return {"rows": rows, "best": best, "skipped": skipped, "seconds": time.monotonic() - start}


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
    parser.add_argument("--gemm-sweep", action="store_true", help="only our GEMM's configs at the MLP block's GEMMs")
    parser.add_argument("--jagged-tokens", type=int, default=191_237, help="--gemm-sweep: weight gradients' 2nd K")
    parser.add_argument("--sweep-budget", type=float, default=170.0, help="--gemm-sweep: seconds for our configs")
    parser.add_argument("--dim", type=int, default=1024, help="--gemm-sweep: model width (fc1's input)")
    parser.add_argument("--hidden", type=int, default=4096, help="--gemm-sweep: fc1's output width")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BF16_JSON", "FP8_JSON"), help="gpu_bench runs")
    parser.add_argument("--tracking-uri", help="with --compare: log the overlay and ratios to this MLflow store")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        bf16_json, fp8_json = args.compare
        return compare(bf16_json, fp8_json, args.out, args.tracking_uri)
    if not torch.cuda.is_available() and not (args.gemm_sweep and fp8.INTERPRET):
        parser.error("fp8_bench needs a CUDA GPU (Hopper or newer); on the CPU only --gemm-sweep, interpreted")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log_path = args.out / "fp8_bench.log"
    log_path.write_text("")

    def log(text: str) -> None:
        print(text, flush=True)
        with log_path.open("a") as f:
            f.write(text + "\n")

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)"
    log(f"device {name} torch {torch.__version__}")
    result: dict[str, Any] = {}
    if args.gemm_sweep:
        ops = sweep_operands(args.tokens, args.jagged_tokens, args.dim, args.hidden, device)
        sites = sweep_sites(ops, args.tokens, args.jagged_tokens)
        timer = None if device.type == "cuda" else wall_time  # the interpreter: the plumbing, not kernel speed
        result = {"device": name, "tokens": args.tokens, "jagged_tokens": args.jagged_tokens}
        path = args.out / "gemm_sweep.json"

        def progress(rows: list[dict]) -> None:
            path.write_text(json.dumps({**result, "rows": rows, "partial": True}, indent=2))

        result |= gemm_sweep(sites, log, budget_s=args.sweep_budget, timer=timer, progress=progress)
        path.write_text(json.dumps(result, indent=2))
        return result
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
