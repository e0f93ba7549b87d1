"""FP8 quantization and ops through the torch reference (the CPU emulation): round trips, scale shapes, zeros,
outliers, non-finite input, counters, delayed scales, and the emulated ops' gradients against fp32."""

import pytest
import torch
import torch.nn.functional as F
from gemrec.kernels import fp8


def test_round_to_format_hits_the_grid_and_saturates():
    # e4m3: 3 mantissa bits -> 1.0, 1.125, ...; 448 is the largest; below 2^-6 steps of 2^-9
    x = torch.tensor([1.0, 1.06, 1.07, 447.0, 1000.0, -1000.0, 2.0**-9, 2.0**-11, 0.0])
    got = fp8.round_to_format(x, fp8.E4M3)
    assert got.tolist() == [1.0, 1.0, 1.125, 448.0, 448.0, -448.0, 2.0**-9, 0.0, 0.0]
    assert fp8.round_to_format(torch.tensor([57344.0, 1e9, 1.2]), fp8.E5M2).tolist() == [57344.0, 57344.0, 1.25]


@pytest.mark.parametrize("block", [(1, 128), (128, 1), (128, 128)])
@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=lambda f: f.name)
def test_round_trip_error_and_scale_shapes(block, fmt):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 200, generator=gen) * torch.logspace(-4, 4, 200)  # columns spanning 8 decades
    q, s = fp8.quantize_reference(x, fmt, block)
    assert q.shape == x.shape
    assert s.shape == (-(-300 // block[0]), -(-200 // block[1]))
    assert float(q.abs().max()) <= fmt.max
    back = fp8.dequantize_reference(q, s, block)
    # each element: within half a step of its block's grid (relative 2^-(mantissa+1) of the value, or of the
    # smallest normal of the block's scale for tiny values)
    tiny = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:300, :200] * 2.0**fmt.min_exp
    assert bool(((back - x).abs() <= x.abs() * 2.0 ** -(fmt.mantissa + 1) + tiny).all())
    # the block's largest value lands on the format's max
    amax_q = q.abs().reshape(-1).max()
    assert float(amax_q) == fmt.max


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=lambda f: f.name)
def test_block_scale_is_the_correctly_rounded_quotient(fmt):
    # the kernels divide with IEEE rounding (tl.div_rn); amax times the rounded reciprocal (what torch on CUDA does
    # for `tensor / python_number`) is one ulp off for about half of these, and the fp8 values then differ
    amax = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 100
    exact = (amax.double() / fmt.max).float()  # double rounding is harmless for a quotient of fp32 numbers
    assert (amax * (1 / fmt.max) != exact).float().mean() > 0.2
    assert torch.equal(fp8.block_scale(amax, fmt), exact)
    assert torch.equal(fp8.block_scale(torch.zeros(3), fmt), torch.ones(3))


def test_zero_blocks_get_unit_scale_and_zero_values():
    x = torch.zeros(4, 256)
    x[0, :128] = 3.0
    q, s = fp8.quantize_reference(x, fp8.E4M3, (1, 128))
    assert s[0].tolist() == pytest.approx([3.0 / 448.0, 1.0]) and s[1:].eq(1.0).all()
    assert q[0, :128].eq(448.0).all() and q[0, 128:].eq(0).all() and q[1:].eq(0).all()


def test_an_outlier_stays_in_its_block():
    x = torch.randn(256, 256)
    x[5, 7] = 1e4
    _, s_rows = fp8.quantize_reference(x, fp8.E4M3, (1, 128))
    _, s_tiles = fp8.quantize_reference(x, fp8.E4M3, (128, 128))
    assert float(s_rows[5, 0]) == pytest.approx(1e4 / 448) and float(s_rows[6, 0]) < 1.0
    assert float(s_tiles[0, 0]) == pytest.approx(1e4 / 448) and float(s_tiles[1, 1]) < 1.0


def test_non_finite_input_is_a_clear_error_or_counted():
    x = torch.randn(8, 128)
    x[2, 3] = float("nan")
    x[4, 5] = float("inf")
    with pytest.raises(ValueError, match="2 non-finite value"):
        fp8.quantize(x, fp8.E4M3, backend="reference", check_finite=True)
    stats = fp8.Fp8Stats(("x",), 0, x.device, collect=True)
    out = fp8.quantize(x, fp8.E4M3, backend="reference", stats=stats)
    assert int(stats.counts[0, 3]) == 2
    assert not torch.isfinite(out["s"][2]).all()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown fp8 format"):
        fp8.fp8_format("e3m4")
    with pytest.raises(ValueError, match="2-D or 3-D"):
        fp8.quantize(torch.randn(4), fp8.E4M3, backend="reference")
    with pytest.raises(ValueError, match="nothing to produce"):
        fp8.quantize(torch.randn(4, 4), fp8.E4M3, rows=False, backend="reference")
    with pytest.raises(ValueError, match="act 'swiglu'"):
        fp8.quantize(torch.randn(4, 4), fp8.E4M3, act="swiglu", backend="reference")
    with pytest.raises(ValueError, match="backend"):
        fp8.Fp8Recipe(backend="cuda")


