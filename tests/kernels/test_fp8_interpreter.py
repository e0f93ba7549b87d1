"""The FP8 Triton kernels under the CPU interpreter (TRITON_INTERPRET=1, fp32 carriers on the fp8 grid) against the
torch reference: quantization in every mode (bit-exact), the block-scaled GEMM (plain, grouped by M tile, grouped by
K range; every autotuner candidate bit for bit), and both ops forward and backward. Run in a subprocess by
test_attention_interpreter_subprocess.py when this process imported triton without the interpreter."""

import pytest
import torch
from gemrec.kernels import fp8
from gemrec.kernels import triton_attention as kernels_module

pytestmark = pytest.mark.skipif(
    not kernels_module.INTERPRET, reason="triton was imported without TRITON_INTERPRET=1 (run in a subprocess)"
)


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize(
    "mode",
    [{"rows": True}, {"rows": False, "cols": True}, {"cols": True}, {"tile": True}, {"tile": True, "cols": True}],
    ids=["rows", "cols", "rows_cols", "tile", "tile_cols"],
)
def test_quantize_matches_reference(fmt, mode):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(150, 260, generator=gen) * torch.logspace(-5, 5, 260)
    x[3, :] = 0.0
    stats = {b: fp8.Fp8Stats(("x",), 2, x.device, collect=True) for b in fp8.BACKENDS}
    got = {b: fp8.quantize(x, fmt, **mode, stats=stats[b], backend=b) for b in fp8.BACKENDS}
    assert got["triton"].keys() == got["reference"].keys()
    for key in got["triton"]:
        assert torch.equal(got["triton"][key], got["reference"][key]), key
    assert torch.equal(stats["triton"].counts, stats["reference"].counts)
    assert torch.equal(stats["triton"].amax, stats["reference"].amax)


@pytest.mark.parametrize("act", ["gelu", "swiglu", "gelu_bwd", "swiglu_bwd"])
def test_quantize_fused_activation_colsum_and_3d_batches(act):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 130, 70, generator=gen) * 3
    gate = None
    if act != "gelu":
        gate = torch.randn(2, 130, 140 if act == "swiglu_bwd" else 70, generator=gen)
    for mode in ({"cols": True}, {"tile": True, "cols": True}):
        t = fp8.quantize(x, fp8.E4M3, act=act, gate=gate, colsum=True, **mode)
        r = fp8.quantize(x, fp8.E4M3, act=act, gate=gate, colsum=True, **mode, backend="reference")
        assert t.keys() == r.keys() and t["q"].shape[-1] == (140 if act == "swiglu_bwd" else 70)
        for key in t:  # erf/sigmoid differ from torch's in the last bits: a few values may round the other way
            diff = (t[key] - r[key]).abs()
            if key in ("s", "st", "colsum"):
                assert torch.allclose(t[key], r[key], rtol=1e-4, atol=1e-5), key  # erf near -1: cancellation
            else:
                assert float(diff.max()) <= 32 and float((diff > 0).float().mean()) < 0.01


