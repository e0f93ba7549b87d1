"""FP8 attention forward (`KernelOptions.fp8`): QK^T and PV on e4m3 operands with per-block scales, the softmax or
GDPA activation in fp32, fp32 accumulation. The backward stays the bf16 kernels' (autograd saves the 16-bit inputs).

Scales (one fp32 per block, amax / 448; an all-zero block gets 1):
- k and v: per 128-key tile of each sequence (`SCALE_ROWS`) and head, by `quantize_kv` (one launch, both tensors;
  v written transposed, (heads, head_dim, tiles x 128), so that PV's operand is K-major as the FP8 tensor cores want
  it, each tile's columns 128-aligned for 16-byte loads).
- q: per query block of the program (the tile's BLOCK_M rows: 64 or 128 on the GPU) and head, in the kernel's load.
  Scores = (q8 k8^T) * s_q * s_k, in fp32.
- softmax weights: p = exp2(s - m + 8), in [0, 256] against the running row max (no scale to compute; the exponent
  offset keeps probabilities down to 2^-17 instead of e4m3's 2^-9); the accumulator's scale is the largest v scale
  so far, and a key tile with a smaller one folds the ratio into that exponent (no per-tile product to rescale).
- GDPA activations: per row and key tile, amax / 448, folded the same way into a per-row accumulator scale.

k and v tiles come through pointers (16-byte cp.async loads) or tensor descriptors (TMA; `KernelOptions.tma`), the
autotuner choosing among 64/128-row tiles of both (`CONFIGS["fwd_fp8"]`).

The CPU emulation (`reference.attention_reference(fp8=True)`, what `backend="reference"` runs with the option) rounds
q, k, v on 128-row tiles, the softmax weights (unnormalized, times 256) and the activations (per row and 128-key block)
to e4m3 and computes in fp32. Under the Triton interpreter the quantized operands are fp32 carriers of fp8-grid
values (`fp8._round_fp8`), as in `fp8.py`.

Not supported (a clear error from `ops`): RoPE (`rope_base`). Every other option of the bf16 forward is: causal,
window and block masks (as masks of the tiled kernel), score biases, shared query or key sequences, head dims 16-256.
"""

import torch
import triton
import triton.language as tl
from gemrec.kernels.fp8 import E4M3, _round_fp8, block_scale, quantize_reference
from gemrec.kernels.options import KernelOptions
from gemrec.kernels.triton_attention import (
    _KERNELS,
    CONFIGS,
    INTERPRET,
    _activation,
    _bias,
    _cdiv,
    _cfg,
    _fwd_store,
    _Kernel,
    _key_tiles,
    _seq_info,
    _tanh,
    _visible,
)

SCALE_ROWS = 128  # key rows per k/v scaling tile
ROWS = tl.constexpr(SCALE_ROWS)
FP8_MAX = tl.constexpr(E4M3.max)
P_OFFSET = tl.constexpr(8.0)  # softmax weights in [0, 2^8] before rounding to e4m3
P_UNIT = tl.constexpr(2.0**-8)  # 2^-P_OFFSET
LOG2E = tl.constexpr(1.4426950408889634)
# A key tile whose v scale is below 2^(8 - 96) of the largest so far in its sequence gets its softmax weights at that
# floor (its values count as if 2^104 below the largest): keeps the weights' sum exact in fp32.
OFFSET_FLOOR = tl.constexpr(-96.0)
TINY = tl.constexpr(1e-30)  # floor of a GDPA row's accumulator scale (an all-zero row so far)


@triton.jit
def _fp8_operand(x, EMULATE: tl.constexpr):
    """x (within +-448) as a dot's fp8 operand: the hardware's cast to e4m3, the same values as torch's (fp32 on the
    e4m3 grid under the interpreter)."""
    if EMULATE:
        return _round_fp8(x, 3, -6)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def _quantize_kv_kernel(
    K,
    V,
    K8,
    VT8,
    KS,
    VS,
    kv_off,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_8t,
    stride_8h,
    stride_th,
    stride_td,
    num_heads,
    num_tiles,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """One (128-key tile, head, sequence): k to K8 (rows, heads, head_dim), v to VT8 (heads, head_dim, tile
    columns): column (b * num_tiles + j) * 128 + r holds row r of sequence b's tile j (aligned 16-byte loads)."""
    j, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(kv_off + b).to(tl.int64)
    length = (tl.load(kv_off + b + 1) - start).to(tl.int32)
    if j * ROWS >= length:
        return
    offs_r = j * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_r < length)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = start + offs_r
    tile = (b * num_tiles + j) * num_heads + h
    k = tl.load(K + rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(k), 1), 0)
    sk = tl.where(amax == 0.0, 1.0, tl.div_rn(amax, FP8_MAX))
    k8 = _fp8_operand(tl.div_rn(k, sk), EMULATE)
    tl.store(K8 + rows[:, None] * stride_8t + h * stride_8h + offs_d[None, :], k8, mask=mask)
    tl.store(KS + tile, sk)
    v = tl.load(V + rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(v), 1), 0)
    sv = tl.where(amax == 0.0, 1.0, tl.div_rn(amax, FP8_MAX))
    v8 = _fp8_operand(tl.div_rn(v, sv), EMULATE)
    columns = (b * num_tiles + j) * ROWS + tl.arange(0, ROWS)
    # the whole tile: zeros past the sequence's end, so the forward reads its last tile unmasked
    tl.store(
        VT8 + h * stride_th + offs_d[None, :] * stride_td + columns[:, None], v8, mask=(offs_d < HEAD_DIM)[None, :]
    )
    tl.store(VS + tile, sv)


