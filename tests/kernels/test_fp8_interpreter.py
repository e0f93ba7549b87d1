"""The FP8 Triton kernels under the CPU interpreter (TRITON_INTERPRET=1, fp32 carriers on the fp8 grid) against the
torch reference: quantization in every mode (bit-exact), the block-scaled GEMM (plain, grouped by M tile, grouped by
K range), and both ops forward and backward. Run in a subprocess by test_attention_interpreter_subprocess.py when this
process imported triton without the interpreter."""

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


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", ["gelu", "gelu_bwd"])
def test_gemm_quantize_epilogue_is_the_unfused_path_bit_for_bit(act, out_dtype):
    """The GEMM's quantizing epilogue (fc1: gelu of h as stored; fc2's dgrad: times gelu'(h), with the bias gradient)
    against gemm then quantize, at a jagged row count: the last row tile masked, qt's padding rows zero; delayed
    scales and counters too."""
    gen = torch.Generator().manual_seed(5)
    a = fp8.quantize(torch.randn(300, 256, generator=gen), fp8.E4M3, backend="reference")
    w = fp8.quantize(torch.randn(384, 256, generator=gen) / 8, fp8.E4M3, tile=True, backend="reference")
    bias = torch.randn(384, generator=gen) if act == "gelu" else None
    gate = torch.randn(300, 384, generator=gen).to(out_dtype) if act == "gelu_bwd" else None
    kwargs = {"act": act, "gate": gate, "colsum": act == "gelu_bwd"}
    runs = []
    for fused in (True, False):
        stats = fp8.Fp8Stats(("act",), 2, a["q"].device, collect=True)
        stats.history[0, 0] = 1.5  # a delayed scale that saturates some values
        if fused:
            q = fp8.gemm_quantize(
                a["q"], a["s"], w["q"], w["s"], out_dtype, fp8.E4M3, bias=bias, b_tiles=True, stats=stats, **kwargs
            )
        else:
            c = fp8.gemm(a["q"], a["s"], w["q"], w["s"], out_dtype, bias=bias, b_tiles=True)
            q = fp8.quantize(c, fp8.E4M3, cols=True, stats=stats, **kwargs)
            if act == "gelu":
                q["c"] = c
        runs.append((q, stats))
    (q, stats), (q_ref, stats_ref) = runs
    assert q.keys() == q_ref.keys() == {"q", "s", "qt", "st", "c" if act == "gelu" else "colsum"}
    for key in q:
        if key == "colsum":  # fp32 sums of the tiles' column sums, added in another order
            assert torch.allclose(q[key], q_ref[key], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(q[key], q_ref[key]), key
    padded = q["qt"].as_strided((384, q["qt"].stride(0)), q["qt"].stride())
    assert padded.shape[1] == 304 and padded[:, 300:].eq(0).all()
    assert torch.equal(stats.counts, stats_ref.counts) and int(stats.counts[0, 0]) > 0
    assert torch.equal(stats.amax, stats_ref.amax)


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
    "fc1_fwd+gelu": (256, 256, 128),
    "fc1_fwd": (256, 256, 128),
    "fc2_fwd": (256, 128, 256),
    "fc2_dgrad+gelu_bwd": (256, 256, 128),
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
    """Every structural variant (64-row and 64/256-wide tiles, DEFER, TMA, warp-specialized TMA) at every site,
    the quantizing epilogues included, gives the op's own result bit for bit; the best config is the fastest."""
    from gemrec.components.trainer import fp8_bench

    sites = fp8_bench.sweep_sites(fp8_bench.sweep_operands(256, 197, 128, 256, "cpu"), 256, 197)
    lead = {"weight": 11, "rows": 8, "epilogue": 2}  # the leading tiles and their variants
    configs = {kind: fp8_bench.sweep_configs(kind)[:count] for kind, count in lead.items()}
    assert {k for c in configs["weight"] for k in c} >= {"BLOCK_M", "DEFER", "TMA", "WS"}
    assert any(c.get("TMA") for c in configs["rows"]) and any(c.get("TMA") for c in configs["epilogue"])
    clock = iter(range(10_000, 0, -1))  # every call "faster" than the one before

    def timer(fn):
        fn()
        return float(next(clock))

    result = fp8_bench.gemm_sweep(sites, print, budget_s=1e9, timer=timer, configs=configs.__getitem__)
    assert not result["skipped"]
    for site in sites:
        ours = [r for r in result["rows"] if r["site"] == site.name and r["variant"] == "ours"]
        assert [r["config"] for r in ours] == configs[site.kind]
        assert all(r["err"] == 0.0 for r in ours), [(r["config"], r["err"]) for r in ours]
        assert result["best"][site.name]["config"] == configs[site.kind][-1]
        assert result["best"][site.name]["tflops"] == pytest.approx(site.flops / ours[-1]["ms"] / 1e9)


def test_gemm_config_is_checked_against_the_launch():
    a, sa = torch.zeros(128, 128), torch.ones(128, 1)
    cases = [
        ({"BLOCK_Q": 64}, {}),
        ({"TMA": True, "DEFER": True}, {}),
        ({"WS": True}, {}),
        ({"BLOCK_N": 64}, {"act": "gelu"}),
    ]
    for config, epilogue in cases:
        with pytest.raises(ValueError, match="gemm config"):
            if epilogue:
                fp8.gemm_quantize(a, sa, a, sa, torch.float32, fp8.E4M3, config=config, **epilogue)
            else:
                fp8.gemm(a, sa, a, sa, torch.float32, config=config)
