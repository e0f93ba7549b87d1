"""FP8 training ops: block-scaled quantization and GEMMs for MLPs and grouped (MoE) experts, forward and backward.

Scaling (the fine-grained scheme of DeepSeek-V3): activations and gradients get one fp32 scale per 1x128 block
along the reduction dimension of the GEMM that consumes them, weights one per 128x128 tile; every GEMM
accumulates each 128-deep slice of K in fp32 and adds it times the two operands' scales (`_gemm_kernel`).
A tensor consumed by two GEMMs that reduce over different dimensions (x: forward over features, weight gradient
over tokens) is quantized both ways in one pass (`quantize_rows_cols`). Scale = amax / max of the format
("dynamic", from the current block), or a per-tensor scale handed in ("delayed", from an amax history the caller
keeps); a handed-in scale <= 0 means "no history yet" and falls back to the block's own.

Formats: e4m3 (max 448) for activations and weights, e4m3 or e5m2 (max 57344) for gradients. Quantized
operands are stored in a carrier dtype: float8 on the GPU; float32 holding values on the fp8 grid under the
Triton interpreter and in the torch reference (`backend="reference"`, the CPU emulation: quantize, dequantize,
fp32 matmul), so the same ops and scaling run and are tested without a GPU.

Ops (autograd, weights stay fp32/bf16 masters, outputs in the autocast dtype):
  fp8_mlp(x, w1, b1, w2, b2)                         fc2(gelu(fc1(x))); gelu and both quantizations of its output
                                                     in one pass after fc1, gelu's backward after fc2's dgrad
  fp8_grouped_swiglu(x_sorted, counts, w1, w3, w2)   MoE experts: (silu(x w1[e]) * x w3[e]) w2[e] over rows grouped
                                                     by expert; groups padded to 128 rows so tiles never straddle two
Counters per quantized tensor (`Fp8Stats`): values that overflowed the format (only possible with delayed scales),
non-zero values that underflowed to zero, non-zero values seen, non-finite inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gemrec.kernels.triton_attention import INTERPRET, _scratch

BLOCK = 128  # scaling block along K, and the row alignment of expert groups


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float
    mantissa: int  # explicit mantissa bits
    min_exp: int  # exponent of the smallest normal number
    overflow: float  # |value / scale| above this does not round to +-max: saturated, counted as overflow


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, -6, 464.0)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, -14, 61440.0)
FORMATS = {f.name: f for f in (E4M3, E5M2)}
BACKENDS = ("triton", "reference")


def fp8_format(name: str) -> Fp8Format:
    if name not in FORMATS:
        raise ValueError(f"unknown fp8 format {name!r}: use one of {sorted(FORMATS)}")
    return FORMATS[name]


# -- reference (pure torch): the CPU emulation and what the kernels are tested against ------------------------


def block_scale(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Scales of blocks with these amaxes: amax / fmt.max correctly rounded in fp32, as the kernels' `tl.div_rn`; 1
    for an all-zero block (a NaN/inf amax stays non-finite). The divisor is a tensor: torch on CUDA divides by a
    Python number as a multiplication by its reciprocal, one ulp off in some elements (and then some fp8 values)."""
    return torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, fmt.max))


def round_to_format(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """fp32 values of `y` (already within +-fmt.max) rounded to the nearest fp8 value, ties to even."""
    return y.clamp(-fmt.max, fmt.max).to(fmt.dtype).float()


def quantize_reference(
    x: torch.Tensor, fmt: Fp8Format, block: tuple[int, int], scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of the last two dims of `x` in blocks of `block` (rows, cols); q is fp32 on the fp8 grid with
    x ~= q * scale per block; scales have shape (..., ceil(R / rows), ceil(C / cols)). `scale`: a per-tensor
    scale used where > 0 (delayed scaling)."""
    br, bc = block
    rows, cols = x.shape[-2:]
    pr, pc = -rows % br, -cols % bc
    xp = F.pad(x.float(), (0, pc, 0, pr))
    blocks = xp.reshape(*x.shape[:-2], (rows + pr) // br, br, (cols + pc) // bc, bc)
    amax = blocks.abs().amax(dim=(-3, -1))
    s = block_scale(amax, fmt)
    if scale is not None:
        s = torch.where(scale > 0, scale.float(), s)
    q = round_to_format(blocks / s[..., :, None, :, None], fmt)
    q = q.reshape(xp.shape)[..., :rows, :cols]
    return q, s


def dequantize_reference(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = q.shape[-2:]
    full = s.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.float() * full[..., :rows, :cols]


# -- Triton kernels ------------------------------------------------------------------------------------------


@triton.jit
def _round_fp8(y, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Round fp32 `y` (within the format's range) to the fp8 grid, ties to even, in exact fp32 arithmetic
    (power-of-two scalings): the fp32 carriers' rounding under the interpreter, whose float8 casts mis-round where
    rounding carries into the next exponent. On the H200 the hardware's cast gives the same values as torch's."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
    step = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
    inverse_step = ((MANT - e + 127) << 23).to(tl.float32, bitcast=True)
    r = y * inverse_step
    r = (r + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to nearest even integer
    return r * step


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def _gelu_grad_tl(h):
    cdf = 0.5 * (1.0 + tl.erf(h * 0.7071067811865476))
    return cdf + h * tl.exp(-0.5 * h * h) * 0.3989422804014327


@triton.jit
def _to_fp8(y, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, q_ptr):
    """y saturated to +-FP8_MAX and rounded to the fp8 grid, in `q_ptr`'s carrier dtype: float8 by the hardware's
    saturating cast alone (sm_90 F2FP.SATFINITE: torch's values for the clamped y, NaN kept; no fp32 copy back for
    the stores, and no rounding in fp32 arithmetic before it, which once gave the 128x128-tile kernel's transposed
    copy corrupt bytes, NaN among them), fp32 by `_round_fp8` of the clamped y."""
    if q_ptr.dtype.element_ty == tl.float32:
        return _round_fp8(tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX), MANT, EMIN)
    else:
        return y.to(q_ptr.dtype.element_ty)


@triton.jit
def _fast_division_ok(s, amax):
    """Blocks whose quotients `_divide` takes by div.rn's fast path: scale s in [2^-64, 2^64] and amax <= 2^64 s (no
    quotient overflows; a NaN or inf amax or scale fails)."""
    return (s >= 5.421010862427522e-20) & (s <= 1.8446744073709552e19) & (amax <= s * 1.8446744073709552e19)


@triton.jit
def _reciprocal(s):
    """div.rn's reciprocal on sm_90 (its SASS: MUFU.RCP, then one Newton step in two FFMAs), for s in normal range."""
    r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [s], dtype=tl.float32, is_pure=True, pack=1)
    return tl.fma(r, tl.fma(-s, r, 1.0), r)