def test_delayed_scale_in_kernel_matches_reference():
    x = torch.randn(130, 128) * 5
    runs = {}
    for b in fp8.BACKENDS:
        stats = fp8.Fp8Stats(("x",), 3, x.device, collect=True)
        fp8.quantize(x * 0.5, fp8.E4M3, stats=stats, backend=b)
        stats.step()
        runs[b] = (fp8.quantize(x, fp8.E4M3, cols=True, stats=stats, backend=b), stats.counts.clone())
    for key in runs["triton"][0]:
        assert torch.equal(runs["triton"][0][key], runs["reference"][0][key])
    assert torch.equal(runs["triton"][1], runs["reference"][1]) and int(runs["triton"][1][0, 0]) > 0


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("k", [300, 256])  # a K tail, and whole 128-blocks (no K masks)
def test_gemm_plain_grouped_m_and_grouped_k(k):
    gen = torch.Generator().manual_seed(2)
    a = fp8.quantize(torch.randn(200, k, generator=gen), fp8.E4M3, backend="reference")
    b = fp8.quantize(torch.randn(140, k, generator=gen), fp8.E5M2, tile=True, backend="reference")
    sb = b["s"].repeat_interleave(128, 0)[:140]
    bias = torch.randn(140, generator=gen)
    t, r = (fp8.gemm(a["q"], a["s"], b["q"], sb, torch.float32, bias=bias, backend=be) for be in fp8.BACKENDS)
    assert _rel(t, r) < 1e-6
    # b's tile scales read as they are (one per output tile and K block), against the per-row form
    tiles = fp8.gemm(a["q"], a["s"], b["q"], b["s"], torch.float32, bias=bias, b_tiles=True)
    assert _rel(tiles, r) < 1e-6
    # grouped by M tile: 3 tiles of 128 rows, the last past every group
    a = fp8.quantize(torch.randn(384, 96, generator=gen), fp8.E4M3, backend="reference")
    w = fp8.quantize(torch.randn(2, 80, 96, generator=gen), fp8.E4M3, tile=True, backend="reference")
    tile_group = torch.tensor([1, 0, -1], dtype=torch.int32)
    t, r = (
        fp8.gemm(a["q"], a["s"], w["q"], w["s"], torch.float32, tile_group=tile_group, b_tiles=True, backend=be)
        for be in fp8.BACKENDS
    )
    assert _rel(t, r) < 1e-6 and t[256:].eq(0).all()
    # grouped by K range: two groups of rows
    x = fp8.quantize(torch.randn(384, 70, generator=gen), fp8.E4M3, cols=True, rows=False, backend="reference")
    g = fp8.quantize(torch.randn(384, 50, generator=gen), fp8.E4M3, cols=True, rows=False, backend="reference")
    bounds = torch.tensor([0, 128, 128, 384], dtype=torch.int32)
    t, r = (
        fp8.gemm(x["qt"], x["st"], g["qt"], g["st"], torch.float32, k_bounds=bounds, backend=be) for be in fp8.BACKENDS
    )
    assert t.shape == (3, 70, 50) and _rel(t, r) < 1e-6 and t[1].eq(0).all()


def _tuned_launches() -> dict:
    """name -> (gemm's positional args, its keywords, `fp8._config_fits`' launch): a weight's tile scales with a bias
    at a jagged row count, K whole 128-blocks and K ragged (16-byte aligned rows: TMA's zero-filled tail); a weight
    gradient over a jagged token count ("qt" operands as `quantize` lays them out); expert groups by M tile and by K
    range."""
    gen = torch.Generator().manual_seed(6)
    e4m3, out = fp8.E4M3, {}
    for k in (256, 320):
        a = fp8.quantize(torch.randn(200, k, generator=gen), e4m3, backend="reference")
        w = fp8.quantize(torch.randn(384, k, generator=gen), e4m3, tile=True, backend="reference")
        kw = {"bias": torch.randn(384, generator=gen), "b_tiles": True}
        out[f"weight K={k}"] = ((a["q"], a["s"], w["q"], w["s"], torch.float32), kw, (False, True))
    x, g = (fp8.quantize(torch.randn(197, n, generator=gen), e4m3, rows=False, cols=True) for n in (128, 256))
    out["weight gradient K=197"] = ((x["qt"], x["st"], g["qt"], g["st"], torch.float32), {}, (False, False))
    a = fp8.quantize(torch.randn(384, 96, generator=gen), e4m3, backend="reference")
    w = fp8.quantize(torch.randn(2, 80, 96, generator=gen), e4m3, tile=True, backend="reference")
    kw = {"tile_group": torch.tensor([1, 0, -1], dtype=torch.int32), "b_tiles": True}
    out["experts by M tile"] = ((a["q"], a["s"], w["q"], w["s"], torch.float32), kw, (True, True))
    x, g = (fp8.quantize(torch.randn(384, n, generator=gen), e4m3, rows=False, cols=True) for n in (70, 256))
    kw = {"k_bounds": torch.tensor([0, 128, 128, 384], dtype=torch.int32)}
    out["experts by K range"] = ((x["qt"], x["st"], g["qt"], g["st"], torch.float32), kw, (False, False))
    return out


TUNED_FITS = {  # launch -> how many of `fp8.GEMM_TUNED` it may take
    "weight K=256": 4,
    "weight K=320": 4,
    "weight gradient K=197": 5,
    "experts by M tile": 1,
    "experts by K range": 5,
}