def test_delayed_scale_saturates_and_counts_overflow():
    stats = fp8.Fp8Stats(("x",), 4, torch.device("cpu"), collect=True)
    first = torch.ones(2, 128)
    fp8.quantize(first, fp8.E4M3, stats=stats, backend="reference")  # no history yet: dynamic
    assert int(stats.counts[0, 0]) == 0 and float(stats.amax[0]) == 1.0
    stats.step()
    assert float(stats.scale(0, fp8.E4M3)) == pytest.approx(1 / 448)
    stats.reset_counts()
    x = torch.ones(2, 128)
    x[0, 0] = 4.0  # 4x the history's amax: saturates at 448 * scale = 1.0
    out = fp8.quantize(x, fp8.E4M3, stats=stats, backend="reference")
    assert int(stats.counts[0, 0]) == 1 and float(out["q"][0, 0]) == 448.0
    stats.step()
    assert float(stats.scale(0, fp8.E4M3)) == pytest.approx(4 / 448)


def test_underflow_counts_values_flushed_to_zero():
    stats = fp8.Fp8Stats(("x",), 0, torch.device("cpu"), collect=True)
    x = torch.full((1, 128), 1e-9)
    x[0, 0] = 1.0
    fp8.quantize(x, fp8.E4M3, stats=stats, backend="reference")
    overflow, underflow, nonzero, nonfinite = stats.counts[0].tolist()
    assert (overflow, underflow, nonzero, nonfinite) == (0, 127, 128, 0)


def test_group_layout_pads_each_expert_to_whole_tiles():
    counts = torch.tensor([3, 0, 130, 1])
    dest, tile_group, k_bounds, capacity = fp8.group_layout(counts, 134)
    assert k_bounds.tolist() == [0, 128, 128, 384, 512]
    assert dest[:3].tolist() == [0, 1, 2] and dest[3:5].tolist() == [128, 129] and dest[-1].item() == 384
    assert capacity >= 512 and capacity % 128 == 0
    assert tile_group.tolist()[:4] == [0, 2, 2, 3] and all(g == -1 for g in tile_group.tolist()[4:])


def _mlp_case(seed=0, tokens=70, dim=64, hidden=160):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen, requires_grad=True)
    params = [
        (torch.randn(hidden, dim, generator=gen) * dim**-0.5).requires_grad_(),
        (torch.randn(hidden, generator=gen) * 0.1).requires_grad_(),
        (torch.randn(dim, hidden, generator=gen) * hidden**-0.5).requires_grad_(),
        (torch.randn(dim, generator=gen) * 0.1).requires_grad_(),
    ]
    return x, params, torch.randn(tokens, dim, generator=gen)


@pytest.mark.parametrize("grad", ["e4m3", "e5m2"])
def test_emulated_mlp_matches_fp32_within_fp8_error(grad):
    x, (w1, b1, w2, b2), dy = _mlp_case()
    stats = fp8.Fp8Stats(fp8.MLP_ROLES, 0, x.device)
    y = fp8.fp8_mlp(x, w1, b1, w2, b2, fp8.Fp8Recipe(fp8.fp8_format(grad), "reference"), stats)
    got = torch.autograd.grad(y, [x, w1, b1, w2, b2], dy)
    ref_y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    ref = torch.autograd.grad(ref_y, [x, w1, b1, w2, b2], dy)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    # e4m3 rounds to 2^-4 relative (rms ~2-3% per operand); e5m2 gradients to 2^-3
    assert rel(y, ref_y) < 0.06
    bound = 0.08 if grad == "e4m3" else 0.15
    for a, b in zip(got, ref):
        assert a.shape == b.shape and rel(a, b) < bound
    assert torch.equal(got[4], ref[4])  # the output bias gradient is the plain sum of dy