@triton.jit
def _divide(x, s, r, fast, FMA: tl.constexpr):
    """x / s correctly rounded, as `tl.div_rn`, with s and r = `_reciprocal(s)` per block broadcast against x.
    div.rn on sm_90 is MUFU.RCP, five FFMAs, an FCHK range check and a branch to a slow path, ten instructions a value;
    its fast path alone, with the reciprocal shared by the block, is three: q = x r, y = q + r (x - s q) (as
    q - r (s q - x): the same roundings, and the sign of a zero kept). Where `fast` (every block of the tile passed
    `_fast_division_ok`) scales and reciprocals are normal and quotients at most 2^64, so the remainder s q - x is
    exact and the result correctly rounded unless |x| < 2^-96, whose quotients (< 2^-32) every fp8 format flushes to
    zero either way; otherwise, or without real FMAs (FMA: the interpreter rounds twice and has no PTX), tl.div_rn."""
    if FMA:
        if fast:
            q = x * r
            # times -1, not unary minus: triton's -x is 0 - x, an FADD a value where LLVM's fneg folds into the FFMA
            y = tl.fma(r * -1.0, tl.fma(s, q, x * -1.0), q)
        else:
            y = tl.div_rn(x, s)
    else:
        y = tl.div_rn(x, s)
    return y


@triton.jit
def _quantize_kernel(
    x_ptr,
    gate_ptr,
    q_ptr,
    s_ptr,
    qt_ptr,
    st_ptr,
    fixed_ptr,
    amax_ptr,
    stats_ptr,
    colsum_ptr,
    R,
    C,
    HALF,
    RT,
    sxb,
    sxr,
    sxc,
    sgb,
    sgr,
    sgc,
    sqb,
    sqr,
    sqc,
    ssb,
    ssr,
    ssc,
    stb,
    stc,
    str_,
    sstb,
    sstc,
    sstr,
    FP8_MAX: tl.constexpr,
    OVERFLOW: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    ACT: tl.constexpr,  # 0: x, 1: gelu(x), 2: silu(x) * gate, 3: x * gelu'(gate), 4: swiglu backward (see `quantize`)
    ROWS: tl.constexpr,  # q (R, C) with scales (R, C / 128): 1x128 blocks along C
    COLS: tl.constexpr,  # qt (C, R) with scales (C, R / 128): 128x1 blocks along R, stored transposed
    TILE: tl.constexpr,  # q (R, C) with one scale per 128x128 tile, s (R / 128, C / 128); qt too if COLS
    FIXED: tl.constexpr,
    AMAX: tl.constexpr,
    STATS: tl.constexpr,
    COLSUM: tl.constexpr,
    FMA: tl.constexpr,  # compiled for the GPU (not the interpreter): `_divide` may take div.rn's fast path
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    valid = (rows[:, None] < R) & (cols[None, :] < C)
    # qt's rows padded to RT, a multiple of 16 (`aligned_rows`): the padding gets zeros and the transposed stores stay
    # 16 bytes wide at any R (masked at R they were byte stores)
    valid_t = (rows[:, None] < RT) & (cols[None, :] < C)
    if ACT == 4:
        # C = 2 * HALF output columns [dh1 | dh3] from x = dg (R, HALF) and gate = [h1 | h3] (R, 2 * HALF)
        j = tl.where(cols < HALF, cols, cols - HALF)
        xg = x_ptr + pid_b * sxb + rows[:, None] * sxr
        dg = tl.load(xg + j[None, :] * sxc, mask=valid, other=0.0).to(tl.float32)
        gg = gate_ptr + pid_b * sgb + rows[:, None] * sgr
        h1 = tl.load(gg + j[None, :] * sgc, mask=valid, other=0.0).to(tl.float32)
        h3 = tl.load(gg + (j + HALF)[None, :] * sgc, mask=valid, other=0.0).to(tl.float32)
        sig = tl.sigmoid(h1)
        x = tl.where((cols < HALF)[None, :], dg * h3 * sig * (1.0 + h1 * (1.0 - sig)), dg * h1 * sig)
    else:
        x_ptrs = x_ptr + pid_b * sxb + rows[:, None] * sxr + cols[None, :] * sxc
        x = tl.load(x_ptrs, mask=valid, other=0.0).to(tl.float32)
        if ACT == 1:
            x = _gelu(x)
        elif ACT == 2 or ACT == 3:
            g_ptrs = gate_ptr + pid_b * sgb + rows[:, None] * sgr + cols[None, :] * sgc
            gate = tl.load(g_ptrs, mask=valid, other=0.0).to(tl.float32)
            if ACT == 2:
                x = x * tl.sigmoid(x) * gate
            else:
                x = x * _gelu_grad_tl(gate)
    if COLSUM:
        tl.atomic_add(colsum_ptr + pid_b * C + cols, tl.sum(x, 0), mask=cols < C)
    q_ptr += pid_b * sqb
    s_ptr += pid_b * ssb
    qt_ptr += pid_b * stb
    st_ptr += pid_b * sstb
    ax = tl.where(x == x, tl.abs(x), float("inf"))  # NaN -> an infinite amax: the block's scale turns non-finite
    if AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(ax, 1), 0))
    fixed = 0.0
    if FIXED:
        fixed = tl.load(fixed_ptr)
    if TILE:
        amax_t = tl.max(tl.max(ax, 1), 0)
        scale_t = tl.where(amax_t == 0, 1.0, tl.div_rn(amax_t, FP8_MAX))
        if FIXED:
            scale_t = tl.where(fixed > 0, fixed, scale_t)
        fast_t = _fast_division_ok(scale_t, amax_t)
        y = _divide(x, scale_t, _reciprocal(scale_t) if FMA else scale_t, fast_t, FMA)
        q = _to_fp8(y, FP8_MAX, MANT, EMIN, q_ptr)
        tl.store(q_ptr + rows[:, None] * sqr + cols[None, :] * sqc, q, valid)
        tl.store(s_ptr + pid_r * ssr + pid_c * ssc, scale_t)
        if COLS:
            qt_ptrs = qt_ptr + cols[None, :] * stc + rows[:, None] * str_
            tl.store(qt_ptrs, q, valid_t)
    else:
        if ROWS:
            amax_r = tl.max(ax, 1)
            scale_r = tl.where(amax_r == 0, 1.0, tl.div_rn(amax_r, FP8_MAX))
            if FIXED:
                scale_r = tl.where(fixed > 0, fixed, scale_r)
            fast_r = tl.min(_fast_division_ok(scale_r, amax_r).to(tl.int32), 0) != 0
            recip_r = _reciprocal(scale_r) if FMA else scale_r
            y = _divide(x, scale_r[:, None], recip_r[:, None], fast_r, FMA)
            q = _to_fp8(y, FP8_MAX, MANT, EMIN, q_ptr)
            q_ptrs = q_ptr + rows[:, None] * sqr + cols[None, :] * sqc
            tl.store(q_ptrs, q, valid)
            tl.store(s_ptr + rows * ssr + pid_c * ssc, scale_r, rows < R)
        if COLS:
            amax_c = tl.max(ax, 0)
            scale_c = tl.where(amax_c == 0, 1.0, tl.div_rn(amax_c, FP8_MAX))
            if FIXED:
                scale_c = tl.where(fixed > 0, fixed, scale_c)
            fast_c = tl.min(_fast_division_ok(scale_c, amax_c).to(tl.int32), 0) != 0
            recip_c = _reciprocal(scale_c) if FMA else scale_c
            y_c = _divide(x, scale_c[None, :], recip_c[None, :], fast_c, FMA)
            q_c = _to_fp8(y_c, FP8_MAX, MANT, EMIN, qt_ptr)
            qt_ptrs = qt_ptr + cols[None, :] * stc + rows[:, None] * str_
            tl.store(qt_ptrs, q_c, valid_t)
            tl.store(st_ptr + cols * sstc + pid_r * sstr, scale_c, cols < C)
            if not ROWS:
                y, q = y_c, q_c
    if STATS:
        finite = (x == x) & (ax < float("inf"))
        nonzero = valid & finite & (x != 0.0)
        tl.atomic_add(stats_ptr + 0, tl.sum(tl.sum((nonzero & (tl.abs(y) > OVERFLOW)).to(tl.int64), 1), 0))
        tl.atomic_add(stats_ptr + 1, tl.sum(tl.sum((nonzero & (q.to(tl.float32) == 0.0)).to(tl.int64), 1), 0))
        tl.atomic_add(stats_ptr + 2, tl.sum(tl.sum(nonzero.to(tl.int64), 1), 0))
        tl.atomic_add(stats_ptr + 3, tl.sum(tl.sum((valid & ~finite).to(tl.int64), 1), 0))