def test_every_tuned_gemm_config_is_the_default_launch():
    """Each autotuner candidate (`fp8.GEMM_TUNED`, as `fp8._config_fits` prunes them) at each kind of launch gives the
    interpreter's own launch (128x128 tiles) to fp32 rounding: whichever the autotuner picks on the GPU, the same
    values. (Not bit for bit here: the interpreter's numpy matmul may sum a tile's dot products in an order that
    depends on the tile's shape, ~5e-9 apart on an AMD EPYC host.)"""
    assert len(fp8.GEMM_TUNED) == 5
    for name, (args, kw, (grouped_m, tile_b)) in _tuned_launches().items():
        default = fp8.gemm(*args, **kw)
        tma_ok = fp8._tma_ok(args[0], args[2])
        fits = [c for c in fp8.GEMM_TUNED if fp8._config_fits(c, grouped_m=grouped_m, tile_b=tile_b, tma_ok=tma_ok)]
        assert len(fits) == TUNED_FITS[name], name
        for config in fits:
            assert _rel(fp8.gemm(*args, **kw, config=config), default) < 1e-7, (name, config)


def test_mlp_op_forward_and_backward_match_reference():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 32, generator=gen, requires_grad=True)
    params = [
        (torch.randn(72, 32, generator=gen) * 0.2).requires_grad_(),
        torch.randn(72, generator=gen).mul(0.1).requires_grad_(),
        (torch.randn(32, 72, generator=gen) * 0.1).requires_grad_(),
        torch.randn(32, generator=gen).mul(0.1).requires_grad_(),
    ]
    dy = torch.randn(40, 32, generator=gen)
    results = {}
    for be in fp8.BACKENDS:
        stats = fp8.Fp8Stats(fp8.MLP_ROLES, 0, x.device, collect=True)
        y = fp8.fp8_mlp(x, *params, fp8.Fp8Recipe(fp8.E5M2, be), stats)
        results[be] = (y, torch.autograd.grad(y, [x, *params], dy), stats.counts)
    (yt, gt, ct), (yr, gr, cr) = results["triton"], results["reference"]
    assert _rel(yt, yr) < 1e-5
    for a, b in zip(gt, gr):
        assert _rel(a, b) < 1e-3  # gelu's erf in the kernel vs torch's can move a value by one fp8 step
    assert (ct[:, 2] == cr[:, 2]).all()


def test_grouped_swiglu_op_matches_reference():
    gen = torch.Generator().manual_seed(4)
    counts = torch.tensor([9, 0, 14])
    x = torch.randn(23, 32, generator=gen, requires_grad=True)
    w1, w3 = ((torch.randn(3, 32, 48, generator=gen) * 0.2).requires_grad_() for _ in range(2))
    w2 = (torch.randn(3, 48, 32, generator=gen) * 0.2).requires_grad_()
    dy = torch.randn(23, 32, generator=gen)
    results = {}
    for be in fp8.BACKENDS:
        stats = fp8.Fp8Stats(fp8.EXPERT_ROLES, 0, x.device)
        y = fp8.fp8_grouped_swiglu(x, counts, w1, w3, w2, fp8.Fp8Recipe(fp8.E4M3, be), stats)
        results[be] = (y, torch.autograd.grad(y, [x, w1, w3, w2], dy))
    (yt, gt), (yr, gr) = results["triton"], results["reference"]
    assert _rel(yt, yr) < 1e-5
    for a, b in zip(gt, gr):
        assert _rel(a, b) < 1e-3


SWEEP_SHAPES = {  # site -> (M, N, K) at 256 tokens (197 for the jagged weight gradients), width 128, hidden 256
    "fc1_fwd": (256, 256, 128),
    "fc2_fwd": (256, 128, 256),
    "fc2_dgrad": (256, 256, 128),
    "fc1_dgrad": (256, 128, 256),
    "dw2 K=256": (128, 256, 256),
    "dw1 K=256": (256, 128, 256),
    "dw2 K=197": (128, 256, 197),
    "dw1 K=197": (256, 128, 197),
}
SWEEP_ARGS = ["--tokens", "256", "--jagged-tokens", "197", "--dim", "128", "--hidden", "256"]