@triton.jit
def _fp8_tile(
    acc,
    m_i,
    l_i,
    c_i,
    q8,
    K8,
    VT8,
    KS,
    VS,
    n0,
    kv_start,
    kv_len,
    tile0,
    shift,
    h,
    o_start,
    offs_m,
    offs_n,
    offs_d,
    row_ok,
    d_ok,
    stride_kt,
    stride_kh,
    stride_th,
    stride_td,
    num_heads,
    s_scale,
    score_scale,
    AB,
    stride_abt,
    stride_abh,
    PT,
    stride_pth,
    TT,
    stride_tth,
    QTS,
    KTS,
    pos_log_inv,
    time_log_inv,
    MODE: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_AB: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    NUM_POS: tl.constexpr,
    NUM_TIME: tl.constexpr,
    EVEN_D: tl.constexpr,
    FAST: tl.constexpr,
    SCALE_POS: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    EMULATE: tl.constexpr,
    TMA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One (queries x keys) tile: FP8 QK^T, fp32 softmax (MODE 0) or activation, FP8 PV into acc (scale c_i). With
    TMA, K8 and VT8 are descriptors over all rows (`_fwd_fp8_kernel`): k rows past the sequence are the next one's,
    which the masked tiles mask like any key past the end."""
    cols = n0 + offs_n
    col_ok = cols < kv_len
    if TMA:
        k = K8.load([(kv_start + n0).to(tl.int32), h * HEAD_DIM])
        vt = VT8.load([h * HEAD_DIM, (tile0 * ROWS + n0).to(tl.int32)])
    else:
        kv_rows = kv_start + cols
        k_ptrs = K8 + kv_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :]
        v_ptrs = VT8 + h * stride_th + offs_d[:, None] * stride_td + (tile0 * ROWS + cols)[None, :]
        if MASKED or not EVEN_D:
            k = tl.load(k_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if EVEN_D:  # v's tiles are whole (zeros past the end): 16-byte loads along the keys
            vt = tl.load(v_ptrs)
        else:
            vt = tl.load(v_ptrs, mask=d_ok[:, None], other=0.0)
    tile = (tile0 + n0 // ROWS) * num_heads + h
    sk = tl.load(KS + tile)
    sv = tl.load(VS + tile)
    qk = tl.dot(q8, tl.trans(k))
    HAS_BIAS: tl.constexpr = HAS_AB or HAS_POS or HAS_TIME
    if HAS_BIAS:
        s = qk * (score_scale * sk) + _bias(
            offs_m[:, None],
            cols[None, :],
            row_ok[:, None],
            col_ok[None, :],
            shift,
            h,
            o_start,
            kv_start,
            AB,
            stride_abt,
            stride_abh,
            PT,
            stride_pth,
            TT,
            stride_tth,
            QTS,
            KTS,
            pos_log_inv,
            time_log_inv,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
        )
    if MASKED:
        valid = col_ok[None, :]
        if CAUSAL or WINDOW > 0 or MASK_BLOCK > 0:
            valid = valid & _visible(offs_m[:, None] + shift, cols[None, :], CAUSAL, WINDOW, MASK_BLOCK)
    if MODE == 0:
        ss = 1.0
        if HAS_BIAS:
            s = s * LOG2E
        elif SCALE_POS:  # the scale goes into the exp2's FMA below
            s = qk
            ss = s_scale * sk
        else:
            s = qk * (s_scale * sk)
        if MASKED:
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * ss)
        if MASKED or HAS_BIAS:  # a row that sees no key yet (or only -inf biases) keeps m = -inf
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        c_new = tl.maximum(c_i, sv)
        # in [-96, 8]: this tile's v scale against the accumulator's (floored: `OFFSET_FLOOR`)
        off = tl.maximum(P_OFFSET + tl.math.log2(sv / c_new), OFFSET_FLOOR)
        p = tl.math.exp2(s * ss - (m_safe - off)[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1) * tl.math.exp2(-off)
        acc = tl.dot(_fp8_operand(p, EMULATE), tl.trans(vt), acc * (alpha * (c_i / c_new))[:, None])
        m_i = m_new
    else:
        if MODE == 1 and FAST and not HAS_BIAS:  # silu(s) = u + u * tanh(u), u = s / 2
            u = qk * (0.5 * score_scale * sk)
            a = u + u * _tanh(u, FAST)
        else:
            if not HAS_BIAS:
                s = qk * (score_scale * sk)
            a, _ = _activation(s, MODE, FAST)
        if MASKED:
            a = tl.where(valid, a, 0.0)
        # this tile's row amax against the row's accumulator scale: a * sv / c_new <= 448
        c_new = tl.maximum(tl.maximum(c_i, tl.max(tl.abs(a), 1) * (sv / FP8_MAX)), TINY)
        a8 = _fp8_operand(a * (sv / c_new)[:, None], EMULATE)
        acc = tl.dot(a8, tl.trans(vt), acc * (c_i / c_new)[:, None])
    return acc, m_i, l_i, c_new


@triton.jit
def _fwd_fp8_kernel(
    Q,
    K8,
    VT8,
    KS,
    VS,
    Out,
    LSE,
    AB,
    PT,
    TT,
    QTS,
    KTS,
    RF,
    q_off,
    kv_off,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_abt,
    stride_abh,
    stride_pth,
    stride_tth,
    scale,
    qk_scale,
    inv_max_len,
    pos_log_inv,
    time_log_inv,
    stride_th,
    stride_td,
    num_heads,
    num_tiles,
    num_k_rows,
    num_vt_cols,
    HEAD_DIM: tl.constexpr,
    MODE: tl.constexpr,
    CAUSAL: tl.constexpr,
    NORM: tl.constexpr,
    Q_STRIDE: tl.constexpr,
    KV_STRIDE: tl.constexpr,
    HAS_AB: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    NUM_POS: tl.constexpr,
    NUM_TIME: tl.constexpr,
    FAST: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_POS: tl.constexpr,
    EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    tl.static_assert(not ROPE, "the FP8 forward has no RoPE")
    tl.static_assert(ROWS % BLOCK_N == 0, "key tiles must not straddle a scaling tile")
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start, _ = _seq_info(q_off, kv_off, b, Q_STRIDE, KV_STRIDE)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    shift = kv_len - q_len
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(q), 1), 0)
    sq = tl.where(amax == 0.0, 1.0, amax / FP8_MAX)
    q8 = _fp8_operand(q / sq, EMULATE)
    s_scale = qk_scale * sq
    score_scale = scale * sq
    tile0 = b * KV_STRIDE * num_tiles
    if TMA:  # over every row (K8: rows x heads * head_dim; VT8: heads * head_dim x tile columns), contiguous
        tl.static_assert(EVEN_D, "descriptor tiles cover whole heads")
        K8 = tl.make_tensor_descriptor(
            K8, shape=[num_k_rows, num_heads * HEAD_DIM], strides=[stride_kt, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        VT8 = tl.make_tensor_descriptor(
            VT8, shape=[num_heads * HEAD_DIM, num_vt_cols], strides=[stride_td, 1], block_shape=[BLOCK_D, BLOCK_N]
        )
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if MODE == 0:
        c_i = sq * 0.0  # the accumulator's scale: the largest v scale so far
    else:
        c_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # per row
    n_start, n_mid, n_full, n_end = _key_tiles(
        m0 + shift, m0 + BLOCK_M - 1 + shift, kv_len, CAUSAL, WINDOW, MASK_BLOCK, BLOCK_N
    )
    # keys only the later rows see (window, block), keys every row sees, then the diagonal / ragged end
    for n0 in range(n_start, n_mid, BLOCK_N):
        acc, m_i, l_i, c_i = _fp8_tile(
            acc, m_i, l_i, c_i, q8, K8, VT8, KS, VS, n0, kv_start, kv_len, tile0, shift, h, o_start, offs_m, offs_n,
            offs_d, row_ok, d_ok, stride_kt, stride_kh, stride_th, stride_td, num_heads, s_scale, score_scale, AB,
            stride_abt, stride_abh, PT, stride_pth, TT, stride_tth, QTS, KTS, pos_log_inv, time_log_inv, MODE, CAUSAL,
            True, HAS_AB, HAS_POS, HAS_TIME, NUM_POS, NUM_TIME, EVEN_D, FAST, SCALE_POS, WINDOW, MASK_BLOCK, EMULATE,
            TMA, HEAD_DIM,
        )  # fmt: skip
    for n0 in range(n_mid, n_full, BLOCK_N):
        acc, m_i, l_i, c_i = _fp8_tile(
            acc, m_i, l_i, c_i, q8, K8, VT8, KS, VS, n0, kv_start, kv_len, tile0, shift, h, o_start, offs_m, offs_n,
            offs_d, row_ok, d_ok, stride_kt, stride_kh, stride_th, stride_td, num_heads, s_scale, score_scale, AB,
            stride_abt, stride_abh, PT, stride_pth, TT, stride_tth, QTS, KTS, pos_log_inv, time_log_inv, MODE, CAUSAL,
            False, HAS_AB, HAS_POS, HAS_TIME, NUM_POS, NUM_TIME, EVEN_D, FAST, SCALE_POS, WINDOW, MASK_BLOCK, EMULATE,
            TMA, HEAD_DIM,
        )  # fmt: skip
    for n0 in range(n_full, n_end, BLOCK_N):
        acc, m_i, l_i, c_i = _fp8_tile(
            acc, m_i, l_i, c_i, q8, K8, VT8, KS, VS, n0, kv_start, kv_len, tile0, shift, h, o_start, offs_m, offs_n,
            offs_d, row_ok, d_ok, stride_kt, stride_kh, stride_th, stride_td, num_heads, s_scale, score_scale, AB,
            stride_abt, stride_abh, PT, stride_pth, TT, stride_tth, QTS, KTS, pos_log_inv, time_log_inv, MODE, CAUSAL,
            True, HAS_AB, HAS_POS, HAS_TIME, NUM_POS, NUM_TIME, EVEN_D, FAST, SCALE_POS, WINDOW, MASK_BLOCK, EMULATE,
            TMA, HEAD_DIM,
        )  # fmt: skip
    if MODE == 0:
        acc = acc * (c_i * P_UNIT)
    else:
        acc = acc * c_i[:, None]
    _fwd_store(
        acc,
        m_i,
        l_i,
        Out,
        LSE,
        o_start + offs_m,
        row_ok,
        d_ok,
        offs_d,
        stride_ot,
        stride_oh,
        h,
        num_heads,
        kv_len,
        inv_max_len,
        MODE,
        NORM,
    )


# Key tiles of 64 or 128 rows (within a 128-row scaling tile), through pointers or descriptors (TMA); 128 x 128
# first (A's best bf16 tile).
CONFIGS["fwd_fp8"] = [
    _cfg(128, 128, 8, 3),
    _cfg(128, 64, 8, 3),
    _cfg(128, 128, 8, 2),
    _cfg(128, 64, 8, 4),
    _cfg(64, 128, 4, 3),
    _cfg(64, 64, 4, 3),
    _cfg(128, 128, 8, 3, True),
    _cfg(128, 128, 8, 2, True),
    _cfg(128, 128, 8, 4, True),
    _cfg(128, 64, 8, 3, True),
    _cfg(64, 128, 4, 3, True),
    _cfg(64, 64, 4, 3, True),
]
_KERNELS["fwd_fp8"] = _Kernel(_fwd_fp8_kernel, "fwd_fp8")
CONFIGS["fp8_kv"] = [{"num_warps": 8, "num_stages": 1}]
_KERNELS["fp8_kv"] = _Kernel(_quantize_kv_kernel, "fp8_kv")
DEFAULT_OPTIONS = KernelOptions()


def carrier_dtype() -> torch.dtype:
    """The quantized operands' dtype: e4m3, or fp32 on the e4m3 grid under the interpreter."""
    return torch.float32 if INTERPRET else E4M3.dtype


def quantize_kv(k: torch.Tensor, v: torch.Tensor, kv_offsets: torch.Tensor, max_kv_len: int):
    """(k8 (rows, heads, head_dim), vt8 (heads, head_dim, sequences * tiles * 128), k scales, v scales, tiles per
    sequence): k and v in e4m3 with one scale per 128-key tile of each sequence and head; sequence b's tile j is
    index i = b * tiles + j: its scales at i * heads + h, its v columns from i * 128 (zeros past its end)."""
    rows, heads, head_dim = k.shape
    num_seqs = kv_offsets.numel() - 1
    tiles = _cdiv(max_kv_len, SCALE_ROWS)
    carrier = carrier_dtype()
    k8 = torch.empty((rows, heads, head_dim), dtype=carrier, device=k.device)
    ks = torch.empty((max(num_seqs * tiles, 1), heads), dtype=torch.float32, device=k.device)
    vt8 = torch.empty((heads, head_dim, ks.shape[0] * SCALE_ROWS), dtype=carrier, device=k.device)
    vs = torch.empty_like(ks)
    if tiles and num_seqs and rows:
        args = (k, v, k8, vt8, ks, vs, kv_offsets, *k.stride()[:2], *v.stride()[:2], *k8.stride()[:2])
        args += (*vt8.stride()[:2], heads, tiles)
        consts = {"HEAD_DIM": head_dim, "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), "EMULATE": INTERPRET}
        _KERNELS["fp8_kv"](lambda meta: (tiles, heads, num_seqs), args, consts, 0, DEFAULT_OPTIONS)
    return k8, vt8, ks, vs, tiles


def forward(p, out: torch.Tensor, lse: torch.Tensor):
    """The FP8 forward of a `triton_attention.Problem` into out (its dtype) and lse (log2-domain, as the bf16
    forward's: the backward's input)."""
    k8, vt8, ks, vs, tiles = quantize_kv(p.k, p.v, p.kv_off, p.max_kv_len)
    tail = (*vt8.stride()[:2], p.heads, tiles, k8.shape[0], vt8.shape[2])
    args = p.kernel_args((p.q, k8, vt8, ks, vs, out, lse), (p.q, k8, out), qk_scale=True, tail=tail)
    block_d = max(32, p.block_d)
    consts = {**p.consts, "BLOCK_D": block_d, "SCALE_POS": p.scale > 0, "EMULATE": INTERPRET}

    def grid(meta):
        return (_cdiv(max(p.max_q_len, 1), meta["BLOCK_M"]), p.heads, p.num_seqs)

    # descriptors need whole heads (head_dim a power of two >= 32) and 16-byte row strides; k8 and vt8 are contiguous
    _KERNELS["fwd_fp8"](grid, args, consts, p.bucket, p.options, tma=block_d == p.head_dim)
    return out, lse


# -- the CPU emulation's quantization (`reference.attention_reference(fp8=True)`) ------------------------------


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (within +-448) rounded to e4m3 in the forward; the gradient passes straight through."""
    rounded = x.detach().clamp(-E4M3.max, E4M3.max).to(E4M3.dtype).to(x.dtype)
    return x + (rounded - x.detach())


def quantize_tiles_reference(x: torch.Tensor, offsets: list[int], rows: int = SCALE_ROWS) -> torch.Tensor:
    """(total, heads, head_dim) -> fp32 dequantized e4m3 values, one scale (amax / 448) per `rows`-row tile of each
    sequence (`offsets`, host ints) and head, as `quantize_kv` does; gradients pass straight through."""
    lengths = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])], dtype=torch.long)
    if x.shape[0] == 0 or lengths.sum() == 0:
        return x.float()
    starts = torch.tensor(offsets[:-1], dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    pos = torch.arange(x.shape[0]) - starts[seq]
    first_tile = torch.cumsum(-(-lengths // rows), 0) - (-(-lengths // rows))
    tile = (first_tile[seq] + pos // rows).to(x.device)
    xf = x.float()
    amax = torch.zeros(int(tile.max()) + 1, x.shape[1], device=x.device)
    amax = amax.scatter_reduce(0, tile[:, None].expand(-1, x.shape[1]), xf.detach().abs().amax(-1), "amax")
    scale = block_scale(amax, E4M3)[tile][:, :, None]
    return round_e4m3(xf / scale) * scale


def quantize_weights_reference(weights: torch.Tensor, softmax: bool) -> torch.Tensor:
    """The attention weights (..., queries, keys) as the PV product's e4m3 operand, in fp32: softmax weights (rows
    summing to 1) as the kernel rounds them, 2^8 times their ratio to the row's largest; activations with one scale
    per row and 128-key block."""
    if softmax:
        top = weights.detach().amax(-1, keepdim=True)
        top = torch.where(top > 0, top, torch.ones_like(top))
        return round_e4m3(weights * (1.0 / P_UNIT.value / top)) * (top * P_UNIT.value)
    shape = weights.shape
    flat = weights.reshape(-1, shape[-1])
    _, scales = quantize_reference(flat.detach(), E4M3, (1, SCALE_ROWS))
    full = scales.repeat_interleave(SCALE_ROWS, dim=-1)[:, : shape[-1]]
    return (round_e4m3(flat / full) * full).reshape(shape)