# The autotuner's candidates (`GEMM_CONFIG_KEYS`): each was the fastest of `fp8_bench --gemm-sweep` at some GEMM of
# the MLP block on the H200 (docs/benchmarks.md, 2026-12-02 09:24 UTC), pruned per launch (`_config_fits`)
GEMM_TUNED = (
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "TMA": True},  # fc1, fc1/fc2 dgrad
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "GROUP_SIZE_M": 4},  # fc2; expert groups
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "TMA": True},  # dW2, K a multiple of 128
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "TMA": True},  # dW1, K a multiple of 128
    {"BLOCK_M": 64, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4, "TMA": True},  # dW1 and dW2, jagged K
)


def _config_fits(config: dict, *, grouped_m: bool, tile_b: bool, tma_ok: bool) -> bool:
    """Whether a launch may take a `GEMM_CONFIG_KEYS` config: expert groups (grouped_m) need 128-row tiles and no
    TMA; TMA needs K-contiguous operands with 16-byte aligned rows (tma_ok); a weight's tile scales (tile_b) at most
    128-wide tiles (wider ones scale per column, rounding otherwise than the one scale a tile)."""
    if grouped_m and (config.get("BLOCK_M", BLOCK) != BLOCK or config.get("TMA")):
        return False
    if tile_b and config.get("BLOCK_N", BLOCK) > BLOCK:
        return False
    return tma_ok or not config.get("TMA")


def _triton_config(config: dict) -> triton.Config:
    tiles = {"GROUP_SIZE_M": 8, **{k: v for k, v in config.items() if k not in ("num_warps", "num_stages")}}
    return triton.Config(tiles, num_warps=config["num_warps"], num_stages=config["num_stages"])


def _gemm_configs() -> list[triton.Config]:
    if INTERPRET:  # one config: the autotuner then neither prunes nor times (`gemm(config=...)` runs the others)
        return [triton.Config({"BLOCK_M": BLOCK, "BLOCK_N": BLOCK, "GROUP_SIZE_M": 8}, num_warps=4, num_stages=1)]
    return [_triton_config(config) for config in GEMM_TUNED]


def _prune_gemm_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The autotuner's candidates that fit the launch (`_config_fits`; TUNE_TMA, a key, says whether TMA may load)."""
    launch = {"grouped_m": kwargs["GROUP_M"], "tile_b": kwargs["TILE_B"], "tma_ok": bool(named_args["TUNE_TMA"])}
    return [c for c in configs if _config_fits(c.kwargs, **launch)]