def test_gemm_sweep_cli_writes_every_site_and_its_first_config(tmp_path):
    """`fp8_bench --gemm-sweep` with no time budget: the references, the op's own launch and each site's first
    config, timed by the host clock, in the JSON it writes; every other config listed as skipped."""
    import json

    from gemrec.components.trainer import fp8_bench

    result = fp8_bench.run(["--gemm-sweep", "--out", str(tmp_path), "--sweep-budget", "0", *SWEEP_ARGS])
    saved = json.loads((tmp_path / "gemm_sweep.json").read_text())
    assert saved == json.loads(json.dumps(result)) and saved["tokens"] == 256 and saved["jagged_tokens"] == 197
    sites = {s.name: s for s in fp8_bench.sweep_sites(fp8_bench.sweep_operands(256, 197, 128, 256, "cpu"), 256, 197)}
    assert {name: (s.m, s.n, s.k) for name, s in sites.items()} == SWEEP_SHAPES
    for name, (m, n, k) in SWEEP_SHAPES.items():
        rows = [r for r in saved["rows"] if r["site"] == name]
        assert [r["variant"] for r in rows] == ["bf16 torch.mm", "ours (as the op runs it)", "ours"]  # CPU: no cuBLAS
        for r in rows:
            assert (r["m"], r["n"], r["k"]) == (m, n, k) and r["ms"] > 0
            assert r["tflops"] == pytest.approx(2 * m * n * k / r["ms"] / 1e9)
        first = fp8_bench.sweep_configs(sites[name].kind)[0]
        assert rows[-1]["config"] == first and rows[-1]["err"] == 0.0
        assert saved["best"][name] == {"config": first, "ms": rows[-1]["ms"], "tflops": rows[-1]["tflops"]}
    expected_skips = sum(len(fp8_bench.sweep_configs(s.kind)) - 1 for s in sites.values())
    assert len(saved["skipped"]) == expected_skips


def test_gemm_sweep_variants_match_the_default_launch_and_the_fastest_wins():
    """Every structural variant of the sweep's lead (64-row and 64-wide tiles, TMA; the weight gradients: 256-wide
    tiles by TMA) at every site gives the op's own result bit for bit; the best config is the fastest."""
    from gemrec.components.trainer import fp8_bench

    sites = fp8_bench.sweep_sites(fp8_bench.sweep_operands(256, 197, 128, 256, "cpu"), 256, 197)
    lead = {"weight": 6, "rows": 7}  # the leading tiles and their TMA forms
    configs = {kind: fp8_bench.sweep_configs(kind)[:count] for kind, count in lead.items()}
    assert {k for c in configs["weight"] for k in c} >= {"BLOCK_M", "TMA"}
    assert any(c.get("TMA") and c["BLOCK_N"] == 256 for c in configs["rows"])
    clock = iter(range(10_000, 0, -1))  # every call "faster" than the one before

    def timer(fn):
        fn()
        return float(next(clock))

    result = fp8_bench.gemm_sweep(sites, print, budget_s=1e9, timer=timer, configs=configs.__getitem__)
    assert not result["skipped"]
    for site in sites:
        ours = [r for r in result["rows"] if r["site"] == site.name and r["variant"] == "ours"]
        assert [r["config"] for r in ours] == configs[site.kind]
        assert all(r["err"] < 1e-7 for r in ours), [(r["config"], r["err"]) for r in ours]  # fp32 rounding
        assert result["best"][site.name]["config"] == configs[site.kind][-1]
        assert result["best"][site.name]["tflops"] == pytest.approx(site.flops / ours[-1]["ms"] / 1e9)


def test_gemm_config_is_checked_against_the_launch():
    a, sa = torch.zeros(128, 128), torch.ones(128, 1)
    unaligned, su = torch.zeros(128, 120), torch.ones(128, 1)
    groups = {"tile_group": torch.zeros(1, dtype=torch.int32), "b_tiles": True}
    cases = [
        ({"BLOCK_Q": 64}, (a, sa), {}),
        ({"WS": True, "TMA": True}, (a, sa), {}),  # the warp-specialized loop is gone
        ({"BLOCK_N": 256}, (a, sa), {"b_tiles": True}),
        ({"TMA": True}, (unaligned, su), {}),
        ({"BLOCK_M": 64}, (a, sa), groups),
        ({"TMA": True}, (a, sa), groups),
    ]
    for config, (x, sx), kw in cases:
        with pytest.raises(ValueError, match="gemm config"):
            fp8.gemm(x, sx, x, sx if not kw.get("b_tiles") else torch.ones(1, 1), torch.float32, config=config, **kw)
