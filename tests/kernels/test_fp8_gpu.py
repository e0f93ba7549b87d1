"""FP8 kernels on the GPU (real float8 operands, wgmma) against the torch reference and fp32."""

import pytest
import torch
import torch.nn.functional as F
from gemrec.kernels import fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU"
    ),
]


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("mode", [{"cols": True}, {"tile": True, "cols": True}], ids=["rows_cols", "tile"])
@pytest.mark.parametrize(
    "shape,dtype", [((1000, 777), torch.bfloat16), ((512, 256), torch.float32)], ids=["ragged", "aligned"]
)
def test_quantize_matches_reference(fmt, mode, shape, dtype):
    # aligned: vectorized stores (the weights' shapes), where the tiles' transposed copy once had corrupt bytes
    x = torch.randn(*shape, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda")
    x = x.to(dtype)
    t = fp8.quantize(x, fmt, **mode)
    r = fp8.quantize(x, fmt, **mode, backend="reference")
    assert t["q"].dtype == fmt.dtype
    for key in t:
        assert torch.equal(t[key].float(), r[key].float()), key


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=lambda f: f.name)
def test_quantize_divides_exactly_at_rounding_midpoints(fmt):
    """Values whose quotients by their block's scale are midpoints between two fp8 values (ties) or one fp32 ulp off
    one: a division off by an ulp rounds some of them the other way (the kernel divides by div.rn's fast path with a
    reciprocal per block, `fp8._divide`). One 128-row group per scale; 2^-70 and 2^70 take the tile's fallback."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8, device="cuda").view(fmt.dtype).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    groups = []
    for exponent in (-70, -40, -20, -8, 0, 8, 20, 70):
        # a 20-bit mantissa: fmt.max * s0 (the block's amax) is exact, so the scale is s0 exactly and so is mid * s0
        s0 = torch.randint(2**19, 2**20, (), device="cuda", generator=gen).float() * 2.0 ** (exponent - 19)
        x = mids[torch.randint(len(mids), (128, 127), device="cuda", generator=gen)] * s0
        step = torch.randint(-1, 2, x.shape, device="cuda", generator=gen).float()
        x = torch.where(step == 0, x, torch.nextafter(x, step * float("inf")))
        x = x * (torch.randint(0, 2, x.shape, device="cuda", generator=gen) * 2 - 1)
        groups.append(torch.cat([torch.full((128, 1), fmt.max, device="cuda") * s0, x], dim=1))
    x = torch.cat(groups)
    for mode in ({"cols": True}, {"tile": True}):
        t = fp8.quantize(x, fmt, **mode)
        r = fp8.quantize(x, fmt, **mode, backend="reference")
        for key in t:
            assert torch.equal(t[key].float(), r[key].float()), (mode, key)


@pytest.mark.parametrize("b_tiles", [False, True], ids=["row_scales", "tile_scales"])
def test_gemm_matches_dequantized_fp32(b_tiles):
    a = fp8.quantize(torch.randn(3000, 1100, device="cuda"), fp8.E4M3)
    w = fp8.quantize(torch.randn(520, 1100, device="cuda"), fp8.E4M3, tile=True)
    sw = w["s"] if b_tiles else w["s"].repeat_interleave(128, 0)[:520]
    bias = torch.randn(520, device="cuda")
    got = fp8.gemm(a["q"], a["s"], w["q"], sw, torch.bfloat16, bias=bias, b_tiles=b_tiles)
    ref = fp8.gemm(a["q"], a["s"], w["q"], sw, torch.float32, bias=bias, b_tiles=b_tiles, backend="reference")
    assert _rel(got, ref) < 5e-3  # bf16 output rounding


def test_every_tuned_gemm_config_gives_the_autotuned_result_bit_for_bit():
    """Each autotuner candidate (`fp8.GEMM_TUNED`) that fc1 (a weight's tile scales, bias, bf16 out), a weight
    gradient (aligned "qt" operands at a jagged token count) or the experts' weight gradient (by K range) may take
    gives the autotuned launch's values exactly: the same fp32 accumulation order whichever tile the autotuner
    picks."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = fp8.quantize(torch.randn(3001, 1024, device="cuda", generator=gen), fp8.E4M3, cols=True)
    w = fp8.quantize(torch.randn(4096, 1024, device="cuda", generator=gen) / 32, fp8.E4M3, tile=True)
    h = fp8.quantize(torch.randn(3001, 4096, device="cuda", generator=gen), fp8.E4M3, cols=True)
    bias = torch.randn(4096, device="cuda", generator=gen)
    x, g = (fp8.quantize(torch.randn(3072, n, device="cuda", generator=gen), fp8.E4M3, cols=True) for n in (256, 512))
    bounds = torch.tensor([0, 1024, 1024, 3072], device="cuda", dtype=torch.int32)
    launches = [
        ((a["q"], a["s"], w["q"], w["s"], torch.bfloat16), {"bias": bias, "b_tiles": True}, True),
        ((a["qt"], a["st"], h["qt"], h["st"], torch.float32), {}, False),
        ((x["qt"], x["st"], g["qt"], g["st"], torch.float32), {"k_bounds": bounds}, False),
    ]
    for args, kw, tile_b in launches:
        default = fp8.gemm(*args, **kw)
        fits = [c for c in fp8.GEMM_TUNED if fp8._config_fits(c, grouped_m=False, tile_b=tile_b, tma_ok=True)]
        assert fp8._tma_ok(args[0], args[2]) and len(fits) >= 4
        for config in fits:
            assert torch.equal(fp8.gemm(*args, **kw, config=config), default), config


@pytest.mark.parametrize("grad,gemm", [("e4m3", "triton"), ("e5m2", "triton"), ("e4m3", "cublas")])
def test_mlp_and_grouped_ops(grad, gemm):
    x = torch.randn(2048, 256, device="cuda", requires_grad=True)  # whole 128-row blocks: cuBLAS takes them
    w1 = (torch.randn(512, 256, device="cuda") / 16).requires_grad_()
    b1 = torch.zeros(512, device="cuda", requires_grad=True)
    w2 = (torch.randn(256, 512, device="cuda") / 22).requires_grad_()
    dy = torch.randn(2048, 256, device="cuda")
    recipe = fp8.Fp8Recipe(fp8.fp8_format(grad), gemm=gemm)
    y = fp8.fp8_mlp(x, w1, b1, w2, None, recipe, fp8.Fp8Stats(fp8.MLP_ROLES, 0, x.device))
    got = torch.autograd.grad(y, [x, w1, w2], dy)
    ref_y = F.linear(F.gelu(F.linear(x, w1, b1)), w2)
    ref = torch.autograd.grad(ref_y, [x, w1, w2], dy)
    assert _rel(y, ref_y) < 0.06
    for a, b in zip(got, ref):
        assert _rel(a, b) < (0.08 if grad == "e4m3" else 0.15)
    counts = torch.tensor([700, 0, 1348], device="cuda")
    e1, e3 = ((torch.randn(3, 256, 384, device="cuda") / 16).requires_grad_() for _ in range(2))
    e2 = (torch.randn(3, 384, 256, device="cuda") / 20).requires_grad_()
    y = fp8.fp8_grouped_swiglu(x, counts, e1, e3, e2, recipe, fp8.Fp8Stats(fp8.EXPERT_ROLES, 0, x.device))
    got = torch.autograd.grad(y, [x, e1, e3, e2], dy)
    parts = torch.split(x, counts.tolist())
    ref_y = torch.cat([(F.silu(xe @ e1[e]) * (xe @ e3[e])) @ e2[e] for e, xe in enumerate(parts)])
    ref = torch.autograd.grad(ref_y, [x, e1, e3, e2], dy)
    assert _rel(y, ref_y) < 0.08
    for a, b in zip(got, ref):
        assert _rel(a, b) < (0.1 if grad == "e4m3" else 0.18)