@triton.jit
def _gemm_dot(
    ptrs,
    strides,
    tile,
    k,
    k_hi,
    MASK_K: tl.constexpr,
    TILE_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The unscaled fp32 dot of the 128-deep slice [k, k + BLOCK_K) (masked past k_hi with MASK_K) and its scales:
    (d, sa (BLOCK_M,), sb (BLOCK_N,)); under one of b's tile scales (TILE_B, BLOCK_N <= BLOCK_K) sa times it and sb
    unused (`_promote`)."""
    a_ptr, b_ptr, sa_ptr, sb_ptr = ptrs
    sam, sak, sbn, sbk, ssam, ssak, ssbn, ssbk = strides
    rm, rn, rk, a_ok, m_ok, n_ok, n_tile = tile
    a_mask, b_mask = a_ok[:, None], n_ok[None, :]
    if MASK_K:
        k_ok = (k + rk) < k_hi
        a_mask, b_mask = a_mask & k_ok[None, :], b_mask & k_ok[:, None]
    a = tl.load(a_ptr + rm[:, None] * sam + (k + rk)[None, :] * sak, mask=a_mask, other=0.0)
    b = tl.load(b_ptr + rn[None, :] * sbn + (k + rk)[:, None] * sbk, mask=b_mask, other=0.0)
    kb = k // BLOCK_K
    sa = tl.load(sa_ptr + rm * ssam + kb * ssak, mask=m_ok, other=0.0)
    if TILE_B and BLOCK_N <= BLOCK_K:
        # the output tile under one of b's tile scales: one multiply-add a value (sm_90: an FMUL and an FFMA
        # a value with per-column scales, and 32 scalar scale loads a thread)
        sa = sa * tl.load(sb_ptr + n_tile * ssbn + kb * ssbk)
        sb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        sb = tl.load(sb_ptr + (rn // BLOCK_K if TILE_B else rn) * ssbn + kb * ssbk, mask=n_ok, other=0.0)
    return tl.dot(a, b), sa, sb


@triton.jit
def _promote(acc, d, sa, sb, SCALAR_B: tl.constexpr):
    """acc plus a block's dot d times its scales (`_gemm_dot`)."""
    if SCALAR_B:
        return acc + d * sa[:, None]
    else:
        return acc + d * sa[:, None] * sb[None, :]


@triton.autotune(
    configs=_gemm_configs(),
    key=["TUNE_N", "TUNE_K", "TUNE_TMA", "GROUP_M", "GROUP_K", "TILE_B"],
    prune_configs_by={"early_config_prune": _prune_gemm_configs},
)
@triton.jit
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sa_ptr,
    sb_ptr,
    bias_ptr,
    tile_group_ptr,
    k_bounds_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbg,
    sbn,
    sbk,
    scg,
    scm,
    scn,
    ssam,
    ssak,
    ssbg,
    ssbn,
    ssbk,
    TUNE_N,
    TUNE_K,
    TUNE_TMA,
    HAS_BIAS: tl.constexpr,
    GROUP_M: tl.constexpr,  # b, sb indexed by the group of the M tile (tile_group[pid_m]; -1: zeros)
    EVEN_K: tl.constexpr,  # every K range a whole number of 128-blocks: no masks along K
    GROUP_K: tl.constexpr,  # program_id(2) = group g reduces k in [k_bounds[g], k_bounds[g + 1]) into c[g]
    TILE_B: tl.constexpr,  # sb holds b's 128x128 tile scales (N/128, K/128), not one per row
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    TMA: tl.constexpr = False,  # A and B by tensor descriptors (K-contiguous, 16-byte aligned rows; not GROUP_M)
):
    """c[m, n] = sum over 128-blocks kb of sa[m, kb] * sb[n, kb] * sum_{k in kb} a[m, k] b[n, k] (+ bias[n]);
    each block's dot is accumulated in fp32 and scaled before it is added. TUNE_*: the autotuner's key only."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_SIZE_M * num_n
    first_m = (pid // per_group) * GROUP_SIZE_M
    size_m = tl.minimum(num_m - first_m, GROUP_SIZE_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    k_lo, k_hi = 0, K
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_ok = m_ok
    if GROUP_M:
        g = tl.load(tile_group_ptr + pid_m)
        a_ok = m_ok & (g >= 0)  # a tile past the last group: zeros
        g = tl.maximum(g, 0).to(tl.int64)
        b_ptr += g * sbg
        sb_ptr += g * ssbg
    if GROUP_K:
        g = tl.program_id(1)
        k_lo, k_hi = tl.load(k_bounds_ptr + g), tl.load(k_bounds_ptr + g + 1)
        c_ptr += g.to(tl.int64) * scg
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ptrs = (a_ptr, b_ptr, sa_ptr, sb_ptr)
    strides = (sam, sak, sbn, sbk, ssam, ssak, ssbn, ssbk)
    tile = (rm, rn, rk, a_ok, m_ok, n_ok, pid_n * BLOCK_N // BLOCK_K)
    # whole 128-deep blocks unmasked (a mask along K at an arbitrary token count would make every load scalar), then
    # the ragged last one masked
    k_whole = k_hi if EVEN_K else k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K
    scalar_b: tl.constexpr = TILE_B and BLOCK_N <= BLOCK_K
    if TMA:
        # A and B tiles by TMA (out-of-bounds rows and K zero-filled: no masks)
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, k_hi], [sam, 1], [BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, k_hi], [sbn, 1], [BLOCK_N, BLOCK_K])
        for k in tl.range(k_lo, k_hi, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k])
            b = b_desc.load([pid_n * BLOCK_N, k])
            kb = k // BLOCK_K
            sa = tl.load(sa_ptr + rm * ssam + kb * ssak, mask=m_ok, other=0.0)
            if scalar_b:
                sa = sa * tl.load(sb_ptr + pid_n * BLOCK_N // BLOCK_K * ssbn + kb * ssbk)
                acc = acc + tl.dot(a, b.T) * sa[:, None]
            else:
                sb = tl.load(sb_ptr + (rn // BLOCK_K if TILE_B else rn) * ssbn + kb * ssbk, mask=n_ok, other=0.0)
                acc = acc + tl.dot(a, b.T) * sa[:, None] * sb[None, :]
    else:
        for k in range(k_lo, k_whole, BLOCK_K):
            d, sa, sb = _gemm_dot(ptrs, strides, tile, k, k_hi, False, TILE_B, BLOCK_N, BLOCK_K)
            acc = _promote(acc, d, sa, sb, scalar_b)
        for k in range(k_whole, k_hi, BLOCK_K):
            d, sa, sb = _gemm_dot(ptrs, strides, tile, k, k_hi, True, TILE_B, BLOCK_N, BLOCK_K)
            acc = _promote(acc, d, sa, sb, scalar_b)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty), m_ok[:, None] & n_ok[None, :]
    )


# -- launchers -----------------------------------------------------------------------------------------------


@dataclass
class Fp8Stats:
    """Per-module counters and amaxes, one row per quantized tensor (`roles`), on the module's device.

    counts[i] = (overflowed, underflowed to zero, non-zero, non-finite) since the last `reset`; `collect` turns
    counting on (the trainer does on logging steps only: the atomics cost a little). amax[i] is the largest |value|
    of tensor i this step; `history` keeps the last `history_len` steps' (delayed scaling: scale = max / fmt.max).
    """

    roles: tuple[str, ...]
    history_len: int
    device: torch.device
    collect: bool = False

    def __post_init__(self):
        n = len(self.roles)
        self.counts = torch.zeros(n, 4, dtype=torch.int64, device=self.device)
        self.amax = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.history = torch.zeros(n, max(self.history_len, 1), dtype=torch.float32, device=self.device)

    @property
    def delayed(self) -> bool:
        return self.history_len > 0

    def scale(self, role: int, fmt: Fp8Format) -> torch.Tensor | None:
        """The delayed per-tensor scale of `role` (<= 0 until a step has been seen), None when dynamic."""
        return self.history[role].amax().reshape(1) / fmt.max if self.delayed else None

    def step(self) -> None:
        """After an optimizer step: this step's amaxes enter the history."""
        if self.delayed:
            self.history = torch.cat([self.amax[:, None], self.history[:, :-1]], dim=1)
        self.amax.zero_()

    def reset_counts(self) -> None:
        self.counts.zero_()


def _carrier(fmt: Fp8Format, device: torch.device) -> torch.dtype:
    return fmt.dtype if device.type == "cuda" else torch.float32


ACTIVATIONS = {"none": 0, "gelu": 1, "swiglu": 2, "gelu_bwd": 3, "swiglu_bwd": 4}
# Warps of a quantization program (one 128x128 tile). 16 warps hold half the values a thread (<= 128 registers) for
# ~10-20% more instructions a value; on the H200 8 were faster in 5 of 7 modes at the step's shapes (docs/benchmarks.md,
# `fp8_bench --quantize-only`), unspilled either way (tests/kernels/test_fp8_sm90_compile.py).
QUANTIZE_WARPS = 8