def test_emulated_grouped_swiglu_matches_fp32():
    gen = torch.Generator().manual_seed(1)
    experts, dim, hidden = 3, 64, 96
    counts = torch.tensor([20, 0, 31])
    x = torch.randn(51, dim, generator=gen, requires_grad=True)
    w1, w3 = ((torch.randn(experts, dim, hidden, generator=gen) * dim**-0.5).requires_grad_() for _ in range(2))
    w2 = (torch.randn(experts, hidden, dim, generator=gen) * hidden**-0.5).requires_grad_()
    dy = torch.randn(51, dim, generator=gen)
    stats = fp8.Fp8Stats(fp8.EXPERT_ROLES, 0, x.device)
    y = fp8.fp8_grouped_swiglu(x, counts, w1, w3, w2, fp8.Fp8Recipe(backend="reference"), stats)
    got = torch.autograd.grad(y, [x, w1, w3, w2], dy)
    ref_y = torch.cat(
        [(F.silu(xe @ w1[e]) * (xe @ w3[e])) @ w2[e] for e, xe in enumerate(torch.split(x, counts.tolist()))]
    )
    ref = torch.autograd.grad(ref_y, [x, w1, w3, w2], dy)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(y, ref_y) < 0.08
    for a, b in zip(got, ref):
        assert rel(a, b) < 0.1
    assert got[1][1].eq(0).all() and got[3][1].eq(0).all()  # expert 1 saw no token


def test_autotuned_gemm_configs_fit_each_launch():
    """The autotuner's candidates per launch: expert groups (GROUP_M) only the 128x128 tile without TMA; a weight's
    tile scales (TILE_B) at most 128-wide tiles; TMA only where the launcher found both operands K-contiguous with
    16-byte aligned rows (TUNE_TMA, part of the key: a choice cached for one launch never reaches the other)."""
    configs = [fp8._triton_config(c) for c in fp8.GEMM_TUNED]

    def kept(tma: int, **launch) -> list[int]:
        return [configs.index(c) for c in fp8._prune_gemm_configs(configs, {"TUNE_TMA": tma}, **launch)]

    grouped_m = [i for i, c in enumerate(fp8.GEMM_TUNED) if c["BLOCK_M"] == 128 and not c.get("TMA")]
    assert kept(1, GROUP_M=True, TILE_B=True) == kept(0, GROUP_M=True, TILE_B=True) == grouped_m and grouped_m
    weight = [i for i, c in enumerate(fp8.GEMM_TUNED) if c["BLOCK_N"] <= 128]
    assert kept(1, GROUP_M=False, TILE_B=True) == weight and len(weight) < len(configs)
    assert kept(1, GROUP_M=False, TILE_B=False) == list(range(len(configs)))
    no_tma = [i for i, c in enumerate(fp8.GEMM_TUNED) if not c.get("TMA")]
    assert kept(0, GROUP_M=False, TILE_B=False) == kept(0, GROUP_M=False, TILE_B=True) == no_tma and no_tma
    assert "TUNE_TMA" in fp8._gemm_kernel.keys


def test_gemm_autotune_key_ignores_the_token_count():
    """A batch's token count (the rows of fc1, fc2 and their dgrads; the weight gradients' reduction depth) does not
    re-tune the GEMM: M is not in the autotuner's key and K is bucketed to a power of two. Launches recorded on CPU
    tensors laid out as on the GPU (`quantize`'s column-major scales and 16-byte aligned "qt" rows)."""
    tuner = fp8._gemm_kernel
    keys = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **consts):
                named = {**dict(zip(tuner.arg_names, args)), **consts}
                dtypes = [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
                keys.append(tuple(named[k] for k in tuner.keys) + tuple(dtypes))

            return launch

    f8 = torch.float8_e4m3fn
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8, "_gemm_kernel", Recorder())
        for tokens in (191_237, 196_608):
            a, sa = torch.empty(tokens, 1024, dtype=f8), torch.empty(8, tokens).mT
            w, sw = torch.empty(4096, 1024, dtype=f8), torch.empty(32, 8)
            fp8.gemm(a, sa, w, sw, torch.bfloat16, bias=torch.empty(4096), b_tiles=True)
            dy, g = (fp8.aligned_rows((n, tokens), "cpu", f8) for n in (1024, 4096))
            sdy, sg = (torch.empty(-(-tokens // 128), n).mT for n in (1024, 4096))
            fp8.gemm(dy, sdy, g, sg, torch.float32)
    fc1, dw2, fc1_again, dw2_again = keys
    assert fc1 == fc1_again and dw2 == dw2_again and fc1 != dw2
    assert dw2[tuner.keys.index("TUNE_TMA")] == 1  # aligned "qt" rows: the TMA configs are candidates