def aligned_rows(shape: tuple[int, ...], device, dtype) -> torch.Tensor:
    """An empty tensor of `shape` whose rows start 16-byte aligned (the last dim padded in its storage). A weight
    gradient's GEMM reads "qt" along the token count: at a row stride that is not a multiple of 16 (most token
    counts) Triton loads it byte by byte, without cp.async pipelining (sm_90 SASS: LDG.E.U8 instead of LDGSTS.128)."""
    *lead, r = shape
    return torch.empty(*lead, -(-r // 16) * 16, device=device, dtype=dtype)[..., :r]


def _quantize_buffers(
    shape: tuple[int, int, int], fmt: Fp8Format, device, *, rows: bool, cols: bool, tile: bool, colsum: bool
) -> dict[str, torch.Tensor]:
    """`quantize`'s outputs for a batch (nb, R, C), allocated; a tile's "st" ("s" transposed) is left to the caller."""
    nb, r, c = shape
    nrb, ncb = triton.cdiv(r, BLOCK), triton.cdiv(c, BLOCK)
    carrier = _carrier(fmt, device)
    out = {}
    if rows or tile:
        out["q"] = torch.empty(nb, r, c, device=device, dtype=carrier)
        out["s"] = torch.empty(nb, nrb, ncb, device=device) if tile else torch.empty(nb, ncb, r, device=device).mT
    if cols:
        out["qt"] = aligned_rows((nb, c, r), device, carrier)
        if not tile:
            out["st"] = torch.empty(nb, nrb, c, device=device).mT
    if colsum:
        out["colsum"] = torch.zeros(nb, c, device=device)
    return out


def _stats_buffers(stats: Fp8Stats | None, role: int, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, counts) of `role` that a quantization updates: delayed scaling's amax, and the counters when collecting
    (`dummy` where not)."""
    amax = stats.amax[role : role + 1] if stats is not None and stats.delayed else dummy
    counts = stats.counts[role] if stats is not None and stats.collect else dummy
    return amax, counts


def quantize(
    x: torch.Tensor,
    fmt: Fp8Format,
    *,
    rows: bool = True,
    cols: bool = False,
    tile: bool = False,
    act: str = "none",
    gate: torch.Tensor | None = None,
    colsum: bool = False,
    stats: Fp8Stats | None = None,
    role: int = 0,
    backend: str = "triton",
    check_finite: bool = False,
) -> dict[str, torch.Tensor]:
    """Quantize the last two dims (R, C) of `y = act(x, gate)` (2-D, or 3-D with a leading batch such as experts).

    rows: "q" (R, C) and "s" (R, ceil(C/128)), 1x128 blocks along C. cols: "qt" (C, R) and "st" (C, ceil(R/128)),
    128x1 blocks along R, stored transposed. tile: "q" with "s" (ceil(R/128), ceil(C/128)), 128x128 tiles, and
    "qt" (C, R) with the same scales when `cols`. Per-row scales are stored column-major (the GEMM reads a column
    of them per K block). act: none (y = x) | gelu | swiglu (silu(x) * gate) | gelu_bwd (x * gelu'(gate)) |
    swiglu_bwd (x = dg (R, H), gate = [h1 | h3] (R, 2H): y = [dg h3 silu'(h1) | dg silu(h1)], C = 2H).
    colsum: also "colsum" (C,), the fp32 sums of y's columns (a bias gradient).
    Non-finite inputs give non-finite scales (and are counted in `stats`); `check_finite` raises a ValueError
    for them instead (a host sync: for tools and tests, not the training step, whose loss guard stops the run).
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"quantize: expected a 2-D or 3-D tensor, got shape {tuple(x.shape)}")
    if act not in ACTIVATIONS or (act in ("none", "gelu")) != (gate is None):
        raise ValueError(f"quantize: act {act!r} with gate={'given' if gate is not None else 'None'}")
    wide = act == "swiglu_bwd"
    if gate is not None and gate.shape[:-1] + (gate.shape[-1] // (2 if wide else 1),) != x.shape:
        raise ValueError(f"quantize: act {act!r} needs a gate matching x {tuple(x.shape)}, got {tuple(gate.shape)}")
    if not (rows or cols or tile):
        raise ValueError("quantize: nothing to produce (rows, cols and tile are all False)")
    if backend not in BACKENDS:
        raise ValueError(f"quantize: backend must be one of {BACKENDS}, got {backend!r}")
    if check_finite:
        bad = int((~torch.isfinite(x)).sum()) + (int((~torch.isfinite(gate)).sum()) if gate is not None else 0)
        if bad:
            raise ValueError(f"fp8 quantize: {bad} non-finite value(s) (NaN/inf) in a tensor of shape {tuple(x.shape)}")
    fixed = stats.scale(role, fmt) if stats is not None else None
    if backend == "reference":
        return _quantize_ref(x, fmt, rows, cols, tile, act, gate, colsum, stats, role, fixed)
    batched = x.dim() == 3
    xb = x if batched else x[None]
    gb = None if gate is None else (gate if batched else gate[None])
    nb, r, c = xb.shape
    half = c
    if wide:
        c = 2 * c
    nrb, ncb = triton.cdiv(r, BLOCK), triton.cdiv(c, BLOCK)
    out = _quantize_buffers((nb, r, c), fmt, x.device, rows=rows, cols=cols, tile=tile, colsum=colsum)
    dummy = torch.empty(1, device=x.device, dtype=torch.float32)
    q, s, qt, st, sums = (out.get(key, dummy) for key in ("q", "s", "qt", "st", "colsum"))
    amax, counts = _stats_buffers(stats, role, dummy)
    g = gb if gb is not None else xb
    _quantize_kernel[(nrb, ncb, nb)](
        xb,
        g,
        q,
        s,
        qt,
        st,
        fixed if fixed is not None else dummy,
        amax,
        counts,
        sums,
        r,
        c,
        half,
        qt.stride(-2) if qt is not dummy else 0,
        *xb.stride(),
        *g.stride(),
        *(q.stride() if q is not dummy else (0, 0, 0)),
        *(s.stride() if s is not dummy else (0, 0, 0)),
        *(qt.stride() if qt is not dummy else (0, 0, 0)),
        *(st.stride() if st is not dummy else (0, 0, 0)),
        FP8_MAX=fmt.max,
        OVERFLOW=fmt.overflow,
        MANT=fmt.mantissa,
        EMIN=fmt.min_exp,
        ACT=ACTIVATIONS[act],
        ROWS=rows,
        COLS=cols,
        TILE=tile,
        FIXED=fixed is not None,
        AMAX=amax is not dummy,
        STATS=counts is not dummy,
        COLSUM=colsum,
        FMA=not INTERPRET,
        BLOCK_R=BLOCK,
        BLOCK_C=BLOCK,
        num_warps=QUANTIZE_WARPS,
    )
    if tile and cols:
        out["st"] = out["s"].transpose(-1, -2)
    return out if batched else {k: v[0] for k, v in out.items()}


def _activate(x: torch.Tensor, act: str, gate: torch.Tensor | None) -> torch.Tensor:
    x = x.float()
    if act == "gelu":
        return F.gelu(x)
    if act not in ("swiglu", "gelu_bwd", "swiglu_bwd"):
        return x
    if gate is None:
        raise ValueError(f"activation {act!r} needs its gate tensor")
    if act == "swiglu":
        return F.silu(x) * gate.float()
    if act == "gelu_bwd":
        return x * _gelu_grad(gate)
    h1, h3 = gate.float().chunk(2, dim=-1)  # swiglu_bwd
    sig = torch.sigmoid(h1)
    return torch.cat([x * h3 * sig * (1 + h1 * (1 - sig)), x * h1 * sig], dim=-1)


def _quantize_ref(x, fmt, rows, cols, tile, act, gate, colsum, stats, role, fixed):
    y = _activate(x, act, gate)
    out = {"colsum": y.sum(-2)} if colsum else {}
    if stats is not None and stats.delayed:
        stats.amax[role] = torch.maximum(stats.amax[role], y.abs().amax())
    if tile:
        out["q"], out["s"] = quantize_reference(y, fmt, (BLOCK, BLOCK), fixed)
        if cols:
            out["qt"], out["st"] = out["q"].transpose(-1, -2), out["s"].transpose(-1, -2)
        first = (out["q"], out["s"], (BLOCK, BLOCK))
    else:
        first = None
        if rows:
            out["q"], out["s"] = quantize_reference(y, fmt, (1, BLOCK), fixed)
            first = (out["q"], out["s"], (1, BLOCK))
        if cols:
            qc, sc = quantize_reference(y, fmt, (BLOCK, 1), fixed)
            out["qt"], out["st"] = qc.transpose(-1, -2), sc.transpose(-1, -2)
            first = first or (qc, sc, (BLOCK, 1))
    if stats is not None and stats.collect:
        q, s, block = first
        scaled = (
            y / s.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., : y.shape[-2], : y.shape[-1]]
        )
        finite = torch.isfinite(y)
        nonzero = finite & (y != 0)
        stats.counts[role] += torch.stack(
            [
                (nonzero & (scaled.abs() > fmt.overflow)).sum(),
                (nonzero & (q == 0)).sum(),
                nonzero.sum(),
                (~finite).sum(),
            ]
        ).to(stats.counts.device)
    return out


def _expand_tile_scales(s: torch.Tensor, rows: int) -> torch.Tensor:
    """(..., R/128, K/128) tile scales -> (..., R, K/128) per-row scales (column-major), as the reference GEMM reads
    them."""
    return s.mT.repeat_interleave(BLOCK, dim=-1)[..., :rows].mT


def gemm(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None = None,
    tile_group: torch.Tensor | None = None,
    k_bounds: torch.Tensor | None = None,
    b_tiles: bool = False,
    backend: str = "triton",
    config: dict | None = None,
) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T with per-row 1x128-block scales sa (M, K/128), sb (N, K/128), or with `b_tiles` b's
    128x128 tile scales sb (N/128, K/128) (a weight's: one scale per output tile and K block, read as they are).
    Grouped: `tile_group` (M/128,) picks b[g] (G, N, K) and sb[g] for each 128-row tile (-1 skips it); `k_bounds`
    (G + 1,) splits K into groups and returns (G, M, N), one product per group. `config`: fixed tiles instead of the
    autotuned ones (`GEMM_CONFIG_KEYS`)."""
    m, k = a.shape
    n = b.shape[-2]
    if k_bounds is not None:
        out = torch.zeros(k_bounds.numel() - 1, m, n, device=a.device, dtype=out_dtype)
    else:
        out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    if backend == "reference":
        return _gemm_ref(a, sa, b, _expand_tile_scales(sb, n) if b_tiles else sb, out, bias, tile_group, k_bounds)
    _launch_gemm(a, sa, b, sb, out, bias, tile_group, k_bounds, b_tiles, config=config)
    return out


# what a fixed GEMM config (`gemm(config=...)`, the sweep of `fp8_bench --gemm-sweep`) or `GEMM_TUNED` may set
GEMM_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "GROUP_SIZE_M", "TMA", "num_warps", "num_stages")


def _tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both operands K-contiguous with 16-byte aligned rows: what the TMA configs' tensor descriptors need."""
    return all(t.stride(-1) == 1 and t.stride(-2) % 16 == 0 for t in (a, b))


def _launch_gemm(a, sa, b, sb, out, bias, tile_group, k_bounds, b_tiles, config=None) -> None:
    """`_gemm_kernel` into `out`, autotuned over `GEMM_TUNED` (tuned once per output width, reduction depth (a
    power-of-two bucket of it: token counts vary), TMA eligibility, grouping, scale layout and dtypes), or with
    `config`, a fixed tile config (`GEMM_CONFIG_KEYS`) checked against the launch."""
    m, k = a.shape
    n = b.shape[-2]
    dummy = torch.empty(1, device=a.device, dtype=torch.int32)
    grouped_b = tile_group is not None
    tma_ok = _tma_ok(a, b)

    def grid(meta):
        return triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(
            n, meta["BLOCK_N"]
        ), k_bounds.numel() - 1 if k_bounds is not None else 1

    kernel, consts = _gemm_kernel, {}
    if not INTERPRET:
        triton.set_allocator(_scratch)  # in-kernel tensor descriptors (TMA configs) live in global scratch
    if config is not None:
        unknown = set(config) - set(GEMM_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"gemm config: unknown keys {sorted(unknown)}; use {GEMM_CONFIG_KEYS}")
        if not _config_fits(config, grouped_m=grouped_b, tile_b=b_tiles, tma_ok=tma_ok):
            raise ValueError(
                f"gemm config {config}: does not fit the launch (expert groups: 128-row tiles, no TMA; weight tile "
                f"scales: at most 128-wide tiles; TMA: K-contiguous operands with 16-byte aligned rows)"
            )
        consts = {"BLOCK_M": BLOCK, "BLOCK_N": BLOCK, "GROUP_SIZE_M": 8, **config}
        kernel = _gemm_kernel.fn
    kernel[grid](
        a,
        b,
        out,
        sa,
        sb,
        bias if bias is not None else dummy,
        tile_group if grouped_b else dummy,
        k_bounds if k_bounds is not None else dummy,
        m,
        n,
        k,
        *a.stride(),
        b.stride(0) if grouped_b else 0,
        *b.stride()[-2:],
        out.stride(0) if k_bounds is not None else 0,
        *out.stride()[-2:],
        *sa.stride(),
        sb.stride(0) if grouped_b else 0,
        *sb.stride()[-2:],
        n,
        m if k_bounds is not None else triton.next_power_of_2(k),  # a weight gradient reduces over the token count
        int(tma_ok),
        HAS_BIAS=bias is not None,
        GROUP_M=grouped_b,
        GROUP_K=k_bounds is not None,
        TILE_B=b_tiles,
        EVEN_K=k_bounds is not None or k % BLOCK == 0,
        BLOCK_K=BLOCK,
        **consts,
    )


def _dequant_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.repeat_interleave(BLOCK, dim=-1)[..., : q.shape[-1]]


def _gemm_ref(a, sa, b, sb, out, bias, tile_group, k_bounds):
    with torch.autocast(a.device.type, enabled=False):
        ad, bd = _dequant_rows(a, sa), _dequant_rows(b, sb)
        if k_bounds is not None:
            bounds = k_bounds.tolist()
            for g in range(len(bounds) - 1):
                lo, hi = bounds[g], bounds[g + 1]
                out[g] = (ad[:, lo:hi] @ bd[:, lo:hi].T).to(out.dtype)
            return out
        if tile_group is not None:
            result = torch.zeros(out.shape, device=a.device)  # tiles past the last group stay zero
            for t, g in enumerate(tile_group.tolist()):
                if g >= 0:
                    rows = slice(t * BLOCK, (t + 1) * BLOCK)
                    result[rows] = ad[rows] @ bd[g].T
        else:
            result = ad @ bd.T
        if bias is not None:
            result = result + bias.float()
        return out.copy_(result)


# -- autograd ops --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Recipe:
    """How an op quantizes: the gradients' format, and the backend (triton: CUDA kernels or the interpreter;
    reference: the torch emulation)."""

    grad_format: Fp8Format = E4M3
    backend: str = "triton"
    gemm: str = "triton"  # dense GEMMs of fp8_mlp on CUDA: triton (ours) | cublas (torch's block-scaled scaled_mm)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"Fp8Recipe.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.gemm not in GEMMS:
            raise ValueError(f"Fp8Recipe.gemm must be one of {GEMMS}, got {self.gemm!r}")


GEMMS = ("triton", "cublas")


def _cublas_fits(a: torch.Tensor, n: int, recipe: Fp8Recipe) -> bool:
    m, k = a.shape
    # the reference backend's operands are fp32 carriers: its GEMMs are the emulation's fp32 matmuls
    cublas = recipe.gemm == "cublas" and recipe.backend == "triton" and a.is_cuda
    return cublas and k % BLOCK == 0 and n % BLOCK == 0 and m % 16 == 0


def _weight_gemm(a, sa, w, w_tiles, out_dtype, recipe: Fp8Recipe, bias=None) -> torch.Tensor:
    """a (M, K) 1x128-scaled @ w (N, K)^T with 128x128 tile scales `w_tiles` (N/128, K/128)."""
    n = w.shape[0]
    if not _cublas_fits(a, n, recipe):
        return gemm(a, sa, w, w_tiles, out_dtype, bias=bias, b_tiles=True, backend=recipe.backend)
    scale_b = w_tiles.contiguous().mT  # (K/128, N/128), K-major; cuBLAS wants its K blocks padded to a multiple of 4
    pad = -scale_b.shape[0] % 4
    if pad:
        padded = scale_b.new_ones(scale_b.shape[1], scale_b.shape[0] + pad).mT
        padded[: scale_b.shape[0]] = scale_b
        scale_b = padded
    kinds = F.ScalingType
    out = F.scaled_mm(a, w.mT, sa, kinds.BlockWise1x128, scale_b, kinds.BlockWise128x128, output_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias
    return out.to(out_dtype)


def _rows_gemm(a, sa, b, sb, out_dtype, recipe: Fp8Recipe) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T, both 1x128-scaled along K (weight gradients: K is the tokens)."""
    if not _cublas_fits(a, b.shape[0], recipe):
        return gemm(a, sa, b, sb, out_dtype, backend=recipe.backend)
    kinds = F.ScalingType  # both scales column-major (stride (1, rows)), as `quantize` stores them
    out = F.scaled_mm(a, b.mT, sa, kinds.BlockWise1x128, sb, kinds.BlockWise1x128, output_dtype=torch.bfloat16)
    return out.to(out_dtype)


MLP_ROLES = ("x", "w1", "act", "w2", "grad_out", "grad_hidden")
EXPERT_ROLES = ("x", "w13", "act", "w2", "grad_out", "grad_hidden")


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _gelu_grad(h: torch.Tensor) -> torch.Tensor:
    h = h.float()
    cdf = 0.5 * (1.0 + torch.erf(h * 0.7071067811865476))
    return cdf + h * torch.exp(-0.5 * h * h) * 0.3989422804014327


class _Fp8Mlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, recipe: Fp8Recipe, stats: Fp8Stats | None):
        shape, dtype, be = x.shape, _out_dtype(x), recipe.backend
        x2 = x.reshape(-1, shape[-1])
        xq = quantize(x2, E4M3, rows=True, cols=True, stats=stats, role=0, backend=be)
        w1q = quantize(w1.detach(), E4M3, tile=True, cols=True, stats=stats, role=1, backend=be)
        # gelu and both its quantizations in one pass over h (a quantizing epilogue in fc1's GEMM measured slower than
        # the GEMM and this pass: docs/benchmarks.md, 2026-12-02 09:24 UTC)
        h = _weight_gemm(xq["q"], xq["s"], w1q["q"], w1q["s"], dtype, recipe, bias=b1)
        gq = quantize(h, E4M3, rows=True, cols=True, act="gelu", stats=stats, role=2, backend=be)
        w2q = quantize(w2.detach(), E4M3, tile=True, cols=True, stats=stats, role=3, backend=be)
        y = _weight_gemm(gq["q"], gq["s"], w2q["q"], w2q["s"], dtype, recipe, bias=b2)
        ctx.save_for_backward(xq["qt"], xq["st"], h, gq["qt"], gq["st"], w1q["qt"], w1q["st"], w2q["qt"], w2q["st"])
        ctx.recipe, ctx.stats, ctx.shape, ctx.x_dtype = recipe, stats, shape, x.dtype
        ctx.has_bias = (b1 is not None, b2 is not None)
        ctx.w_dtypes = (w1.dtype, w2.dtype)
        return y.reshape(*shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xqt, xst, h, gqt, gst, w1qt, w1st, w2qt, w2st = ctx.saved_tensors
        recipe, stats, be, fmt = ctx.recipe, ctx.stats, ctx.recipe.backend, ctx.recipe.grad_format
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyq = quantize(dy2, fmt, rows=True, cols=True, colsum=ctx.has_bias[1], stats=stats, role=4, backend=be)
        dw2 = _rows_gemm(dyq["qt"], dyq["st"], gqt, gst, torch.float32, recipe)
        # dgrad of fc2 reduces over its outputs: w2^T's tiles, scales per row of w2^T; then gelu's backward, both
        # quantizations of dh and the bias gradient in one pass over dg and h
        dg = _weight_gemm(dyq["q"], dyq["s"], w2qt, w2st, h.dtype, recipe)
        bwd = {"act": "gelu_bwd", "gate": h, "colsum": ctx.has_bias[0], "stats": stats, "role": 5, "backend": be}
        dhq = quantize(dg, fmt, rows=True, cols=True, **bwd)
        dx = _weight_gemm(dhq["q"], dhq["s"], w1qt, w1st, ctx.x_dtype, recipe)
        dw1 = _rows_gemm(dhq["qt"], dhq["st"], xqt, xst, torch.float32, recipe)
        db1 = dhq.get("colsum")
        db2 = dyq.get("colsum")
        dw1, dw2 = dw1.to(ctx.w_dtypes[0]), dw2.to(ctx.w_dtypes[1])
        return dx.reshape(ctx.shape), dw1, db1, dw2, db2, None, None


def fp8_mlp(x, w1, b1, w2, b2, recipe: Fp8Recipe, stats: Fp8Stats | None) -> torch.Tensor:
    """fc2(gelu(fc1(x))) with nn.Linear weights w1 (hidden, dim), w2 (dim, hidden) and optional biases, through
    block-scaled FP8 GEMMs forward and backward. `stats`: roles `MLP_ROLES` (None: dynamic scales, no counters)."""
    return _Fp8Mlp.apply(x, w1, b1, w2, b2, recipe, stats)


def group_layout(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """For `rows` rows grouped by expert (`counts` per expert), pad each group to a multiple of 128 rows, with no
    host sync: (dest (rows,) padded row of each row, tile_group (capacity/128,) expert of each 128-row tile or -1,
    k_bounds (E + 1,) padded group starts, capacity)."""
    num = counts.numel()
    counts = counts.long()
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    ends = torch.cumsum(padded, 0)
    starts_padded, starts = ends - padded, torch.cumsum(counts, 0) - counts
    expert_of_row = torch.repeat_interleave(torch.arange(num, device=counts.device), counts, output_size=rows)
    dest = starts_padded[expert_of_row] + torch.arange(rows, device=counts.device) - starts[expert_of_row]
    capacity = (rows + num * (BLOCK - 1) + BLOCK - 1) // BLOCK * BLOCK
    tiles = capacity // BLOCK
    tile_start = torch.arange(tiles, device=counts.device) * BLOCK
    tile_group = torch.searchsorted(ends, tile_start, right=True)
    tile_group = torch.where(tile_group < num, tile_group, -1).to(torch.int32)
    k_bounds = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    return dest, tile_group, k_bounds, capacity


def _quantize_side_by_side(w1: torch.Tensor, w3: torch.Tensor, stats: Fp8Stats | None, backend: str) -> dict:
    """128x128 tiles of [w1 | w3] (E, dim, 2H), both ways: q (E, dim, 2H) and qt (E, 2H, dim). Where H is a whole
    number of tiles each half is quantized alone and the fp8 halves joined (no fp32 copy of the weights)."""
    if w1.shape[-1] % BLOCK:
        return quantize(torch.cat([w1, w3], dim=2), E4M3, tile=True, cols=True, stats=stats, role=1, backend=backend)
    halves = [quantize(w, E4M3, tile=True, cols=True, stats=stats, role=1, backend=backend) for w in (w1, w3)]
    q = torch.cat([h["q"] for h in halves], dim=2)
    s = torch.cat([h["s"] for h in halves], dim=2)
    return {"q": q, "s": s, "qt": torch.cat([h["qt"] for h in halves], dim=1), "st": s.transpose(-1, -2)}


class _Fp8GroupedSwiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w1, w3, w2, recipe: Fp8Recipe, stats: Fp8Stats | None):
        be, dtype = recipe.backend, _out_dtype(x)
        rows, dim = x.shape
        experts, _, hidden = w1.shape
        dest, tile_group, k_bounds, capacity = group_layout(counts, rows)
        xp = x.new_zeros(capacity, dim).index_copy(0, dest, x)
        xq = quantize(xp, E4M3, rows=True, cols=True, stats=stats, role=0, backend=be)
        # w1 and w3 side by side: one GEMM gives [h1 | h3]
        w13q = _quantize_side_by_side(w1.detach(), w3.detach(), stats, be)
        h13 = gemm(
            xq["q"],
            xq["s"],
            w13q["qt"],
            w13q["st"],
            dtype,
            tile_group=tile_group,
            b_tiles=True,
            backend=be,
        )
        h1, h3 = h13[:, :hidden], h13[:, hidden:]
        gq = quantize(h1, E4M3, rows=True, cols=True, act="swiglu", gate=h3, stats=stats, role=2, backend=be)
        w2q = quantize(w2.detach(), E4M3, tile=True, cols=True, stats=stats, role=3, backend=be)  # (E, H, dim)
        y = gemm(gq["q"], gq["s"], w2q["qt"], w2q["st"], dtype, tile_group=tile_group, b_tiles=True, backend=be)
        ctx.save_for_backward(
            dest, tile_group, k_bounds, xq["qt"], xq["st"], h13, gq["qt"], gq["st"], w13q["q"], w13q["s"], w2q["q"]
        )
        ctx.w2s = w2q["s"]
        ctx.recipe, ctx.stats, ctx.x_dtype, ctx.hidden, ctx.w_dtype = recipe, stats, x.dtype, hidden, w1.dtype
        return y[dest]

    @staticmethod
    def backward(ctx, dy):
        dest, tile_group, k_bounds, xqt, xst, h13, gqt, gst, w13q, w13s, w2q = ctx.saved_tensors
        recipe, stats, be, hidden = ctx.recipe, ctx.stats, ctx.recipe.backend, ctx.hidden
        fmt = recipe.grad_format
        dim = dy.shape[1]
        capacity = h13.shape[0]
        dyp = dy.new_zeros(capacity, dim).index_copy(0, dest, dy)
        dyq = quantize(dyp, fmt, rows=True, cols=True, stats=stats, role=4, backend=be)
        # dgrad of w2: reduce over dim; w2 (E, H, dim) is K-major for that
        dg = gemm(dyq["q"], dyq["s"], w2q, ctx.w2s, h13.dtype, tile_group=tile_group, b_tiles=True, backend=be)
        dw2 = gemm(gqt, gst, dyq["qt"], dyq["st"], torch.float32, k_bounds=k_bounds, backend=be)  # (E, H, dim)
        # SwiGLU's backward and both quantizations of [dh1 | dh3] in one pass over dg and h13
        dhq = quantize(dg, fmt, rows=True, cols=True, act="swiglu_bwd", gate=h13, stats=stats, role=5, backend=be)
        dxp = gemm(
            dhq["q"],
            dhq["s"],
            w13q,
            w13s,
            torch.float32,
            tile_group=tile_group,
            b_tiles=True,
            backend=be,
        )
        dw13 = gemm(xqt, xst, dhq["qt"], dhq["st"], torch.float32, k_bounds=k_bounds, backend=be)  # (E, dim, 2H)
        dw1, dw3, dw2 = (g.to(ctx.w_dtype) for g in (dw13[..., :hidden], dw13[..., hidden:], dw2))
        return dxp[dest].to(ctx.x_dtype), None, dw1, dw3, dw2, None, None


def fp8_grouped_swiglu(x_sorted, counts, w1, w3, w2, recipe: Fp8Recipe, stats: Fp8Stats | None) -> torch.Tensor:
    """MoE experts over `x_sorted` (rows grouped by expert, `counts[e]` rows each): (silu(x w1[e]) * x w3[e]) w2[e]
    with w1, w3 (E, dim, H), w2 (E, H, dim), block-scaled FP8 forward and backward. `stats`: roles `EXPERT_ROLES`
    (None: dynamic scales, no counters)."""
    return _Fp8GroupedSwiglu.apply(x_sorted, counts, w1, w3, w2, recipe, stats)
