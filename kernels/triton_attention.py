"""Triton kernels for jagged softmax attention (JFA) and generalized dot-product attention (GDPA).

One kernel family serves both ops: `MODE == 0` is softmax attention, other modes are pointwise
activations (see `ACTIVATIONS`). Every program works on one (query block, head, sequence) or
(key block, head, sequence) tile of the jagged layout `(total_tokens, heads, head_dim)`; nothing is
padded. Scores are `scale * q.k + attn_bias + pos_table[bucket(rel_pos)] + time_table[bucket(dt)]`.

Masks: each query position sees one interval of keys (`_key_range`: causal, WINDOW, MASK_BLOCK), monotone in the
position, so a block of queries loops over the key tiles some row sees in up to three runs (`_key_tiles`): masked
tiles only later rows see, unmasked ones every row sees whole, masked ones at the diagonal and the far edge; the
backward's key blocks likewise over query tiles (`_query_tiles`). Tiles no row sees are never visited. Without a
window or block mask the loops are the plain causal ones, bit for bit. RoPE (ROPE, buffer `rope_table`): q and k
tiles are rotated as they load (`_rope_load`, halves interleaved: q.k unchanged; the forward's keys and the dK/dV
kernel's queries also through descriptors of half rows), cos/sin read from a table of every position in the inputs'
dtype, the rotation in that dtype, as a separate rotary does it (`_rope_rotate`); gradients w.r.t. rotated tiles are
rotated back in fp32 registers by cos/sin computed in fp32 before they are stored (`_rope_store`; the dK/dV kernel's dQ
partials are added up rotated and rotated back once, `_rope_dq_kernel`); no rotated copy in memory.

Backward: without score biases one kernel per key block computes dK, dV and adds its share of dQ into an
fp32 buffer with atomics (5 matmuls per tile pair); with biases (whose gradients come from dQ-side tiles) or
when the key sequences are short (few key blocks per query, where the atomics would cost more than the
recompute) a second kernel per query block computes dQ (7 matmuls per tile pair). With `KernelOptions.one_launch`
(off by default: on the GPU it was not faster), problems below ONE_LAUNCH_MAX_WORK, which
are bound by host launch time rather than by the GPU, with head dims up to 128 run the whole backward as one launch
(`_bwd_one_launch_kernel`: the dK/dV and the dQ programs in one grid, the softmax delta computed in-kernel, dQ
stored directly; biases allowed): 2 launches per forward+backward instead of 4-5 (torch's zero fills of bias
gradients and the reductions of shared queries/keys aside, which both paths have).

Where one side's sequences all fit one tile (`Problem.resident`: cross-attention to a few tokens, PMA seeds), that
side stays loaded while each program walks CHUNK rows of the other, so the loop prefetches the next streamed tile
while this one computes (programs with a single tile each cannot overlap their loads and math); the backward is then
a single kernel that stores the streamed side's gradients and adds the resident side's into fp32 buffers (atomics).

Tiles that an inner loop streams (K/V in the forward and dQ kernels, Q/dO in dK/dV) come either through pointer
tensors or, where the layout allows (`tma_ok`) and `KernelOptions.tma` is on, through per-sequence tensor descriptors
built on the device (TMA on Hopper: no per-element addresses in registers, zeros past the sequence's end); the
autotuner picks per kernel.

Launches go through `_Kernel`: tiles autotuned once per (variant, head dim, bucketed lengths), candidates
compiled in parallel and timed in short bursts, the best few timed again after a warm-up (`TUNE_FINALISTS`), then
the compiled kernel is launched directly (no per-call argument binding). On Hopper the activation forward also times
a warp-specialized Gluon kernel (`gluon_attention`, `GLUON_CONFIGS`) and keeps it where it is faster.

With `TRITON_INTERPRET=1` set before triton is first imported, the same kernels run on CPU tensors
(triton's own `tl.*` helpers are decorated at import, so it cannot be switched on later).
"""

import functools
import inspect
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl
from gemrec.kernels.options import KernelOptions
from triton.runtime.errors import OutOfResources

INTERPRET = bool(triton.knobs.runtime.interpret)
LOG2E = 1.4426950408889634
ACTIVATIONS = {"softmax": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4, "relu2": 5}
NORMALIZE = {"none": 0, "kv_len": 1, "max_len": 2}

if INTERPRET:
    from triton.runtime import interpreter as _interpreter

    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor_numpy24(tensor, scope):
        """The interpreter's scalars are 1-element arrays, which numpy >= 2.4 refuses to int(): loop bounds."""
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if _patch_lang_tensor.__name__ != _patch_lang_tensor_numpy24.__name__:
        _interpreter._patch_lang_tensor = _patch_lang_tensor_numpy24


@triton.jit
def _sigmoid(x):
    return tl.math.fdiv(1.0, 1.0 + tl.math.exp2(x * -1.4426950408889634))


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh; FAST: the hardware approximation (one MUFU op, abs error < 2^-10.9), else exact via sigmoid."""
    if FAST:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 2.0 * _sigmoid(2.0 * x) - 1.0


@triton.jit
def _activation(s, ACT: tl.constexpr, FAST: tl.constexpr):
    """Pointwise activation and its derivative, in fp32."""
    if ACT == 1:
        if FAST:
            sig = 0.5 + 0.5 * _tanh(0.5 * s, FAST)  # one MUFU op instead of exp2 + reciprocal
        else:
            sig = _sigmoid(s)
        a = s * sig
        da = sig * (1.0 + s * (1.0 - sig))
    elif ACT == 2:
        cdf = 0.5 * (1.0 + tl.erf(s * 0.7071067811865476))
        a = s * cdf
        da = cdf + s * tl.exp(-0.5 * s * s) * 0.3989422804014327
    elif ACT == 3:
        u = 0.7978845608028654 * (s + 0.044715 * s * s * s)
        t = _tanh(u, FAST)
        a = 0.5 * s * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * s * s)
    elif ACT == 4:
        a = tl.maximum(s, 0.0)
        da = tl.where(s > 0.0, 1.0, 0.0)
    else:
        r = tl.maximum(s, 0.0)
        a = r * r
        da = 2.0 * r
    return a, da


@triton.jit
def _pos_bucket(rel, NUM_POS: tl.constexpr, pos_log_inv):
    """|rel| exactly below NUM_POS // 2, log-spaced above, clamped to the last bucket."""
    d = tl.abs(rel)
    df = tl.maximum(d, NUM_POS // 2).to(tl.float32)
    large = NUM_POS // 2 + (tl.log(df / (NUM_POS // 2)) * pos_log_inv).to(tl.int32)
    return tl.where(d < NUM_POS // 2, d, tl.minimum(large, NUM_POS - 1))


@triton.jit
def _time_bucket(dt, NUM_TIME: tl.constexpr, time_log_inv):
    """floor(log(max(|dt|, 1)) / log(base)), clamped to the last bucket."""
    dtf = tl.abs(dt).to(tl.float32)
    b = (tl.log(tl.maximum(dtf, 1.0)) * time_log_inv).to(tl.int32)
    return tl.minimum(b, NUM_TIME - 1)


UNBOUNDED = tl.constexpr(1 << 30)  # an end of a key or query range that no mask sets


@triton.jit
def _key_range(pos, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK_BLOCK: tl.constexpr):
    """Keys [lo, hi) that a query at position `pos` (a scalar or a tensor) sees, before clipping to the sequence:
    causal j <= pos; WINDOW: pos - W < j (and j < pos + W when not causal); MASK_BLOCK: the same block of keys."""
    lo = pos * 0
    hi = pos * 0 + UNBOUNDED
    if CAUSAL:
        hi = pos + 1
    if WINDOW > 0:
        lo = pos - (WINDOW - 1)
        if not CAUSAL:
            hi = pos + WINDOW
    if MASK_BLOCK > 0:
        start = tl.where(pos >= 0, pos // MASK_BLOCK * MASK_BLOCK, pos - MASK_BLOCK)  # negative: a block of no key
        lo = tl.maximum(lo, start)
        hi = tl.minimum(hi, start + MASK_BLOCK)
    return lo, hi


@triton.jit
def _query_range(key, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK_BLOCK: tl.constexpr):
    """Query positions [lo, hi) that see key `key` (>= 0): the inverse of `_key_range`."""
    lo = key * 0 - UNBOUNDED
    hi = key * 0 + UNBOUNDED
    if CAUSAL:
        lo = key
    if WINDOW > 0:
        hi = key + WINDOW
        if not CAUSAL:
            lo = key - (WINDOW - 1)
    if MASK_BLOCK > 0:
        start = key // MASK_BLOCK * MASK_BLOCK
        lo = tl.maximum(lo, start)
        hi = tl.minimum(hi, start + MASK_BLOCK)
    return lo, hi


@triton.jit
def _key_tiles(
    pos_first,
    pos_last,
    kv_len,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The key tiles a block of queries at positions [pos_first, pos_last] loops over: [n_start, n_mid) masked (keys
    only its later rows see; with a window or block mask), [n_mid, n_full) unmasked (every row sees every key),
    [n_full, n_end) masked (the causal diagonal, the mask's far edge, the sequence's ragged end)."""
    lo_first, hi_first = _key_range(pos_first, CAUSAL, WINDOW, MASK_BLOCK)
    lo_last, hi_last = _key_range(pos_last, CAUSAL, WINDOW, MASK_BLOCK)
    n_end = tl.minimum(kv_len, hi_last)
    n_full = tl.maximum(tl.minimum(kv_len, hi_first), 0) // BLOCK_N * BLOCK_N
    n_start = 0
    n_mid = 0
    if WINDOW > 0 or MASK_BLOCK > 0:
        n_start = tl.maximum(lo_first, 0) // BLOCK_N * BLOCK_N
        n_stop = tl.maximum(tl.cdiv(n_end, BLOCK_N) * BLOCK_N, n_start)
        n_mid = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(lo_last, 0), BLOCK_N) * BLOCK_N, n_start), n_stop)
        n_full = tl.maximum(n_full, n_mid)
    return n_start, n_mid, n_full, n_end


@triton.jit
def _query_tiles(
    key_first,
    key_last,
    shift,
    q_len,
    ragged,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The query row tiles a block of keys [key_first, key_last] loops over: [m_start, m_full) masked (rows that see
    only its later keys), [m_full, m_tail) unmasked (every row sees every key; none when the key block is `ragged`),
    [m_tail, m_end) masked (the mask's far edge, the ragged last query tile)."""
    lo_first, hi_first = _query_range(key_first, CAUSAL, WINDOW, MASK_BLOCK)
    lo_last, hi_last = _query_range(key_last, CAUSAL, WINDOW, MASK_BLOCK)
    m_start = 0
    m_full = 0
    if CAUSAL or WINDOW > 0 or MASK_BLOCK > 0:
        m_start = tl.maximum(lo_first - shift, 0) // BLOCK_M * BLOCK_M
        m_full = tl.minimum(tl.cdiv(tl.maximum(lo_last - shift, 0), BLOCK_M) * BLOCK_M, q_len)
    m_end = q_len
    m_tail = tl.maximum(q_len // BLOCK_M * BLOCK_M, m_full)
    if WINDOW > 0 or MASK_BLOCK > 0:
        m_end = tl.maximum(tl.minimum(hi_last - shift, q_len), 0)
        m_full = tl.maximum(tl.minimum(m_full, tl.cdiv(m_end, BLOCK_M) * BLOCK_M), m_start)
        m_tail = tl.maximum(tl.maximum(tl.minimum(hi_first - shift, q_len), 0) // BLOCK_M * BLOCK_M, m_full)
    if ragged:
        m_tail = m_full
    return m_start, m_full, m_tail, m_end


@triton.jit
def _visible(pos, cols, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK_BLOCK: tl.constexpr):
    """Which keys `cols` the queries at positions `pos` see (broadcast); callers check cols < kv_len."""
    if WINDOW == 0 and MASK_BLOCK == 0:
        ok = cols <= pos
    else:
        lo, hi = _key_range(pos, CAUSAL, WINDOW, MASK_BLOCK)
        ok = (cols >= lo) & (cols < hi)
    return ok


@triton.jit
def _rope_cos_sin(pos, RF, BLOCK_D: tl.constexpr, FAST: tl.constexpr):
    """cos and sin, (rows, BLOCK_D // 2) fp32, of the rotary angles pos * theta^(-2m/D). RF holds each frequency in
    turns per position as hi + lo with hi of 8 significant bits, so pos * hi is exact (|pos| < 2^16) and the angle is
    reduced to within half a turn before any rounding: accurate at every position, not only small ones. The whole
    turns go by adding and subtracting 1.5 * 2^23 (the nearest integer for |t| < 2^22): two fp32 adds instead of a
    floor (an FRND in SASS, beside the two MUFU ops)."""
    offs = tl.arange(0, BLOCK_D // 2)
    hi = tl.load(RF + offs)
    lo = tl.load(RF + BLOCK_D // 2 + offs)
    p = pos.to(tl.float32)[:, None]
    t = p * hi[None, :]
    t = t - ((t + 12582912.0) - 12582912.0)
    a = (t + p * lo[None, :]) * 6.283185307179586
    if FAST:
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1)
    else:
        c = tl.cos(a)
        s = tl.sin(a)
    return c, s


@triton.jit
def _rope_origin(RF, X, BLOCK_D: tl.constexpr, ROPE: tl.constexpr):
    """Position 0's row of the cos/sin table in RF (`rope_table`), in X's dtype: BLOCK_D // 2 cos then BLOCK_D // 2
    sin per position, positions -ROPE to ROPE - 1."""
    return (RF + BLOCK_D).to(X.dtype, bitcast=True) + ROPE * BLOCK_D


@triton.jit
def _rope_desc(RF, X, first, length, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr):
    """Tensor descriptor over the cos/sin rows of positions first .. first + length - 1 (`_rope_origin`), in boxes of
    BLOCK_R rows by half a row: [r, 0] loads cos, [r, BLOCK_D // 2] sin; rows past the end read zeros."""
    return tl.make_tensor_descriptor(
        _rope_origin(RF, X, BLOCK_D, ROPE) + first * BLOCK_D,
        shape=[length, BLOCK_D],
        strides=[BLOCK_D, 1],
        block_shape=[BLOCK_R, BLOCK_D // 2],
    )


@triton.jit
def _rope_load(
    X, rows, stride_t, stride_h, h, pos, row_ok, RF, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr
):
    """A (rows, head_dim) tile of head h rotated by its positions (rotate-half RoPE, in X's dtype: `_rope_rotate`),
    its halves interleaved: column 2m holds rotated column m, column 2m + 1 rotated column m + D/2. q and k get the
    same order, so q.k is that of the rotated vectors; gradients come back through `_rope_store`. cos and sin come
    from RF's table (`_rope_origin`): loads, no per-element angle arithmetic."""
    offs = tl.arange(0, BLOCK_D // 2)
    cs = _rope_origin(RF, X, BLOCK_D, ROPE) + pos[:, None] * BLOCK_D + offs[None, :]
    c = tl.load(cs, mask=row_ok[:, None], other=0.0)
    s = tl.load(cs + BLOCK_D // 2, mask=row_ok[:, None], other=0.0)
    return _rope_load_cs(X, rows, stride_t, stride_h, h, row_ok, c, s, HEAD_DIM, BLOCK_D)


@triton.jit
def _rope_load_cs(X, rows, stride_t, stride_h, h, row_ok, c, s, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """`_rope_load` with the rows' cos and sin given (`_rope_cos_sin`)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, BLOCK_D // 2)
    ptrs = X + rows[:, None] * stride_t + h * stride_h + offs[None, :]
    mask = row_ok[:, None] & (offs < HALF)[None, :]
    return _rope_rotate(tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + HALF, mask=mask, other=0.0), c, s)


@triton.jit
def _rope_rotate(x1, x2, c, s):
    """The rotated, interleaved tile (`_rope_load`) of the halves x1, x2 of a tile's rows, whose cos and sin are c, s
    (the table's, or fp32), computed in x1's dtype as a separate rotary on the tensors is: for bf16, cos and sin in
    bf16 and packed bf16x2 multiplies and FMAs, without converting every element to fp32 and back (on the H200,
    window 1024 + RoPE forward -5%, block 64 + RoPE forward -10%); the rotated tile's relative error is ~2.4e-3
    instead of ~1.7e-3 (torch emulation at positions up to 16k, docs/benchmarks.md)."""
    cl = c.to(x1.dtype)
    sl = s.to(x1.dtype)
    r = tl.join(x1 * cl - x2 * sl, x1 * sl + x2 * cl)
    return tl.reshape(r, (x1.shape[0], 2 * x1.shape[1]))


@triton.jit
def _rope_store(
    X,
    rows,
    stride_t,
    stride_h,
    h,
    g,
    pos,
    row_ok,
    RF,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FAST: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """Stores (or with ATOMIC adds, fp32) the gradient w.r.t. the unrotated rows from `g`, the fp32 gradient w.r.t.
    a rotated, interleaved tile of `_rope_load`: the RoPE backward, in registers."""
    c, s = _rope_cos_sin(pos, RF, BLOCK_D, FAST)
    _rope_store_cs(X, rows, stride_t, stride_h, h, g, row_ok, c, s, HEAD_DIM, BLOCK_D, ATOMIC)


@triton.jit
def _rope_store_cs(
    X, rows, stride_t, stride_h, h, g, row_ok, c, s, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ATOMIC: tl.constexpr
):
    """`_rope_store` with the rows' cos and sin given (`_rope_cos_sin`)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    g1, g2 = tl.split(tl.reshape(g, (rows.shape[0], BLOCK_D // 2, 2)))
    offs = tl.arange(0, BLOCK_D // 2)
    ptrs = X + rows[:, None] * stride_t + h * stride_h + offs[None, :]
    mask = row_ok[:, None] & (offs < HALF)[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, g1 * c + g2 * s, mask=mask, sem="relaxed")
        tl.atomic_add(ptrs + HALF, g2 * c - g1 * s, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, (g1 * c + g2 * s).to(X.dtype.element_ty), mask=mask)
        tl.store(ptrs + HALF, (g2 * c - g1 * s).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _bias(
    rows,
    cols,
    row_ok,
    col_ok,
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
    HAS_AB: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    NUM_POS: tl.constexpr,
    NUM_TIME: tl.constexpr,
):
    """Additive score bias for a tile; `rows`/`cols` are broadcastable local indices."""
    bias = tl.zeros((rows + cols).shape, dtype=tl.float32)
    if HAS_AB:
        ab_ptr = AB + (o_start + rows).to(tl.int64) * stride_abt + h * stride_abh + cols
        bias += tl.load(ab_ptr, mask=row_ok & col_ok, other=0.0).to(tl.float32)
    if HAS_POS:
        bucket = _pos_bucket(rows + shift - cols, NUM_POS, pos_log_inv)
        bias += tl.load(PT + h * stride_pth + bucket).to(tl.float32)
    if HAS_TIME:
        qts = tl.load(QTS + o_start + rows, mask=row_ok, other=0)
        kts = tl.load(KTS + kv_start + cols, mask=col_ok, other=0)
        bucket = _time_bucket(qts - kts, NUM_TIME, time_log_inv)
        bias += tl.load(TT + h * stride_tth + bucket).to(tl.float32)
    return bias


@triton.jit
def _seq_info(q_off, kv_off, b, Q_STRIDE: tl.constexpr, KV_STRIDE: tl.constexpr):
    """Starts/lengths of sequence b's queries and keys (offsets of any integer dtype).

    `o_start` indexes output-shaped tensors (out, lse, dq): sequence b's own q rows, or b * len_q when one
    query sequence is shared (stride 0); `dkv_start` likewise indexes dk/dv rows.
    """
    b64 = b.to(tl.int64)
    q_start = tl.load(q_off + b64 * Q_STRIDE).to(tl.int64)
    q_len = (tl.load(q_off + b64 * Q_STRIDE + 1) - q_start).to(tl.int32)
    kv_start = tl.load(kv_off + b64 * KV_STRIDE).to(tl.int64)
    kv_len = (tl.load(kv_off + b64 * KV_STRIDE + 1) - kv_start).to(tl.int32)
    if Q_STRIDE == 0:
        o_start = b64 * q_len
    else:
        o_start = q_start
    if KV_STRIDE == 0:
        dkv_start = b64 * kv_len
    else:
        dkv_start = kv_start
    return q_start, q_len, kv_start, kv_len, o_start, dkv_start


@triton.jit
def _norm_scale(kv_len, max_len_scale, NORM: tl.constexpr):
    """GDPA's per-sequence output scale: 1 / key count (NORM 1), 1 / max length (NORM 2), or 1."""
    if NORM == 1:
        ns = tl.where(kv_len > 0, 1.0 / tl.maximum(kv_len, 1).to(tl.float32), 0.0)
    elif NORM == 2:
        ns = max_len_scale
    else:
        ns = 1.0
    return ns


@triton.jit
def _seq_desc(
    X, start, length, stride_t, stride_h, h, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Tensor descriptor (TMA) over one sequence's (length, head_dim) rows of head h: loads past its end or past
    head_dim read zeros, stores there are dropped; nothing outside the sequence is touched."""
    return tl.make_tensor_descriptor(
        X + start * stride_t + h * stride_h,
        shape=[length, HEAD_DIM],
        strides=[stride_t, 1],
        block_shape=[BLOCK_R, BLOCK_D],
    )


@triton.jit
def _load_tile(X, rows, stride_t, stride_h, h, offs_d, mask, USE_MASK: tl.constexpr):
    """A (rows, head_dim) tile of head h; a masked load only where the tile can run past the data."""
    ptrs = X + rows[:, None] * stride_t + h * stride_h + offs_d[None, :]
    if USE_MASK:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _last_arrival(ACC, cnt_row, stride_t, slot, arrivals):
    """Whether this program is the last of `arrivals` to finish adding into a region of the fp32 accumulator ACC: each
    counts itself in the region's counter, entry `slot` of ACC's rows from `cnt_row` on (zeroed with ACC). A semaphore
    as CUTLASS's: the barrier orders every thread's atomics before the counter's release, and the last program's
    acquire makes all of them visible to its loads."""
    tl.debug_barrier()
    count = tl.atomic_add(ACC + cnt_row.to(tl.int64) * stride_t + slot, 1.0, sem="acq_rel", scope="gpu")
    return count == arrivals - 1


@triton.jit
def _cast_rows(
    ACC,
    OUT,
    start,
    num_rows,
    stride_t,
    stride_h,
    h,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """OUT's rows [start, start + num_rows) of head h = ACC's (fp32, read from L2), in OUT's dtype; OUT has ACC's
    strides."""
    offs_d = tl.arange(0, BLOCK_D)
    for r0 in range(0, num_rows, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask = (offs_r < num_rows)[:, None] & (offs_d < HEAD_DIM)[None, :]
        ptrs = (start + offs_r)[:, None] * stride_t + h * stride_h + offs_d[None, :]
        acc = tl.load(ACC + ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(OUT + ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _load_pair(
    A, B, a_rows, b_rows, stride_at, stride_ah, stride_bt, stride_bh, h, offs_d, mask, USE_MASK: tl.constexpr
):
    """Two (rows, head_dim) tiles of head h (`_load_tile`)."""
    a = _load_tile(A, a_rows, stride_at, stride_ah, h, offs_d, mask, USE_MASK)
    b = _load_tile(B, b_rows, stride_bt, stride_bh, h, offs_d, mask, USE_MASK)
    return a, b


@triton.jit
def _load_kv(
    K,
    V,
    n0,
    kv_start,
    cols,
    col_ok,
    d_ok,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    h,
    offs_d,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    TMA: tl.constexpr,
    RF,
    HEAD_DIM: tl.constexpr,
    ROPE: tl.constexpr,
):
    """The K and V tiles of key rows `cols` (from n0); with TMA, K and V are this sequence's descriptors and
    rows past its length read as zeros; with ROPE, K rotated by the key positions (`_rope_load`; with TMA K's
    descriptor's boxes are half rows, and RF is the keys' cos/sin descriptor, `_rope_desc`)."""
    if ROPE and TMA:
        HALF: tl.constexpr = HEAD_DIM // 2
        k = _rope_rotate(K.load([n0, 0]), K.load([n0, HALF]), RF.load([n0, 0]), RF.load([n0, HALF]))
        v = V.load([n0, 0])
    elif ROPE:
        k = _rope_load(K, kv_start + cols, stride_kt, stride_kh, h, cols, col_ok, RF, HEAD_DIM, offs_d.shape[0], ROPE)
        v = _load_tile(V, kv_start + cols, stride_vt, stride_vh, h, offs_d, col_ok[:, None] & d_ok[None, :], True)
    elif TMA:
        k = K.load([n0, 0])
        v = V.load([n0, 0])
    else:
        kv_rows = kv_start + cols
        k, v = _load_pair(
            K,
            V,
            kv_rows,
            kv_rows,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            h,
            offs_d,
            col_ok[:, None] & d_ok[None, :],
            MASKED or not EVEN_D,
        )
    return k, v


@triton.jit
def _fwd_tile(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    n0,
    kv_start,
    kv_len,
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
    stride_vt,
    stride_vh,
    qk_scale,
    scale,
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
    TMA: tl.constexpr,
    RF,
    HEAD_DIM: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
):
    cols = n0 + offs_n
    col_ok = cols < kv_len
    k, v = _load_kv(
        K,
        V,
        n0,
        kv_start,
        cols,
        col_ok,
        d_ok,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        h,
        offs_d,
        MASKED,
        EVEN_D,
        TMA,
        RF,
        HEAD_DIM,
        ROPE,
    )
    return _fwd_scores(
        acc,
        m_i,
        l_i,
        q,
        k,
        v,
        cols,
        col_ok,
        kv_start,
        shift,
        h,
        o_start,
        offs_m,
        row_ok,
        qk_scale,
        scale,
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
        MODE,
        CAUSAL,
        MASKED,
        HAS_AB,
        HAS_POS,
        HAS_TIME,
        NUM_POS,
        NUM_TIME,
        FAST,
        SCALE_POS,
        WINDOW,
        MASK_BLOCK,
    )


@triton.jit
def _fwd_scores(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    cols,
    col_ok,
    kv_start,
    shift,
    h,
    o_start,
    offs_m,
    row_ok,
    qk_scale,
    scale,
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
    FAST: tl.constexpr,
    SCALE_POS: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
):
    """One (queries x keys) tile of the forward on loaded k, v: online softmax (MODE 0) or activation, into acc."""
    qk = tl.dot(q, tl.trans(k))
    HAS_BIAS: tl.constexpr = HAS_AB or HAS_POS or HAS_TIME
    if HAS_BIAS:
        s = qk * scale + _bias(
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
        # s * s_scale: log2-domain scores; with a positive scale it is applied inside the exp2's FMA below
        # (one op per score instead of two)
        s_scale = 1.0
        if HAS_BIAS:
            s = s * 1.4426950408889634
        elif SCALE_POS:
            s = qk
            s_scale = qk_scale
        else:
            s = qk * qk_scale
        if MASKED:
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
        if MASKED or HAS_BIAS:  # a row that sees no key yet (or only -inf biases) keeps m = -inf
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.math.exp2(s * s_scale - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    else:
        if MODE == 1 and FAST:  # silu(s) = u + u * tanh(u), u = s / 2: one MUFU op and one FMA per score
            if HAS_BIAS:
                u = 0.5 * s
            else:
                u = qk * (0.5 * scale)
            a = u + u * _tanh(u, FAST)
        else:
            if not HAS_BIAS:
                s = qk * scale
            a, _ = _activation(s, MODE, FAST)
        if MASKED:
            a = tl.where(valid, a, 0.0)
        acc = tl.dot(a.to(v.dtype), v, acc)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
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
    stride_vt,
    stride_vh,
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
    num_heads,
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
    BLOCK_D: tl.constexpr,
    SCALE_POS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
):
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
    q_rows = q_start + offs_m
    if ROPE:
        q = _rope_load(Q, q_rows, stride_qt, stride_qh, h, offs_m + shift, row_ok, RF, HEAD_DIM, BLOCK_D, ROPE)
    else:
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
    if TMA:
        if ROPE:  # in halves, rotated as they load (`_load_kv`) by the keys' cos/sin rows
            RF = _rope_desc(RF, Q, 0, kv_len, BLOCK_N, BLOCK_D, ROPE)
            K = _seq_desc(K, kv_start, kv_len, stride_kt, stride_kh, h, HEAD_DIM, BLOCK_N, BLOCK_D // 2)
        else:
            K = _seq_desc(K, kv_start, kv_len, stride_kt, stride_kh, h, HEAD_DIM, BLOCK_N, BLOCK_D)
        V = _seq_desc(V, kv_start, kv_len, stride_vt, stride_vh, h, HEAD_DIM, BLOCK_N, BLOCK_D)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # Keys every row of the block may see (no mask needed), then the ragged/diagonal rest; with a window or block
    # mask, first the keys only the later rows see (skipping those no row sees).
    n_start, n_mid, n_full, n_end = _key_tiles(
        m0 + shift, m0 + BLOCK_M - 1 + shift, kv_len, CAUSAL, WINDOW, MASK_BLOCK, BLOCK_N
    )
    if WINDOW > 0 or MASK_BLOCK > 0:
        for n0 in range(n_start, n_mid, BLOCK_N):
            acc, m_i, l_i = _fwd_tile(
                acc,
                m_i,
                l_i,
                q,
                K,
                V,
                n0,
                kv_start,
                kv_len,
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
                stride_vt,
                stride_vh,
                qk_scale,
                scale,
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
                MODE,
                CAUSAL,
                True,
                HAS_AB,
                HAS_POS,
                HAS_TIME,
                NUM_POS,
                NUM_TIME,
                EVEN_D,
                FAST,
                SCALE_POS,
                TMA,
                RF,
                HEAD_DIM,
                WINDOW,
                MASK_BLOCK,
                ROPE,
            )
    for n0 in range(n_mid, n_full, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(
            acc,
            m_i,
            l_i,
            q,
            K,
            V,
            n0,
            kv_start,
            kv_len,
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
            stride_vt,
            stride_vh,
            qk_scale,
            scale,
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
            MODE,
            CAUSAL,
            False,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            EVEN_D,
            FAST,
            SCALE_POS,
            TMA,
            RF,
            HEAD_DIM,
            WINDOW,
            MASK_BLOCK,
            ROPE,
        )
    for n0 in range(n_full, n_end, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(
            acc,
            m_i,
            l_i,
            q,
            K,
            V,
            n0,
            kv_start,
            kv_len,
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
            stride_vt,
            stride_vh,
            qk_scale,
            scale,
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
            MODE,
            CAUSAL,
            True,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            EVEN_D,
            FAST,
            SCALE_POS,
            TMA,
            RF,
            HEAD_DIM,
            WINDOW,
            MASK_BLOCK,
            ROPE,
        )
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


@triton.jit
def _fwd_store(
    acc,
    m_i,
    l_i,
    Out,
    LSE,
    o_rows,
    row_ok,
    d_ok,
    offs_d,
    stride_ot,
    stride_oh,
    h,
    num_heads,
    kv_len,
    inv_max_len,
    MODE: tl.constexpr,
    NORM: tl.constexpr,
):
    """A query block's output (softmax-normalized, or GDPA-scaled) and, for softmax, its logsumexp."""
    if MODE == 0:
        l_ok = l_i > 0.0
        out = acc / tl.where(l_ok, l_i, 1.0)[:, None]
        # log2-domain logsumexp; +inf for rows that see no key makes their probabilities 0 in backward
        lse = tl.where(l_ok, m_i + tl.math.log2(tl.where(l_ok, l_i, 1.0)), float("inf"))
        tl.store(LSE + o_rows * num_heads + h, lse, mask=row_ok)
    else:
        out = acc * _norm_scale(kv_len, inv_max_len, NORM)
    tl.store(
        Out + o_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _fwd_kv_resident_kernel(
    Q,
    K,
    V,
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
    stride_vt,
    stride_vh,
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
    num_heads,
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
    BLOCK_D: tl.constexpr,
    SCALE_POS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    TMA: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
):
    """Forward when every key sequence fits one BLOCK_N tile (cross-attention to a few tokens): K and V are loaded
    once and each program walks CHUNK query rows, so the next query block loads while this one computes."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start, _ = _seq_info(q_off, kv_off, b, Q_STRIDE, KV_STRIDE)
    m_begin = tl.program_id(0) * CHUNK
    if m_begin >= q_len:
        return
    m_end = tl.minimum(q_len, m_begin + CHUNK)
    shift = kv_len - q_len
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < kv_len
    d_ok = offs_d < HEAD_DIM
    kv_rows = kv_start + offs_n
    if ROPE:
        k = _rope_load(K, kv_rows, stride_kt, stride_kh, h, offs_n, col_ok, RF, HEAD_DIM, BLOCK_D, ROPE)
        v = _load_tile(V, kv_rows, stride_vt, stride_vh, h, offs_d, col_ok[:, None] & d_ok[None, :], True)
    else:
        k, v = _load_pair(
            K,
            V,
            kv_rows,
            kv_rows,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            h,
            offs_d,
            col_ok[:, None] & d_ok[None, :],
            True,
        )
    if TMA:
        Q = _seq_desc(Q, q_start, q_len, stride_qt, stride_qh, h, HEAD_DIM, BLOCK_M, BLOCK_D)
    for m0 in range(m_begin, m_end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < q_len
        if ROPE:
            tl.static_assert(not TMA, "RoPE loads go through pointers")
            q = _rope_load(
                Q, q_start + offs_m, stride_qt, stride_qh, h, offs_m + shift, row_ok, RF, HEAD_DIM, BLOCK_D, ROPE
            )
        elif TMA:
            q = Q.load([m0, 0])
        else:
            q = _load_tile(Q, q_start + offs_m, stride_qt, stride_qh, h, offs_d, row_ok[:, None] & d_ok[None, :], True)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc, m_i, l_i = _fwd_scores(
            acc,
            m_i,
            l_i,
            q,
            k,
            v,
            offs_n,
            col_ok,
            kv_start,
            shift,
            h,
            o_start,
            offs_m,
            row_ok,
            qk_scale,
            scale,
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
            MODE,
            CAUSAL,
            True,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            FAST,
            SCALE_POS,
            WINDOW,
            MASK_BLOCK,
        )
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


@triton.jit
def _bwd_kv_tile(
    dk,
    dv,
    k,
    v,
    m0,
    offs_m0,
    offs_n,
    offs_d,
    col_ok,
    d_ok,
    q_start,
    o_start,
    kv_start,
    q_len,
    shift,
    h,
    ns,
    scale,
    Q,
    Out,
    DO,
    LSE,
    DELTA,
    DQA,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dqat,
    stride_dqah,
    num_heads,
    AB,
    DAB,
    stride_abt,
    stride_abh,
    PT,
    DPT,
    stride_pth,
    TT,
    DTT,
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
    FUSE_DQ: tl.constexpr,
    DELTA_INLINE: tl.constexpr,
    TMA: tl.constexpr,
    RF,
    CS,
    HEAD_DIM: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
):
    """One query block's contribution to dK, dV (transposed tiles) and its dQ: FUSE_DQ 1 adds its share into an fp32
    buffer (atomics; with ROPE still rotated); FUSE_DQ 2, where this key block holds every key of the sequence, stores
    the block's whole dQ and the score-bias gradients. With TMA, Q, DO (and Out, read for the softmax delta with
    DELTA_INLINE) are the sequence's tensor descriptors, and with ROPE CS the queries' cos/sin one (`_rope_desc`)."""
    BLOCK_D: tl.constexpr = offs_d.shape[0]
    offs_m = m0 + offs_m0
    row_ok = offs_m < q_len
    o_rows = o_start + offs_m
    qmask = row_ok[:, None] & d_ok[None, :]
    if ROPE and TMA:
        HALF: tl.constexpr = HEAD_DIM // 2
        q = _rope_rotate(Q.load([m0, 0]), Q.load([m0, HALF]), CS.load([m0, 0]), CS.load([m0, HALF]))
        do = DO.load([m0, 0])
    elif ROPE:
        q = _rope_load(
            Q, q_start + offs_m, stride_qt, stride_qh, h, offs_m + shift, row_ok, RF, HEAD_DIM, BLOCK_D, ROPE
        )
        do = _load_tile(DO, o_rows, stride_dot, stride_doh, h, offs_d, qmask, True)
    elif TMA:
        q = Q.load([m0, 0])
        do = DO.load([m0, 0])
    else:
        q, do = _load_pair(
            Q,
            DO,
            q_start + offs_m,
            o_rows,
            stride_qt,
            stride_qh,
            stride_dot,
            stride_doh,
            h,
            offs_d,
            qmask,
            MASKED or not EVEN_D,
        )
    qkT = tl.dot(k, tl.trans(q))
    HAS_BIAS: tl.constexpr = HAS_AB or HAS_POS or HAS_TIME
    if HAS_BIAS:
        sT = qkT * scale + _bias(
            offs_m[None, :],
            offs_n[:, None],
            row_ok[None, :],
            col_ok[:, None],
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
        valid = col_ok[:, None] & row_ok[None, :]
        if CAUSAL or WINDOW > 0 or MASK_BLOCK > 0:
            valid = valid & _visible(offs_m[None, :] + shift, offs_n[:, None], CAUSAL, WINDOW, MASK_BLOCK)
    dpT = tl.dot(v, tl.trans(do))
    if MODE == 0:
        if MASKED:
            lse = tl.load(LSE + o_rows * num_heads + h, mask=row_ok, other=float("inf"))
        else:
            lse = tl.load(LSE + o_rows * num_heads + h)
        if DELTA_INLINE:  # rows past the sequence read zeros (their delta is 0)
            if TMA:
                o = Out.load([m0, 0])
            else:
                o = _load_tile(Out, o_rows, stride_ot, stride_oh, h, offs_d, qmask, MASKED or not EVEN_D)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        elif MASKED:
            delta = tl.load(DELTA + o_rows * num_heads + h, mask=row_ok, other=0.0)
        else:
            delta = tl.load(DELTA + o_rows * num_heads + h)
        if HAS_BIAS:
            pT = tl.math.exp2(sT * 1.4426950408889634 - lse[None, :])
        else:  # scale and log2(e) in one FMA with the logsumexp
            pT = tl.math.exp2(qkT * (scale * 1.4426950408889634) - lse[None, :])
        if MASKED:
            pT = tl.where(valid, pT, 0.0)
        dsT = pT * (dpT - delta[None, :])
    else:
        if not HAS_BIAS:
            sT = qkT * scale
        pT, daT = _activation(sT, MODE, FAST)
        pT = pT * ns
        dsT = dpT * daT * ns
        if MASKED:
            pT = tl.where(valid, pT, 0.0)
            dsT = tl.where(valid, dsT, 0.0)
    dv += tl.dot(pT.to(do.dtype), do)
    dsT_lo = dsT.to(q.dtype)
    dk += tl.dot(dsT_lo, q)
    if FUSE_DQ == 1:  # with ROPE w.r.t. the rotated, interleaved q: `_rope_dq_kernel` rotates the sum back
        dq = tl.dot(tl.trans(dsT_lo), k) * scale
        tl.atomic_add(
            DQA + o_rows[:, None] * stride_dqat + h * stride_dqah + offs_d[None, :], dq, mask=qmask, sem="relaxed"
        )
    elif FUSE_DQ == 2:
        dq = tl.dot(tl.trans(dsT_lo), k) * scale
        if ROPE:
            _rope_store(
                DQA, o_rows, stride_dqat, stride_dqah, h, dq, offs_m + shift, row_ok, RF, HEAD_DIM, BLOCK_D, FAST, False
            )
        else:
            tl.store(
                DQA + o_rows[:, None] * stride_dqat + h * stride_dqah + offs_d[None, :],
                dq.to(DQA.dtype.element_ty),
                mask=qmask,
            )
        _bias_grads(
            dsT,
            offs_m[None, :],
            offs_n[:, None],
            row_ok[None, :],
            col_ok[:, None],
            valid,
            shift,
            h,
            o_start,
            kv_start,
            DAB,
            stride_abt,
            stride_abh,
            DPT,
            DTT,
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
    return dk, dv


@triton.jit
def _bwd_kv_setup(
    Q,
    K,
    V,
    Out,
    DO,
    n0,
    q_start,
    q_len,
    kv_start,
    kv_len,
    o_start,
    h,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DELTA_INLINE: tl.constexpr,
    TMA: tl.constexpr,
    RF,
    ROPE: tl.constexpr,
):
    """A key block's K (with ROPE rotated) and V tiles (from row n0), its index vectors and masks, and with TMA the
    sequence's Q, DO (and, for the in-kernel softmax delta, Out) descriptors in place of the pointers and with ROPE
    the queries' cos/sin descriptor CS (else CS is RF)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < kv_len
    d_ok = offs_d < HEAD_DIM
    kv_rows = kv_start + offs_n
    kmask = col_ok[:, None] & d_ok[None, :]
    if ROPE:
        k = _rope_load(K, kv_rows, stride_kt, stride_kh, h, offs_n, col_ok, RF, HEAD_DIM, BLOCK_D, ROPE)
        v = _load_tile(V, kv_rows, stride_vt, stride_vh, h, offs_d, kmask, True)
    else:
        k, v = _load_pair(K, V, kv_rows, kv_rows, stride_kt, stride_kh, stride_vt, stride_vh, h, offs_d, kmask, True)
    CS = RF
    if TMA:
        if ROPE:  # in halves, rotated as they load (`_bwd_kv_tile`) by the queries' cos/sin rows
            CS = _rope_desc(RF, Q, kv_len - q_len, q_len, BLOCK_M, BLOCK_D, ROPE)
            Q = _seq_desc(Q, q_start, q_len, stride_qt, stride_qh, h, HEAD_DIM, BLOCK_M, BLOCK_D // 2)
        else:
            Q = _seq_desc(Q, q_start, q_len, stride_qt, stride_qh, h, HEAD_DIM, BLOCK_M, BLOCK_D)
        DO = _seq_desc(DO, o_start, q_len, stride_dot, stride_doh, h, HEAD_DIM, BLOCK_M, BLOCK_D)
        if DELTA_INLINE:
            Out = _seq_desc(Out, o_start, q_len, stride_ot, stride_oh, h, HEAD_DIM, BLOCK_M, BLOCK_D)
    return k, v, Q, DO, Out, CS, offs_n, offs_m0, offs_d, col_ok, d_ok, kmask


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    Out,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DQA,
    DQ,
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
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_dqat,
    stride_dqah,
    stride_abt,
    stride_abh,
    stride_pth,
    stride_tth,
    scale,
    norm_scale,
    pos_log_inv,
    time_log_inv,
    num_heads,
    cnt_row,
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
    FUSE_DQ: tl.constexpr,
    DELTA_INLINE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
    CAST_DQ: tl.constexpr,
):
    """dK and dV (and with FUSE_DQ, dQ by atomics) for one key block, looping over the query blocks that see it;
    the softmax delta read from DELTA, or with DELTA_INLINE computed from Out and DO per query block. Also the
    first programs of `_bwd_one_launch_kernel`. CAST_DQ (with FUSE_DQ): the last key block of a sequence and head
    stores the sequence's dQ in DQ's dtype (`_last_arrival`; counters in DQA from row cnt_row on; DQ has DQA's
    strides)."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start, dkv_start = _seq_info(q_off, kv_off, b, Q_STRIDE, KV_STRIDE)
    n0 = pid_n * BLOCK_N
    if n0 >= kv_len:
        if CAST_DQ:
            if _last_arrival(DQA, cnt_row, stride_dqat, b * num_heads + h, tl.num_programs(0)):
                _cast_rows(DQA, DQ, o_start, q_len, stride_dqat, stride_dqah, h, HEAD_DIM, BLOCK_M, BLOCK_D)
        return
    shift = kv_len - q_len
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    ns = _norm_scale(kv_len, norm_scale, NORM)
    k, v, Q, DO, Out, CS, offs_n, offs_m0, offs_d, col_ok, d_ok, kmask = _bwd_kv_setup(
        Q,
        K,
        V,
        Out,
        DO,
        n0,
        q_start,
        q_len,
        kv_start,
        kv_len,
        o_start,
        h,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_dot,
        stride_doh,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        DELTA_INLINE,
        TMA,
        RF,
        ROPE,
    )
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    # query blocks [m_lo, m_full): causal diagonal or the mask's near edge (masked); [m_full, m_tail): every pair
    # valid (no masks); [m_tail, m_end): the mask's far edge, the ragged last block, and everything when this key
    # block is ragged itself
    m_lo, m_full, m_tail, m_end = _query_tiles(
        n0, n0 + BLOCK_N - 1, shift, q_len, n0 + BLOCK_N > kv_len, CAUSAL, WINDOW, MASK_BLOCK, BLOCK_M
    )
    for m0 in range(m_lo, m_full, BLOCK_M):
        dk, dv = _bwd_kv_tile(
            dk,
            dv,
            k,
            v,
            m0,
            offs_m0,
            offs_n,
            offs_d,
            col_ok,
            d_ok,
            q_start,
            o_start,
            kv_start,
            q_len,
            shift,
            h,
            ns,
            scale,
            Q,
            Out,
            DO,
            LSE,
            DELTA,
            DQA,
            stride_qt,
            stride_qh,
            stride_ot,
            stride_oh,
            stride_dot,
            stride_doh,
            stride_dqat,
            stride_dqah,
            num_heads,
            AB,
            AB,
            stride_abt,
            stride_abh,
            PT,
            PT,
            stride_pth,
            TT,
            TT,
            stride_tth,
            QTS,
            KTS,
            pos_log_inv,
            time_log_inv,
            MODE,
            CAUSAL,
            True,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            EVEN_D,
            FAST,
            FUSE_DQ,
            DELTA_INLINE,
            TMA,
            RF,
            CS,
            HEAD_DIM,
            WINDOW,
            MASK_BLOCK,
            ROPE,
        )
    for m0 in range(m_full, m_tail, BLOCK_M):
        dk, dv = _bwd_kv_tile(
            dk,
            dv,
            k,
            v,
            m0,
            offs_m0,
            offs_n,
            offs_d,
            col_ok,
            d_ok,
            q_start,
            o_start,
            kv_start,
            q_len,
            shift,
            h,
            ns,
            scale,
            Q,
            Out,
            DO,
            LSE,
            DELTA,
            DQA,
            stride_qt,
            stride_qh,
            stride_ot,
            stride_oh,
            stride_dot,
            stride_doh,
            stride_dqat,
            stride_dqah,
            num_heads,
            AB,
            AB,
            stride_abt,
            stride_abh,
            PT,
            PT,
            stride_pth,
            TT,
            TT,
            stride_tth,
            QTS,
            KTS,
            pos_log_inv,
            time_log_inv,
            MODE,
            CAUSAL,
            False,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            EVEN_D,
            FAST,
            FUSE_DQ,
            DELTA_INLINE,
            TMA,
            RF,
            CS,
            HEAD_DIM,
            WINDOW,
            MASK_BLOCK,
            ROPE,
        )
    for m0 in range(m_tail, m_end, BLOCK_M):
        dk, dv = _bwd_kv_tile(
            dk,
            dv,
            k,
            v,
            m0,
            offs_m0,
            offs_n,
            offs_d,
            col_ok,
            d_ok,
            q_start,
            o_start,
            kv_start,
            q_len,
            shift,
            h,
            ns,
            scale,
            Q,
            Out,
            DO,
            LSE,
            DELTA,
            DQA,
            stride_qt,
            stride_qh,
            stride_ot,
            stride_oh,
            stride_dot,
            stride_doh,
            stride_dqat,
            stride_dqah,
            num_heads,
            AB,
            AB,
            stride_abt,
            stride_abh,
            PT,
            PT,
            stride_pth,
            TT,
            TT,
            stride_tth,
            QTS,
            KTS,
            pos_log_inv,
            time_log_inv,
            MODE,
            CAUSAL,
            True,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            EVEN_D,
            FAST,
            FUSE_DQ,
            DELTA_INLINE,
            TMA,
            RF,
            CS,
            HEAD_DIM,
            WINDOW,
            MASK_BLOCK,
            ROPE,
        )
    dk_rows = dkv_start + offs_n
    if ROPE:
        _rope_store(
            DK, dk_rows, stride_dkt, stride_dkh, h, dk * scale, offs_n, col_ok, RF, HEAD_DIM, BLOCK_D, FAST, False
        )
    else:
        tl.store(
            DK + dk_rows[:, None] * stride_dkt + h * stride_dkh + offs_d[None, :],
            (dk * scale).to(DK.dtype.element_ty),
            mask=kmask,
        )
    tl.store(
        DV + dk_rows[:, None] * stride_dvt + h * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kmask
    )
    if CAST_DQ:
        if _last_arrival(DQA, cnt_row, stride_dqat, b * num_heads + h, tl.num_programs(0)):
            _cast_rows(DQA, DQ, o_start, q_len, stride_dqat, stride_dqah, h, HEAD_DIM, BLOCK_M, BLOCK_D)


@triton.jit
def _bwd_q_tile(
    dq,
    q,
    do,
    lse,
    delta,
    n0,
    offs_m,
    offs_n0,
    offs_d,
    row_ok,
    d_ok,
    kv_start,
    kv_len,
    o_start,
    shift,
    h,
    ns,
    scale,
    K,
    V,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    AB,
    DAB,
    stride_abt,
    stride_abh,
    PT,
    DPT,
    stride_pth,
    TT,
    DTT,
    stride_tth,
    QTS,
    KTS,
    pos_log_inv,
    time_log_inv,
    DK,
    DV,
    dkv_start,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
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
    TMA: tl.constexpr,
    STORE_DKV: tl.constexpr,
    RF,
    HEAD_DIM: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
):
    """One key block's contribution to dQ and to the score-bias gradients (with TMA, K and V are descriptors).
    STORE_DKV, where this query block holds every query of the sequence: also the key block's whole dK and dV."""
    BLOCK_D: tl.constexpr = offs_d.shape[0]
    offs_n = n0 + offs_n0
    col_ok = offs_n < kv_len
    k, v = _load_kv(
        K,
        V,
        n0,
        kv_start,
        offs_n,
        col_ok,
        d_ok,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        h,
        offs_d,
        MASKED,
        EVEN_D,
        TMA,
        RF,
        HEAD_DIM,
        ROPE,
    )
    qk = tl.dot(q, tl.trans(k))
    HAS_BIAS: tl.constexpr = HAS_AB or HAS_POS or HAS_TIME
    if HAS_BIAS:
        s = qk * scale + _bias(
            offs_m[:, None],
            offs_n[None, :],
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
    dp = tl.dot(do, tl.trans(v))
    if MODE == 0:
        if HAS_BIAS:
            p = tl.math.exp2(s * 1.4426950408889634 - lse[:, None])
        else:
            p = tl.math.exp2(qk * (scale * 1.4426950408889634) - lse[:, None])
        ds = p * (dp - delta[:, None])
    else:
        if not HAS_BIAS:
            s = qk * scale
        p, da = _activation(s, MODE, FAST)
        p = p * ns
        ds = dp * da * ns
    # rows past q_len carry do = 0 (and lse = +inf), so their ds is 0 without a mask
    valid = row_ok[:, None] & col_ok[None, :]
    if MASKED:
        if CAUSAL or WINDOW > 0 or MASK_BLOCK > 0:
            valid = valid & _visible(offs_m[:, None] + shift, offs_n[None, :], CAUSAL, WINDOW, MASK_BLOCK)
        ds = tl.where(valid, ds, 0.0)
    ds_lo = ds.to(k.dtype)
    dq += tl.dot(ds_lo, k)
    _bias_grads(
        ds,
        offs_m[:, None],
        offs_n[None, :],
        row_ok[:, None],
        col_ok[None, :],
        valid,
        shift,
        h,
        o_start,
        kv_start,
        DAB,
        stride_abt,
        stride_abh,
        DPT,
        DTT,
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
    if STORE_DKV:
        p = tl.where(valid, p, 0.0)
        dkv_rows = dkv_start + offs_n
        kmask = col_ok[:, None] & d_ok[None, :]
        dv_tile = tl.dot(tl.trans(p.to(do.dtype)), do)
        tl.store(
            DV + dkv_rows[:, None] * stride_dvt + h * stride_dvh + offs_d[None, :],
            dv_tile.to(DV.dtype.element_ty),
            mask=kmask,
        )
        dk_tile = tl.dot(tl.trans(ds_lo), q) * scale
        if ROPE:
            _rope_store(
                DK, dkv_rows, stride_dkt, stride_dkh, h, dk_tile, offs_n, col_ok, RF, HEAD_DIM, BLOCK_D, FAST, False
            )
        else:
            tl.store(
                DK + dkv_rows[:, None] * stride_dkt + h * stride_dkh + offs_d[None, :],
                dk_tile.to(DK.dtype.element_ty),
                mask=kmask,
            )
    return dq


@triton.jit
def _bias_grads(
    ds,
    rows,
    cols,
    row_ok,
    col_ok,
    valid,
    shift,
    h,
    o_start,
    kv_start,
    DAB,
    stride_abt,
    stride_abh,
    DPT,
    DTT,
    QTS,
    KTS,
    pos_log_inv,
    time_log_inv,
    HAS_AB: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    NUM_POS: tl.constexpr,
    NUM_TIME: tl.constexpr,
):
    """Score-bias gradients of one tile of score gradients ds (`rows`/`cols` broadcastable local indices, either
    orientation): the dense bias's tile stored, the bucket tables' entries added (atomics) where `valid`."""
    if HAS_AB:
        tl.store(
            DAB + (o_start + rows).to(tl.int64) * stride_abt + h * stride_abh + cols,
            ds.to(DAB.dtype.element_ty),
            mask=row_ok & col_ok,
        )
    if HAS_POS:
        bucket = _pos_bucket(rows + shift - cols, NUM_POS, pos_log_inv)
        tl.atomic_add(DPT + h * NUM_POS + bucket, ds, mask=valid)
    if HAS_TIME:
        qts = tl.load(QTS + o_start + rows, mask=row_ok, other=0)
        kts = tl.load(KTS + kv_start + cols, mask=col_ok, other=0)
        bucket = _time_bucket(qts - kts, NUM_TIME, time_log_inv)
        tl.atomic_add(DTT + h * NUM_TIME + bucket, ds, mask=valid)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    Out,
    DO,
    LSE,
    DELTA,
    DQ,
    AB,
    DAB,
    PT,
    DPT,
    TT,
    DTT,
    QTS,
    KTS,
    RF,
    q_off,
    kv_off,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_abt,
    stride_abh,
    stride_pth,
    stride_tth,
    scale,
    norm_scale,
    pos_log_inv,
    time_log_inv,
    num_heads,
    first_program,
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
    DELTA_INLINE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
):
    """dQ for one query block, plus the score-bias gradients (dense bias rows, bucket tables); the softmax delta
    read from DELTA, or with DELTA_INLINE computed from Out and DO. Programs from `first_program` on (the last ones
    of `_bwd_one_launch_kernel`), the longest causal query blocks first."""
    pid_m = tl.program_id(0) - first_program
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start, _ = _seq_info(q_off, kv_off, b, Q_STRIDE, KV_STRIDE)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    shift = kv_len - q_len
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    ns = _norm_scale(kv_len, norm_scale, NORM)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_rows = q_start + offs_m
    o_rows = o_start + offs_m
    qmask = row_ok[:, None] & d_ok[None, :]
    if ROPE:
        q = _rope_load(Q, q_rows, stride_qt, stride_qh, h, offs_m + shift, row_ok, RF, HEAD_DIM, BLOCK_D, ROPE)
        do = _load_tile(DO, o_rows, stride_dot, stride_doh, h, offs_d, qmask, True)
    else:
        q, do = _load_pair(Q, DO, q_rows, o_rows, stride_qt, stride_qh, stride_dot, stride_doh, h, offs_d, qmask, True)
    lse = tl.load(LSE + o_rows * num_heads + h, mask=row_ok, other=float("inf"))
    if DELTA_INLINE:
        o = _load_tile(Out, o_rows, stride_ot, stride_oh, h, offs_d, qmask, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    else:
        delta = tl.load(DELTA + o_rows * num_heads + h, mask=row_ok, other=0.0)
    if TMA:
        K = _seq_desc(K, kv_start, kv_len, stride_kt, stride_kh, h, HEAD_DIM, BLOCK_N, BLOCK_D)
        V = _seq_desc(V, kv_start, kv_len, stride_vt, stride_vh, h, HEAD_DIM, BLOCK_N, BLOCK_D)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    n_start, n_mid, n_full, n_end = _key_tiles(
        m0 + shift, m0 + BLOCK_M - 1 + shift, kv_len, CAUSAL, WINDOW, MASK_BLOCK, BLOCK_N
    )
    if WINDOW > 0 or MASK_BLOCK > 0:
        for n0 in range(n_start, n_mid, BLOCK_N):
            dq = _bwd_q_tile(
                dq,
                q,
                do,
                lse,
                delta,
                n0,
                offs_m,
                offs_n0,
                offs_d,
                row_ok,
                d_ok,
                kv_start,
                kv_len,
                o_start,
                shift,
                h,
                ns,
                scale,
                K,
                V,
                stride_kt,
                stride_kh,
                stride_vt,
                stride_vh,
                AB,
                DAB,
                stride_abt,
                stride_abh,
                PT,
                DPT,
                stride_pth,
                TT,
                DTT,
                stride_tth,
                QTS,
                KTS,
                pos_log_inv,
                time_log_inv,
                DQ,
                DQ,
                0,
                0,
                0,
                0,
                0,
                MODE,
                CAUSAL,
                True,
                HAS_AB,
                HAS_POS,
                HAS_TIME,
                NUM_POS,
                NUM_TIME,
                EVEN_D,
                FAST,
                TMA,
                False,
                RF,
                HEAD_DIM,
                WINDOW,
                MASK_BLOCK,
                ROPE,
            )
    for n0 in range(n_mid, n_full, BLOCK_N):
        dq = _bwd_q_tile(
            dq,
            q,
            do,
            lse,
            delta,
            n0,
            offs_m,
            offs_n0,
            offs_d,
            row_ok,
            d_ok,
            kv_start,
            kv_len,
            o_start,
            shift,
            h,
            ns,
            scale,
            K,
            V,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            AB,
            DAB,
            stride_abt,
            stride_abh,
            PT,
            DPT,
            stride_pth,
            TT,
            DTT,
            stride_tth,
            QTS,
            KTS,
            pos_log_inv,
            time_log_inv,
            DQ,
            DQ,
            0,
            0,
            0,
            0,
            0,
            MODE,
            CAUSAL,
            False,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            EVEN_D,
            FAST,
            TMA,
            False,
            RF,
            HEAD_DIM,
            WINDOW,
            MASK_BLOCK,
            ROPE,
        )
    for n0 in range(n_full, n_end, BLOCK_N):
        dq = _bwd_q_tile(
            dq,
            q,
            do,
            lse,
            delta,
            n0,
            offs_m,
            offs_n0,
            offs_d,
            row_ok,
            d_ok,
            kv_start,
            kv_len,
            o_start,
            shift,
            h,
            ns,
            scale,
            K,
            V,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            AB,
            DAB,
            stride_abt,
            stride_abh,
            PT,
            DPT,
            stride_pth,
            TT,
            DTT,
            stride_tth,
            QTS,
            KTS,
            pos_log_inv,
            time_log_inv,
            DQ,
            DQ,
            0,
            0,
            0,
            0,
            0,
            MODE,
            CAUSAL,
            True,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            EVEN_D,
            FAST,
            TMA,
            False,
            RF,
            HEAD_DIM,
            WINDOW,
            MASK_BLOCK,
            ROPE,
        )
    if ROPE:
        _rope_store(
            DQ,
            o_rows,
            stride_dqt,
            stride_dqh,
            h,
            dq * scale,
            offs_m + shift,
            row_ok,
            RF,
            HEAD_DIM,
            BLOCK_D,
            FAST,
            False,
        )
    else:
        tl.store(
            DQ + o_rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
            (dq * scale).to(DQ.dtype.element_ty),
            mask=qmask,
        )


@triton.jit
def _bwd_kv_resident_kernel(
    Q,
    K,
    V,
    Out,
    DO,
    LSE,
    DQ,
    DKA,
    DVA,
    DK,
    DV,
    AB,
    DAB,
    PT,
    DPT,
    TT,
    DTT,
    QTS,
    KTS,
    RF,
    q_off,
    kv_off,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_dkvt,
    stride_dkvh,
    stride_abt,
    stride_abh,
    stride_pth,
    stride_tth,
    scale,
    norm_scale,
    pos_log_inv,
    time_log_inv,
    num_heads,
    cnt_row,
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
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    TMA: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
    CAST_DKV: tl.constexpr,
):
    """The whole backward when every key sequence fits one BLOCK_N tile: each program walks CHUNK query rows with K
    and V loaded once, stores their dQ and score-bias gradients, and adds its share of dK (scaled) and dV into the
    fp32 DKA, DVA (atomics); the softmax delta comes from Out and DO per query block. CAST_DKV: the last program of
    a sequence and head stores its dK and dV in DK's and DV's dtype (`_last_arrival`; counters in DKA from row cnt_row
    on; DK and DV have DKA's strides)."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start, dkv_start = _seq_info(q_off, kv_off, b, Q_STRIDE, KV_STRIDE)
    m_begin = tl.program_id(0) * CHUNK
    if m_begin >= q_len:
        if CAST_DKV:
            if _last_arrival(DKA, cnt_row, stride_dkvt, b * num_heads + h, tl.num_programs(0)):
                _cast_rows(DKA, DK, dkv_start, kv_len, stride_dkvt, stride_dkvh, h, HEAD_DIM, BLOCK_N, BLOCK_D)
                _cast_rows(DVA, DV, dkv_start, kv_len, stride_dkvt, stride_dkvh, h, HEAD_DIM, BLOCK_N, BLOCK_D)
        return
    m_end = tl.minimum(q_len, m_begin + CHUNK)
    shift = kv_len - q_len
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    DELTA_INLINE: tl.constexpr = MODE == 0
    ns = _norm_scale(kv_len, norm_scale, NORM)
    k, v, Q, DO, Out, CS, offs_n, offs_m0, offs_d, col_ok, d_ok, kmask = _bwd_kv_setup(
        Q,
        K,
        V,
        Out,
        DO,
        0,
        q_start,
        q_len,
        kv_start,
        kv_len,
        o_start,
        h,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_dot,
        stride_doh,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        DELTA_INLINE,
        TMA,
        RF,
        ROPE,
    )
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for m0 in range(m_begin, m_end, BLOCK_M):
        dk, dv = _bwd_kv_tile(
            dk,
            dv,
            k,
            v,
            m0,
            offs_m0,
            offs_n,
            offs_d,
            col_ok,
            d_ok,
            q_start,
            o_start,
            kv_start,
            q_len,
            shift,
            h,
            ns,
            scale,
            Q,
            Out,
            DO,
            LSE,
            LSE,
            DQ,
            stride_qt,
            stride_qh,
            stride_ot,
            stride_oh,
            stride_dot,
            stride_doh,
            stride_dqt,
            stride_dqh,
            num_heads,
            AB,
            DAB,
            stride_abt,
            stride_abh,
            PT,
            DPT,
            stride_pth,
            TT,
            DTT,
            stride_tth,
            QTS,
            KTS,
            pos_log_inv,
            time_log_inv,
            MODE,
            CAUSAL,
            True,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            EVEN_D,
            FAST,
            2,
            DELTA_INLINE,
            TMA,
            RF,
            CS,
            HEAD_DIM,
            WINDOW,
            MASK_BLOCK,
            ROPE,
        )
    dkv_ptrs = (dkv_start + offs_n)[:, None] * stride_dkvt + h * stride_dkvh + offs_d[None, :]
    if ROPE:
        _rope_store(
            DKA,
            dkv_start + offs_n,
            stride_dkvt,
            stride_dkvh,
            h,
            dk * scale,
            offs_n,
            col_ok,
            RF,
            HEAD_DIM,
            BLOCK_D,
            FAST,
            True,
        )
    else:
        tl.atomic_add(DKA + dkv_ptrs, dk * scale, mask=kmask, sem="relaxed")
    tl.atomic_add(DVA + dkv_ptrs, dv, mask=kmask, sem="relaxed")
    if CAST_DKV:
        if _last_arrival(DKA, cnt_row, stride_dkvt, b * num_heads + h, tl.num_programs(0)):
            _cast_rows(DKA, DK, dkv_start, kv_len, stride_dkvt, stride_dkvh, h, HEAD_DIM, BLOCK_N, BLOCK_D)
            _cast_rows(DVA, DV, dkv_start, kv_len, stride_dkvt, stride_dkvh, h, HEAD_DIM, BLOCK_N, BLOCK_D)


@triton.jit
def _bwd_q_resident_kernel(
    Q,
    K,
    V,
    Out,
    DO,
    LSE,
    DQA,
    DK,
    DV,
    DQ,
    AB,
    DAB,
    PT,
    DPT,
    TT,
    DTT,
    QTS,
    KTS,
    RF,
    q_off,
    kv_off,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dqat,
    stride_dqah,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_abt,
    stride_abh,
    stride_pth,
    stride_tth,
    scale,
    norm_scale,
    pos_log_inv,
    time_log_inv,
    num_heads,
    cnt_row,
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
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    TMA: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
    CAST_DQ: tl.constexpr,
):
    """The whole backward when every query sequence fits one BLOCK_M tile (PMA seeds over long keys): each program
    walks CHUNK key rows with Q, dO and the softmax delta loaded once, stores their dK, dV and score-bias gradients,
    and adds its share of dQ (scaled) into the fp32 DQA (atomics), whose rows are q's: a shared query sequence's
    gradient is summed over the key sequences right there. CAST_DQ: the last program of a sequence and head (of a
    head, for a shared query sequence) stores its dQ in DQ's dtype (`_q_resident_done`; counters in DQA from row
    cnt_row on)."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start, dkv_start = _seq_info(q_off, kv_off, b, Q_STRIDE, KV_STRIDE)
    n_begin = tl.program_id(0) * CHUNK
    region = (DQA, DQ, cnt_row, stride_dqat, stride_dqah, h, b, q_start, q_len, num_heads)
    if n_begin >= kv_len:
        if CAST_DQ:
            _q_resident_done(region, Q_STRIDE, HEAD_DIM, BLOCK_M, BLOCK_D)
        return
    n_end = tl.minimum(kv_len, n_begin + CHUNK)
    shift = kv_len - q_len
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    ns = _norm_scale(kv_len, norm_scale, NORM)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    o_rows = o_start + offs_m
    qmask = row_ok[:, None] & d_ok[None, :]
    if ROPE:
        q = _rope_load(
            Q, q_start + offs_m, stride_qt, stride_qh, h, offs_m + shift, row_ok, RF, HEAD_DIM, BLOCK_D, ROPE
        )
        do = _load_tile(DO, o_rows, stride_dot, stride_doh, h, offs_d, qmask, True)
    else:
        q, do = _load_pair(
            Q, DO, q_start + offs_m, o_rows, stride_qt, stride_qh, stride_dot, stride_doh, h, offs_d, qmask, True
        )
    lse = tl.load(LSE + o_rows * num_heads + h, mask=row_ok, other=float("inf"))
    if MODE == 0:
        o = _load_tile(Out, o_rows, stride_ot, stride_oh, h, offs_d, qmask, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    else:
        delta = lse
    if TMA:
        K = _seq_desc(K, kv_start, kv_len, stride_kt, stride_kh, h, HEAD_DIM, BLOCK_N, BLOCK_D)
        V = _seq_desc(V, kv_start, kv_len, stride_vt, stride_vh, h, HEAD_DIM, BLOCK_N, BLOCK_D)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(n_begin, n_end, BLOCK_N):
        dq = _bwd_q_tile(
            dq,
            q,
            do,
            lse,
            delta,
            n0,
            offs_m,
            offs_n0,
            offs_d,
            row_ok,
            d_ok,
            kv_start,
            kv_len,
            o_start,
            shift,
            h,
            ns,
            scale,
            K,
            V,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            AB,
            DAB,
            stride_abt,
            stride_abh,
            PT,
            DPT,
            stride_pth,
            TT,
            DTT,
            stride_tth,
            QTS,
            KTS,
            pos_log_inv,
            time_log_inv,
            DK,
            DV,
            dkv_start,
            stride_dkt,
            stride_dkh,
            stride_dvt,
            stride_dvh,
            MODE,
            CAUSAL,
            True,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            EVEN_D,
            FAST,
            TMA,
            True,
            RF,
            HEAD_DIM,
            WINDOW,
            MASK_BLOCK,
            ROPE,
        )
    if ROPE:
        _rope_store(
            DQA,
            q_start + offs_m,
            stride_dqat,
            stride_dqah,
            h,
            dq * scale,
            offs_m + shift,
            row_ok,
            RF,
            HEAD_DIM,
            BLOCK_D,
            FAST,
            True,
        )
    else:
        tl.atomic_add(
            DQA + (q_start + offs_m)[:, None] * stride_dqat + h * stride_dqah + offs_d[None, :],
            dq * scale,
            mask=qmask,
            sem="relaxed",
        )
    if CAST_DQ:
        _q_resident_done(region, Q_STRIDE, HEAD_DIM, BLOCK_M, BLOCK_D)


@triton.jit
def _q_resident_done(
    region,
    Q_STRIDE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """`_bwd_q_resident_kernel`'s arrival: the last program to add into a query sequence's dQ for head h (every program
    of the head for a shared query sequence, every program of the sequence otherwise) stores it in DQ's dtype."""
    DQA, DQ, cnt_row, stride_t, stride_h, h, b, q_start, q_len, num_heads = region
    if Q_STRIDE == 0:
        slot = h
        arrivals = tl.num_programs(0) * tl.num_programs(2)
    else:
        slot = b * num_heads + h
        arrivals = tl.num_programs(0)
    if _last_arrival(DQA, cnt_row, stride_t, slot, arrivals):
        _cast_rows(DQA, DQ, q_start, q_len, stride_t, stride_h, h, HEAD_DIM, BLOCK_M, BLOCK_D)


@triton.jit
def _bwd_one_launch_kernel(
    Q,
    K,
    V,
    Out,
    DO,
    LSE,
    DQ,
    DK,
    DV,
    AB,
    DAB,
    PT,
    DPT,
    TT,
    DTT,
    QTS,
    KTS,
    RF,
    q_off,
    kv_off,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_abt,
    stride_abh,
    stride_pth,
    stride_tth,
    scale,
    norm_scale,
    pos_log_inv,
    time_log_inv,
    num_heads,
    max_kv_len,
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
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
):
    """The whole backward in one launch. Programs [0, cdiv(max_kv_len, BLOCK_N)) of axis 0 compute dK/dV of one key
    block of BLOCK_N rows (query tiles of BLOCK_M), the rest dQ and the bias gradients of one query block of
    BLOCK_N rows (key tiles of BLOCK_M, the longest causal blocks first); both compute the softmax delta in-kernel."""
    num_kv_blocks = tl.cdiv(max_kv_len, BLOCK_N)
    DELTA_INLINE: tl.constexpr = MODE == 0
    if tl.program_id(0) < num_kv_blocks:
        _bwd_dkdv_kernel(
            Q,
            K,
            V,
            Out,
            DO,
            LSE,
            LSE,
            DK,
            DV,
            DQ,
            DQ,
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
            stride_vt,
            stride_vh,
            stride_ot,
            stride_oh,
            stride_dot,
            stride_doh,
            stride_dkt,
            stride_dkh,
            stride_dvt,
            stride_dvh,
            0,
            0,
            stride_abt,
            stride_abh,
            stride_pth,
            stride_tth,
            scale,
            norm_scale,
            pos_log_inv,
            time_log_inv,
            num_heads,
            0,
            HEAD_DIM,
            MODE,
            CAUSAL,
            NORM,
            Q_STRIDE,
            KV_STRIDE,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            FAST,
            False,
            DELTA_INLINE,
            BLOCK_D,
            BLOCK_M,
            BLOCK_N,
            TMA,
            WINDOW,
            MASK_BLOCK,
            ROPE,
            False,
        )
    else:
        _bwd_dq_kernel(
            Q,
            K,
            V,
            Out,
            DO,
            LSE,
            LSE,
            DQ,
            AB,
            DAB,
            PT,
            DPT,
            TT,
            DTT,
            QTS,
            KTS,
            RF,
            q_off,
            kv_off,
            stride_qt,
            stride_qh,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            stride_ot,
            stride_oh,
            stride_dot,
            stride_doh,
            stride_dqt,
            stride_dqh,
            stride_abt,
            stride_abh,
            stride_pth,
            stride_tth,
            scale,
            norm_scale,
            pos_log_inv,
            time_log_inv,
            num_heads,
            num_kv_blocks,
            HEAD_DIM,
            MODE,
            CAUSAL,
            NORM,
            Q_STRIDE,
            KV_STRIDE,
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            FAST,
            DELTA_INLINE,
            BLOCK_D,
            BLOCK_N,
            BLOCK_M,
            TMA,
            WINDOW,
            MASK_BLOCK,
            ROPE,
        )


@triton.jit
def _delta_kernel(
    Out,
    DO,
    DELTA,
    DQ,
    num_items,
    num_zero_items,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ZERO_DQ: tl.constexpr,
):
    """delta[row, h] = sum_d out * grad_out, in fp32 (softmax backward), over flattened (row, head) items. ZERO_DQ:
    also zero the contiguous fp32 dQ buffer that the dK/dV kernel then adds into (no separate fill launch), its first
    num_zero_items x HEAD_DIM entries (its counter rows included)."""
    item = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = item < num_items
    row = (item // num_heads).to(tl.int64)
    h = item % num_heads
    offs_d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(Out + row[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + row[:, None] * stride_dot + h[:, None] * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    tl.store(DELTA + item, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)
    if ZERO_DQ:
        tl.store(
            DQ + item.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :],
            tl.zeros([BLOCK_R, BLOCK_D], tl.float32),
            mask=(item < num_zero_items)[:, None] & (offs_d < HEAD_DIM)[None, :],
        )


@triton.jit
def _rope_dq_kernel(
    DQA,
    DQ,
    RF,
    q_off,
    kv_off,
    stride_dqat,
    stride_dqah,
    stride_dqt,
    stride_dqh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    Q_STRIDE: tl.constexpr,
    KV_STRIDE: tl.constexpr,
    FAST: tl.constexpr,
):
    """dQ w.r.t. the unrotated queries into DQ (any float dtype; DQ may be DQA itself) from DQA, the fp32 sum of the
    dK/dV kernel's partials w.r.t. the rotated, interleaved ones: RoPE's backward once per row, not per partial."""
    h = tl.program_id(1)
    q_start, q_len, kv_start, kv_len, o_start, _ = _seq_info(q_off, kv_off, tl.program_id(2), Q_STRIDE, KV_STRIDE)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R >= q_len:
        return
    row_ok = rows < q_len
    offs_d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    g = _load_tile(DQA, o_start + rows, stride_dqat, stride_dqah, h, offs_d, mask, True)
    c, s = _rope_cos_sin(rows + kv_len - q_len, RF, BLOCK_D, FAST)
    _rope_store_cs(DQ, o_start + rows, stride_dqt, stride_dqh, h, g, row_ok, c, s, HEAD_DIM, BLOCK_D, False)


COMPILE_OPTIONS = ("num_warps", "num_stages", "maxnreg")  # config keys that are triton's options, not constexprs


def _cfg(bm, bn, warps, stages, tma=False):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "TMA": tma}


def _rcfg(block, chunk, warps, stages, tma=False, streamed="BLOCK_M"):
    """A resident-side kernel's tile: the streamed side's block, CHUNK streamed rows per program (the resident side's
    block comes from the lengths)."""
    return {streamed: block, "CHUNK": chunk, "num_warps": warps, "num_stages": stages, "TMA": tma}


def _bcfg(sub, warps, stages=1, maxnreg=None):
    """A block kernel's tile: the queries of its block in slices of `sub` rows; `maxnreg` caps the registers per thread
    (two programs of 8 warps per SM need 128 or fewer)."""
    return {"SUB_M": sub, "num_warps": warps, "num_stages": stages} | ({"maxnreg": maxnreg} if maxnreg else {})


def _rq(block, chunk, warps, stages, tma=False):
    return _rcfg(block, chunk, warps, stages, tma, streamed="BLOCK_N")


# Candidate tiles per kernel (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA), all compiled in parallel and timed on
# the first call of each tuning key (per dtype: a call only gets the tiles whose `shared_estimate` fits the device);
# head dims above 128 get the smaller tiles that fit in shared memory. With autotuning off (`KernelOptions.autotune`),
# the first of them whose compiled kernel fits runs (`first_fitting`). TMA: the tiles the inner
# loop streams (K/V forward and in dQ, Q/dO in dK/dV) come through per-sequence tensor descriptors (TMA) instead of
# pointer tensors; those candidates are dropped when a tensor's layout does not allow a descriptor, or with
# `KernelOptions.tma` off.
CONFIGS = {
    "fwd": [
        _cfg(128, 64, 8, 3),
        _cfg(128, 128, 8, 3),
        _cfg(128, 64, 4, 3),
        _cfg(128, 64, 8, 4),
        _cfg(64, 64, 4, 3),
        _cfg(64, 128, 4, 3),
        _cfg(64, 32, 4, 2),
        _cfg(128, 32, 8, 3),
        _cfg(64, 64, 8, 3),
        _cfg(128, 64, 8, 3, True),
        _cfg(128, 128, 8, 3, True),
        _cfg(128, 128, 8, 2, True),
        _cfg(128, 64, 8, 4, True),
        _cfg(64, 64, 4, 3, True),
        _cfg(64, 64, 4, 4, True),
        _cfg(64, 64, 4, 2, True),
        _cfg(64, 32, 4, 2, True),
    ],
    "dkdv": [
        _cfg(64, 128, 8, 2),
        _cfg(64, 128, 8, 3),
        _cfg(32, 128, 8, 3),
        _cfg(32, 128, 4, 3),
        _cfg(64, 64, 4, 3),
        _cfg(128, 128, 8, 2),
        _cfg(32, 64, 4, 2),
        _cfg(32, 64, 8, 3),
        _cfg(64, 64, 8, 3),
        _cfg(16, 64, 8, 2),
        _cfg(64, 128, 8, 3, True),
        _cfg(32, 128, 8, 3, True),
        _cfg(32, 64, 4, 2, True),
        _cfg(64, 64, 4, 3, True),
    ],
    "dq": [
        _cfg(128, 64, 8, 2),
        _cfg(128, 64, 8, 3),
        _cfg(128, 32, 4, 3),
        _cfg(64, 64, 4, 3),
        _cfg(64, 32, 4, 2),
        _cfg(64, 32, 8, 2),
        _cfg(128, 64, 8, 3, True),
        _cfg(64, 64, 4, 3, True),
        _cfg(64, 32, 4, 2, True),
    ],
    # the one-launch backward: BLOCK_M x BLOCK_N tiles (queries x keys) in its dK/dV programs, swapped in its dQ ones
    "bwd1": [
        _cfg(32, 128, 8, 3),
        _cfg(64, 128, 8, 3),
        _cfg(64, 128, 8, 2),
        _cfg(64, 64, 4, 3),
        _cfg(32, 64, 4, 2),
        _cfg(16, 64, 4, 2),
        _cfg(64, 32, 4, 2),
        _cfg(32, 128, 8, 3, True),
        _cfg(64, 128, 8, 3, True),
        _cfg(32, 64, 4, 2, True),
    ],
    "delta": [{"BLOCK_R": 64, "num_warps": 4, "num_stages": 1}],
    "rope_dq": [{"BLOCK_R": 32, "num_warps": 4, "num_stages": 1}],
    # block attention (`block_attention`): the queries of a block of keys in slices of SUB_M rows
    "block_fwd": [_bcfg(64, 4), _bcfg(64, 8), _bcfg(32, 4), _bcfg(128, 8), _bcfg(16, 4)],
    "block_bwd": [
        _bcfg(64, 8),
        _bcfg(64, 4),
        _bcfg(64, 8, maxnreg=128),
        _bcfg(32, 4),
        _bcfg(32, 8),
        _bcfg(128, 8),
        _bcfg(16, 4),
    ],
    # resident K/V (forward, backward: query blocks streamed) and resident queries (backward: key blocks streamed)
    "fwd_rkv": [
        _rcfg(128, 1024, 8, 3),
        _rcfg(128, 512, 8, 3),
        _rcfg(64, 512, 4, 3),
        _rcfg(128, 256, 8, 3),
        _rcfg(64, 256, 4, 3),
        _rcfg(128, 1024, 8, 3, True),
        _rcfg(128, 512, 8, 2, True),
        _rcfg(64, 512, 4, 3, True),
        _rcfg(128, 256, 8, 3, True),
    ],
    "bwd_rkv": [
        _rcfg(64, 1024, 8, 2),
        _rcfg(64, 512, 8, 2),
        _rcfg(32, 512, 4, 2),
        _rcfg(32, 256, 4, 2),
        _rcfg(32, 256, 4, 3),
        _rcfg(128, 1024, 8, 2),
        _rcfg(64, 1024, 8, 2, True),
        _rcfg(64, 512, 8, 3, True),
        _rcfg(32, 512, 4, 3, True),
        _rcfg(32, 256, 4, 3, True),
        _rcfg(32, 256, 4, 2, True),
        _rcfg(64, 256, 8, 3, True),
    ],
    "bwd_rq": [
        _rq(64, 1024, 4, 3),
        _rq(64, 512, 4, 3),
        _rq(64, 256, 4, 3),
        _rq(32, 256, 4, 3),
        _rq(32, 512, 4, 2),
        _rq(128, 1024, 8, 3),
        _rq(64, 1024, 4, 3, True),
        _rq(128, 1024, 8, 3, True),
        _rq(64, 512, 4, 2, True),
        _rq(64, 256, 4, 3, True),
        _rq(64, 512, 4, 3, True),
    ],
}
LARGE_HEAD_DIM_CONFIGS = {
    "fwd": [_cfg(64, 64, 8, 2), _cfg(64, 32, 4, 2), _cfg(64, 64, 8, 2, True)],
    "dkdv": [_cfg(32, 64, 4, 2), _cfg(64, 64, 8, 2), _cfg(32, 64, 4, 2, True), _cfg(32, 32, 4, 2)],
    "dq": [_cfg(64, 32, 4, 2), _cfg(64, 64, 8, 2), _cfg(64, 32, 4, 2, True), _cfg(32, 32, 4, 2)],
    "fwd_rkv": [_rcfg(64, 512, 4, 2), _rcfg(64, 512, 8, 2), _rcfg(64, 512, 4, 2, True)],
    "bwd_rkv": [_rcfg(32, 512, 4, 2), _rcfg(32, 512, 8, 2), _rcfg(32, 512, 4, 2, True)],
    "bwd_rq": [_rq(32, 512, 4, 2), _rq(32, 512, 8, 2), _rq(32, 512, 4, 2, True)],
}
# Autotuning times every candidate in a 25 ms burst, then the best TUNE_FINALISTS again after TUNE_FINAL_MS of warm-up
# for TUNE_FINAL_MS each, and keeps the fastest of those: bursts once ranked A's 64x64 forward tile first although it
# ran 8% slower than 128x128 under sustained load (H200, 2026-11-30), where clocks are lower.
TUNE_FINALISTS = 3
TUNE_FINAL_MS = 100
# The resident-side kernels keep the short side's (rows x head dim) tile, and its fp32 gradient, loaded for the whole
# program: used where the short side's rows (a power of two, at least 16) times the head-dim tile fit this.
RESIDENT_MAX_TILE = 64 * 128
# Fused dQ (atomics) pays when each query block meets several key blocks; with short key sequences (cross-
# attention to a few tokens) the recompute kernel is cheaper than an fp32 atomic per dQ element per key block.
FUSE_DQ_MIN_KV = 128
# With `KernelOptions.one_launch`, problems whose padded work (sequences x max query length x max key length x heads x
# head dim) is below this take the one-launch backward: bound by host launch time, not by the GPU (configs B and C
# of `gemrec bench kernels` are 2^32-2^36, A is 2^39).
ONE_LAUNCH_MAX_WORK = 2**37


def _gcfg(bn, stages):
    """A Gluon kernel's tile (`gluon_attention`): 2 x 64 query rows, BLOCK_N keys, a ring of `num_stages` K/V stages."""
    return {"GLUON": True, "BLOCK_M": 128, "BLOCK_N": bn, "num_warps": 4, "num_stages": stages}


# Warp-specialized Gluon kernels that join a kind's candidates on Hopper where they cover the call (their `covers`).
GLUON_CONFIGS = {"fwd": [_gcfg(128, 3), _gcfg(64, 3)]}


def shared_estimate(kind: str, config: dict, consts: dict, itemsize: int) -> int:
    """A tile's shared memory (bytes) as its matrix products' operands take it: the resident tiles once, the streamed
    ones (with RoPE also the rotated side's cos/sin rows) once per pipeline stage, the backward's transposed score
    tiles (exact for the forward, within a few percent or above for the rest on sm_90). A pre-filter: fp32 doubles
    every tile (A's 128x128 forward tile needs 459,776 bytes), and what passes is still compiled and checked against
    the device (`first_fitting`, the tuner)."""
    bd = consts.get("BLOCK_D", consts["HEAD_DIM"])
    bm, bn = config.get("BLOCK_M", consts.get("BLOCK_M", 0)), config.get("BLOCK_N", consts.get("BLOCK_N", 0))
    stages, block, sub = config.get("num_stages", 1), consts.get("MASK_BLOCK", 0), config.get("SUB_M", 0)
    rope = 1 if consts.get("ROPE") else 0
    tiles = {
        "fwd": bm * bd + (2 + rope) * stages * bn * bd,
        "dkdv": 2 * bn * bd + (2 + rope) * stages * bm * bd + 2 * bn * bm,
        "bwd1": 2 * bn * bd + (2 + rope) * stages * bm * bd + 2 * bn * bm,
        "dq": 2 * bm * bd + (2 + rope) * stages * bn * bd + 2 * bn * bm,
        "fwd_rkv": 2 * bn * bd + (1 + rope) * stages * bm * bd,
        "bwd_rkv": 2 * bn * bd + (2 + rope) * stages * bm * bd + 2 * bn * bm,
        "bwd_rq": 2 * bm * bd + (2 + rope) * stages * bn * bd + 2 * bn * bm,
        "block_fwd": 2 * block * bd + sub * bd,
        "block_bwd": 2 * block * bd + 2 * sub * bd + 2 * block * sub,
    }.get(kind, 0)
    return tiles * itemsize


def _candidates(kind: str, consts: dict, dtype, tma: bool = True, shared_limit: int | None = None) -> list[dict]:
    """A kernel's tile candidates for a call: TMA ones where `tma`, block-kernel slices within the block, and with a
    `shared_limit` (the device's bytes per block) only those whose `shared_estimate` for the dtype fits it."""
    head_dim = consts["HEAD_DIM"]
    configs = LARGE_HEAD_DIM_CONFIGS[kind] if head_dim > 128 and kind in LARGE_HEAD_DIM_CONFIGS else CONFIGS[kind]
    return [
        c
        for c in configs
        if (tma or not c.get("TMA"))
        and c.get("SUB_M", 0) <= consts.get("MASK_BLOCK", 0)
        and (shared_limit is None or shared_estimate(kind, c, consts, dtype.itemsize) <= shared_limit)
    ]


def gluon_candidates(kind: str, consts: dict, dtype, tma: bool, options: KernelOptions) -> list[dict]:
    """The Gluon tiles of a call with descriptor-ready tensors, in what they cover (they need Hopper: sm_90), where
    `options.gluon` is on."""
    if INTERPRET or not tma or kind not in GLUON_CONFIGS or not options.gluon:
        return []
    from gemrec.kernels import gluon_attention

    return GLUON_CONFIGS[kind] if gluon_attention.covers(consts, dtype) else []


def tma_ok(*tensors) -> bool:
    """Whether (rows, heads, head_dim) tensors allow per-sequence tensor descriptors: 16-byte aligned base and
    row/head strides, contiguous head_dim of at least 16 bytes."""
    for t in tensors:
        size = t.element_size()
        rows, heads, one = t.stride()
        if one != 1 or (t.data_ptr() | rows * size | heads * size) & 15 or t.shape[2] * size < 16:
            return False
    return True


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids (triton.cdiv is a constexpr function, several times slower on the host)."""
    return -(-a // b)


def _scratch(size: int, alignment: int, stream):
    """Global scratch for kernels that build tensor descriptors on the device (128 bytes per descriptor)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def launch_hooked() -> bool:
    """Whether anything listens to kernel launches (proton, a profiler hook): those launches go through triton's
    own path, which calls the hooks. Triton 3.6 keeps the hooks as chains that are never None, empty when unused."""
    hooks = triton.knobs.runtime
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


def first_fitting(kind: str, candidates: list[dict], shared, limit: int, what: str) -> dict:
    """The first candidate whose compiled kernel's shared memory (`shared(config)`, bytes) fits `limit`: what runs
    untuned; none fitting is an error naming the kernel, the call and the tiles tried."""
    for config in candidates:
        if shared(config) <= limit:
            return config
    tried = [_config_name(c) for c in candidates]
    raise RuntimeError(f"no {kind} tile fits the device's {limit} bytes of shared memory ({what}): {tried}")


@functools.cache
def shared_memory_limit(device: int) -> int:
    """Shared memory one program may use on a CUDA device, in bytes (232,448 on an H100/H200)."""
    return triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]


def _spec(a):
    """What triton specializes a compiled kernel on, for one argument: dtype and 16-byte alignment of a pointer; for
    an int whether it equals 1, is divisible by 16 or needs 64 bits; the type of anything else."""
    kind = type(a)
    if kind is int:
        return a == 1, not a & 15, -(2**31) <= a < 2**31
    if isinstance(a, torch.Tensor):
        return a.dtype, not a.data_ptr() & 15
    return kind


def _spec_key(args, num_tensors: int, scalar_specs: dict) -> tuple[tuple, list[int]]:
    """The specialization of every argument (`_spec`), as one flat tuple: a cached compiled kernel is reused only for
    the same key; and the tensors' addresses, what the direct launch passes for them (an int pointer argument spares
    the launcher a `data_ptr()` call and a `cuPointerGetAttribute` query per tensor). The tensors (the first
    `num_tensors` arguments) by dtype and address modulo 16 (finer than triton's 16-byte alignment, never coarser), a
    tensor that repeats the one before it (absent biases and timestamps all get the same dummy) as None. The scalars
    after them are nearly all the same from call to call (strides, head counts): their specs are memoized per scalar
    tuple in `scalar_specs` (cleared when it grows past 4096)."""
    tensors, scalars = args[:num_tensors], args[num_tensors:]
    specs = scalar_specs.get(scalars)
    if specs is None:
        if len(scalar_specs) >= 4096:
            scalar_specs.clear()
        specs = scalar_specs[scalars] = tuple(map(_spec, scalars))
    key = [specs]
    pointers = []
    previous = None
    for t in tensors:
        if t is previous:
            key.append(None)
        else:
            previous = t
            pointer = t.data_ptr()
            key += (t.dtype, pointer & 15)
        pointers.append(pointer)
    return tuple(key), pointers


def _direct_launch(kernel, tail: tuple) -> tuple:
    """How `_Kernel` launches a compiled kernel straight from Python: (launch, stream_of, head, tail), called as
    launch(grid x, y, z, stream_of(device), *head, *tensor pointers, *scalars, *tail) with `tail` its constexprs. The C
    launcher itself where the kernel needs no global or profiling scratch (a Python frame less per launch), else
    triton's launcher object, which allocates the scratch (tensor descriptors built on the device)."""
    launcher = kernel.run
    stream_of = triton.runtime.driver.active.get_current_stream
    if launcher.global_scratch_size == 0 and launcher.profile_scratch_size == 0:
        flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)
        head = (kernel.function, *flags, None, None, kernel.packed_metadata, None, None, None)
        return launcher.launch, stream_of, head, tail
    return launcher, stream_of, (kernel.function, kernel.packed_metadata, None, None, None), tail


class _Kernel:
    """One Triton kernel's launches.

    Per tuning key (the constexprs and a bucketed length) the tile config is chosen once: every candidate is
    compiled in parallel, then timed on the real arguments (buffers in `reset` zeroed before each trial and
    after). Per specialization (`_spec_key`) the compiled kernel is kept and launched directly, skipping
    triton's per-call argument binding, which costs more host time than small configs take on the GPU.
    """

    def __init__(self, fn, kind: str, interpret_tiles: dict | None = None):
        self.fn, self.kind = fn, kind
        self.interpret_tiles = interpret_tiles or {}  # tiles under the interpreter other than 16
        # tuning key -> (tile config, {specialization key: `_direct_launch`'s entry})
        self.tuned: dict = {}
        self.num_tensors: int | None = None  # arguments before the scalars (`_spec_key`), from the first launch
        self.scalar_specs: dict = {}
        self.tuning_log: list[dict] = []  # per tuning: key, seconds, (ms, config) of every candidate

    @property
    def best(self) -> dict:
        """Tuning key -> the tile config chosen for it."""
        return {key: config for key, (config, _) in self.tuned.items()}

    def variant(self, config: dict):
        """The kernel a tile config runs and its tile constexprs: the Triton kernel, or a Gluon one (`GLUON_CONFIGS`,
        whose K/V ring depth is num_stages)."""
        if not config.get("GLUON"):
            return self.fn, config
        from gemrec.kernels import gluon_attention

        tiles = {k: v for k, v in config.items() if k not in ("GLUON", "num_stages")}
        return gluon_attention.KERNELS[self.kind], {**tiles, "STAGES": config["num_stages"]}

    def __call__(self, grid, args: tuple, consts: dict, bucket: int, options: KernelOptions, reset=(), tma=False):
        """grid: config -> launch grid; args: the runtime arguments in order; consts: constexprs but tiles;
        tma: whether the tensors allow the tensor-descriptor candidates (used where `options.tma`)."""
        tma = tma and options.tma
        if INTERPRET:  # small tiles keep the interpreter quick and exercise the ragged-edge paths
            first = _candidates(self.kind, consts, args[0].dtype, tma)[0]
            tiles = {
                name: self.interpret_tiles.get(name, 16)
                for name in first
                if name.startswith("BLOCK") or name in self.interpret_tiles
            }
            if "TMA" in first:
                tiles["TMA"] = tma
            self.fn[grid(tiles)](*args, **consts, **tiles)
            return
        if tma:  # per call: the allocator is a context variable, and backward runs on autograd's own thread
            triton.set_allocator(_scratch)
        tune = options.autotune
        # what changes the candidates: dtype, tma, gluon; without autotuning the first that fits, whatever the lengths
        dtype = args[0].dtype
        tune_key = (
            tuple(consts.values()),
            dtype,
            bucket if tune else None,
            tma,
            options.gluon,
            torch._C._cuda_getDevice(),  # torch.cuda.current_device() without its lazy-init check: q is on CUDA
        )
        tuned = self.tuned.get(tune_key)
        if tuned is None:
            limit = shared_memory_limit(tune_key[-1])
            candidates = _candidates(self.kind, consts, dtype, tma, limit)
            if tune and torch.cuda.get_device_capability(tune_key[-1]) == (9, 0):
                candidates += gluon_candidates(self.kind, consts, dtype, tma, options)
            if tune and len(candidates) > 1:
                config = self._tune(tune_key, grid, args, consts, candidates, reset)
            else:
                config = self._first_fitting(grid, args, consts, candidates, limit)
            compiled: dict = {}
            tuned = self.tuned[tune_key] = (config, compiled)
        config, launches = tuned
        num_tensors = self.num_tensors
        if num_tensors is None:
            num_tensors = self.num_tensors = 1 + max(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        spec, pointers = _spec_key(args, num_tensors, self.scalar_specs)
        entry = launches.get(spec)
        g = grid(config)
        if entry is None or launch_hooked():
            fn, tiles = self.variant(config)
            kernel = fn.run(*args, grid=g, warmup=False, **consts, **tiles)
            launches[spec] = _direct_launch(kernel, tuple({**consts, **tiles}[n] for n in _const_names(fn)))
            return
        launch, stream_of, head, tail = entry
        grid_x, grid_y, grid_z = (*g, 1, 1)[:3]  # grids may have fewer than 3 dimensions (the delta kernel's has 1)
        launch(grid_x, grid_y, grid_z, stream_of(tune_key[-1]), *head, *pointers, *args[num_tensors:], *tail)

    def _first_fitting(self, grid, args, consts, candidates, limit: int) -> dict:
        def shared(config):
            fn, tiles = self.variant(config)
            return fn.warmup(*args, grid=grid(config), **consts, **tiles).metadata.shared

        return first_fitting(self.kind, candidates, shared, limit, f"{args[0].dtype}, head_dim {consts['HEAD_DIM']}")

    def _tune(self, tune_key, grid, args, consts, candidates, reset) -> dict:
        from triton.runtime._async_compile import AsyncCompileMode
        from triton.testing import do_bench

        start = time.perf_counter()

        workers = min(len(candidates), os.cpu_count() or 1)
        with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for config in candidates:
                fn, tiles = self.variant(config)
                fn.warmup(*args, grid=grid(config), **consts, **tiles)

        def trial(config):
            for t in reset:
                t.zero_()
            fn, tiles = self.variant(config)
            fn.run(*args, grid=grid(config), warmup=False, **consts, **tiles)

        timings, failures = [], []
        for config in candidates:
            try:
                timings.append(
                    (do_bench(functools.partial(trial, config), warmup=5, rep=25, return_mode="median"), config)
                )
            except OutOfResources:
                continue
            except Exception as err:  # a candidate that fails to build is skipped and logged
                failures.append((_config_name(config), f"{type(err).__name__}: {err}"[:300]))
        if not timings:
            raise RuntimeError(f"no {self.kind} candidate ran: {failures}")
        finals = []
        if len(timings) > 1:
            for _, config in sorted(timings, key=lambda tc: tc[0])[:TUNE_FINALISTS]:
                finals.append(
                    (
                        do_bench(
                            functools.partial(trial, config),
                            warmup=TUNE_FINAL_MS,
                            rep=TUNE_FINAL_MS,
                            return_mode="median",
                        ),
                        config,
                    )
                )
        for t in reset:
            t.zero_()
        self.tuning_log.append(
            {
                "key": tune_key,
                "consts": dict(consts),
                "started": start,
                "seconds": time.perf_counter() - start,
                "timings": timings,
                "finals": finals,
                "failures": failures,
            }
        )
        return min(finals or timings, key=lambda tc: tc[0])[1]


_KERNELS = {
    "fwd": _Kernel(_fwd_kernel, "fwd"),
    "dkdv": _Kernel(_bwd_dkdv_kernel, "dkdv"),
    "dq": _Kernel(_bwd_dq_kernel, "dq"),
    # unequal tiles in the interpreter: its dQ programs swap them
    "bwd1": _Kernel(_bwd_one_launch_kernel, "bwd1", interpret_tiles={"BLOCK_N": 32}),
    "delta": _Kernel(_delta_kernel, "delta"),
    "rope_dq": _Kernel(_rope_dq_kernel, "rope_dq"),
    # two streamed blocks per program in the interpreter: the loop and the cross-program atomics both run
    "fwd_rkv": _Kernel(_fwd_kv_resident_kernel, "fwd_rkv", interpret_tiles={"CHUNK": 32}),
    "bwd_rkv": _Kernel(_bwd_kv_resident_kernel, "bwd_rkv", interpret_tiles={"CHUNK": 32}),
    "bwd_rq": _Kernel(_bwd_q_resident_kernel, "bwd_rq", interpret_tiles={"CHUNK": 32}),
}  # and the block kernels, which `block_attention` adds


@functools.cache
def _const_names(fn) -> list[str]:
    """A kernel's constexpr parameters, which come last (the direct launch passes them positionally)."""
    params = inspect.signature(fn.fn).parameters.values()
    names = [prm.name for prm in params if prm.annotation is tl.constexpr]
    assert [prm.name for prm in params][-len(names) :] == names, "constexprs come last"
    return names


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def tuned_configs() -> list[dict]:
    """What the autotuner chose so far in this process, per kernel and key, in the order it tuned them (for
    benchmark reports)."""
    out = []
    entries = sorted(
        ((entry, kind) for kind, kernel in _KERNELS.items() for entry in kernel.tuning_log),
        key=lambda pair: pair[0]["started"],
    )

    def named(timings):
        return {_config_name(c): round(ms, 4) for ms, c in sorted(timings, key=lambda tc: tc[0])}

    for entry, kind in entries:
        best_ms, best = min(entry["finals"] or entry["timings"], key=lambda tc: tc[0])
        out.append(
            {
                "kernel": kind,
                "constexprs": entry["consts"],
                "dtype": str(entry["key"][1]).removeprefix("torch."),
                "len_buckets": entry["key"][2],
                "config": best,
                "ms": round(best_ms, 4),
                "tuning_s": round(entry["seconds"], 2),
                "candidates_ms": named(entry["timings"]),
                "finalists_ms": named(entry["finals"]),
                "failures": entry["failures"],
            }
        )
    return out


def _config_name(config: dict) -> str:
    """e.g. 128x64w8s3 (BLOCK_M x BLOCK_N, warps, stages), m128c1024w8s3 for a resident-side kernel (streamed block,
    CHUNK rows per program), +tma when the streamed tiles come through descriptors."""
    if "BLOCK_M" not in config and "BLOCK_N" not in config:
        return ",".join(f"{k}={v}" for k, v in config.items())
    if "CHUNK" in config:
        streamed = "m" if "BLOCK_M" in config else "n"
        name = f"{streamed}{config.get('BLOCK_M', config.get('BLOCK_N'))}c{config['CHUNK']}"
    else:
        name = f"{config['BLOCK_M']}x{config['BLOCK_N']}"
    name += f"w{config['num_warps']}s{config['num_stages']}"
    return name + ("+tma" if config.get("TMA") else "") + ("+gluon" if config.get("GLUON") else "")


def _len_bucket(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 64 else 64


def _resident_block(length: int) -> int:
    """The resident side's tile rows for sequences of up to `length` rows."""
    return max(16, _pow2_at_least(length))


ROPE_HI_BITS = 8  # significant bits of a frequency's high part: pos * hi is exact in fp32 for |pos| < 2^(24 - 8)


@functools.cache
def rope_table(head_dim: int, base: float, block_d: int, dtype, length: int, device) -> torch.Tensor:
    """The kernels' RoPE buffer, fp32: `rope_frequencies` (for `_rope_cos_sin`, the gradients' rotation in fp32), then
    the table of `_rope_load` (`_rope_origin`): positions -length to length - 1, each block_d // 2 cos then
    block_d // 2 sin in `dtype` (zero past head_dim // 2), from float64 angles as `reference.rope_cos_sin`'s. Built on
    the host and copied, as `rope_frequencies`: never half-built inside a CUDA graph capture."""
    pos = torch.arange(-length, length, dtype=torch.float64)
    angles = pos[:, None] * base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    table = torch.zeros(2 * length, 2, block_d // 2, dtype=dtype)
    table[:, 0, : head_dim // 2] = angles.cos()
    table[:, 1, : head_dim // 2] = angles.sin()
    freqs = rope_frequencies(head_dim, base, block_d, torch.device("cpu"))
    return torch.cat([freqs.flatten(), table.flatten().view(torch.float32)]).to(device)


@functools.cache
def rope_frequencies(head_dim: int, base: float, block_d: int, device) -> torch.Tensor:
    """The RoPE frequencies of `_rope_cos_sin`, (2, block_d // 2) fp32: frequency m = base^(-2m/D) / (2 pi) in turns
    per position, split into a high part of ROPE_HI_BITS significant bits (row 0) and the float64 rest (row 1)."""
    table = torch.zeros(2, block_d // 2, dtype=torch.float64)
    for m in range(head_dim // 2):
        turns = base ** (-2 * m / head_dim) / (2 * math.pi)
        mantissa, exponent = math.frexp(turns)
        hi = math.ldexp(round(mantissa * 2**ROPE_HI_BITS), exponent - ROPE_HI_BITS)
        table[0, m], table[1, m] = hi, turns - hi
    return table.float().to(device)


def _log_inv(num_pos: int, max_distance: int) -> float:
    exact = num_pos // 2
    return (num_pos - exact) / math.log(max_distance / exact) if num_pos >= 2 else 0.0


class Problem:
    """Everything the kernels share about one call, resolved on the host (no device syncs)."""

    def __init__(
        self,
        q,
        k,
        v,
        q_offsets,
        kv_offsets,
        max_q_len,
        max_kv_len,
        mode,
        causal,
        scale,
        norm,
        attn_bias,
        pos_table,
        time_table,
        q_timestamps,
        kv_timestamps,
        pos_max_distance,
        time_log_base,
        options,
        window=0,
        block=0,
        rope_base=0.0,
    ):
        self.q, self.k, self.v = q, k, v
        self.options = options
        q_rows, self.heads, self.head_dim = q.shape
        nq, nkv = q_offsets.numel(), kv_offsets.numel()
        self.q_shared = nq == 2 and nkv > 2
        self.kv_shared = nkv == 2 and nq > 2
        self.num_seqs = max(nq, nkv) - 1
        self.q_off, self.kv_off = q_offsets, kv_offsets
        self.total_out = q_rows * self.num_seqs if self.q_shared else q_rows
        self.max_q_len, self.max_kv_len = max_q_len, max_kv_len
        self.mode, self.causal, self.scale, self.norm = mode, causal, scale, norm
        self.attn_bias, self.pos_table, self.time_table = attn_bias, pos_table, time_table
        self.has_bias = attn_bias is not None or pos_table is not None or time_table is not None
        self.q_ts, self.kv_ts = q_timestamps, kv_timestamps
        self.num_pos = pos_table.shape[1] if pos_table is not None else 1
        self.num_time = time_table.shape[1] if time_table is not None else 1
        self.pos_log_inv = _log_inv(self.num_pos, pos_max_distance) if pos_table is not None else 0.0
        self.time_log_inv = 1.0 / math.log(time_log_base) if time_table is not None else 0.0
        self.inv_max_len = 1.0 / max(max_kv_len, 1)
        # Longest sequences and total rows: a 4-sequence correctness check must not pick the tiles of a full batch.
        self.bucket = (
            _len_bucket(max_q_len),
            _len_bucket(max_kv_len),
            _len_bucket(q_rows),
            _len_bucket(k.shape[0]),
        )
        self.consts = {
            "HEAD_DIM": self.head_dim,
            "MODE": mode,
            "CAUSAL": causal,
            "NORM": norm,
            "Q_STRIDE": 0 if self.q_shared else 1,
            "KV_STRIDE": 0 if self.kv_shared else 1,
            "HAS_AB": attn_bias is not None,
            "HAS_POS": pos_table is not None,
            "HAS_TIME": time_table is not None,
            "NUM_POS": self.num_pos,
            "NUM_TIME": self.num_time,
            "FAST": not INTERPRET,
            "WINDOW": int(window or 0),
            "MASK_BLOCK": int(block or 0),
            # the RoPE table's positions either side of 0 (`rope_table`): queries sit at -max_q_len or later
            "ROPE": _pow2_at_least(max(max_q_len, max_kv_len, 16)) if rope_base else 0,
        }
        self.block_d = max(16, _pow2_at_least(self.head_dim))
        self.window, self.mask_block, self.rope_base = int(window or 0), int(block or 0), float(rope_base or 0.0)
        self.rope = (
            rope_table(self.head_dim, self.rope_base, self.block_d, q.dtype, self.consts["ROPE"], q.device)
            if rope_base
            else q_offsets
        )
        # what every launch passes unchanged (`kernel_args`); absent timestamps get a dummy tensor
        self.timestamps = (
            q_timestamps if q_timestamps is not None else q_offsets,
            kv_timestamps if kv_timestamps is not None else q_offsets,
        )
        self.scales = (scale, scale * LOG2E)
        self.positions = (self.inv_max_len, self.pos_log_inv, self.time_log_inv)
        self.resident_side = self._resident()

    def bind(self, tensors: tuple | None) -> "Problem":
        """This problem, in place, on other differentiable tensors of the same shapes and dtypes: (q, k, v, attn_bias,
        pos_table, time_table); None: without them (what autograd keeps from the forward for the backward, which binds
        it to the saved tensors). Offsets and timestamps stay."""
        self.q, self.k, self.v, self.attn_bias, self.pos_table, self.time_table = (
            (None,) * 6 if tensors is None else tensors
        )
        return self

    def resident(self) -> str | None:
        """Which side a program keeps loaded (`_resident`, resolved once per problem)."""
        return self.resident_side

    def _resident(self) -> str | None:
        """Which side a program keeps loaded while it walks the other (`RESIDENT_MAX_TILE`): "kv" where every key
        sequence fits one tile (cross-attention to a few tokens; forward and backward), else "q" where every query
        sequence does (PMA seeds; backward, whose forward already keeps its query block); None otherwise or without
        `options.resident`. Their backward is one launch with the softmax delta computed in-kernel."""
        if not self.options.resident:
            return None
        if _resident_block(self.max_kv_len) * self.block_d <= RESIDENT_MAX_TILE:
            return "kv"
        if _resident_block(self.max_q_len) * self.block_d <= RESIDENT_MAX_TILE:
            return "q"
        return None

    def block_kernel(self) -> bool:
        """Whether the block kernels (`block_attention`) run this problem: a block of 64 or 128 positions, head dims
        up to 128; other block sizes are a mask of the tiled kernels."""
        return self.mask_block in (64, 128) and self.block_d <= 128

    def tma_ok(self, *tensors, rope_halves: bool = False) -> bool:
        """Whether the tensor-descriptor tiles apply: the layout allows them, and with RoPE (rotated in registers) only
        for kernels that load the rotated side in halves (`rope_halves`: forward, dK/dV) of a head dim that is its
        own tile, with 16-byte aligned halves."""
        halves = rope_halves and self.head_dim == self.block_d and self.head_dim // 2 * self.q.element_size() % 16 == 0
        return (not self.rope_base or halves) and tma_ok(*tensors)

    def fuse_dq(self) -> bool:
        return not self.has_bias and self.max_kv_len >= FUSE_DQ_MIN_KV

    def small(self) -> bool:
        """Below ONE_LAUNCH_MAX_WORK: a problem whose eager calls are bound by the host's launches."""
        return self.num_seqs * self.max_q_len * self.max_kv_len * self.heads * self.head_dim < ONE_LAUNCH_MAX_WORK

    def one_launch(self) -> bool:
        """Whether the backward is one launch (`_bwd_one_launch_kernel`): with `options.one_launch`, for small
        problems with head dims up to 128 (above, its tiles spill 1.5-2.5 KB per thread on sm_90), with or without
        score biases."""
        return self.options.one_launch and self.head_dim <= 128 and self.small()

    def kernel_args(self, tensors: tuple, strided: tuple, grads: tuple | None = None, *, qk_scale=False, tail=()):
        """A launch's arguments in the order every attention kernel takes them: `tensors` (q, k, v, then the outputs
        and buffers of this kernel), the score biases (each followed by its gradient in `grads`, from
        `_bias_grad_args`, when given), timestamps, RoPE table and offsets, the row and head strides of `strided` (0, 0
        for None) and of the biases, the scale (and the log2-domain `qk_scale` when asked), `inv_max_len`, the
        buckets' log factors, then `tail`. Absent biases and timestamps get a dummy tensor, their strides 0."""
        dummy = self.q_off
        if self.has_bias:
            ab, pt, tt = self.attn_bias, self.pos_table, self.time_table
            bias_strides: tuple = (
                ab.stride(0) if ab is not None else 0,
                ab.stride(1) if ab is not None else 0,
                pt.stride(0) if pt is not None else 0,
                tt.stride(0) if tt is not None else 0,
            )
            ab = ab if ab is not None else dummy
            pt = pt if pt is not None else dummy
            tt = tt if tt is not None else dummy
            biases = (ab, pt, tt) if grads is None else (ab, grads[0], pt, grads[1], tt, grads[2])
        else:
            bias_strides = (0, 0, 0, 0)
            biases = (dummy,) * 3 if grads is None else (dummy, grads[0], dummy, grads[1], dummy, grads[2])
        strides: list[int] = []
        for t in strided:
            strides += t.stride()[:2] if t is not None else (0, 0)
        return (
            *tensors,
            *biases,
            *self.timestamps,
            self.rope,
            self.q_off,
            self.kv_off,
            *strides,
            *bias_strides,
            *(self.scales if qk_scale else self.scales[:1]),
            *self.positions,
            *tail,
        )


def forward(p: Problem):
    q, k, v = p.q, p.k, p.v
    out = q.new_empty((p.total_out, p.heads, p.head_dim))  # new_empty: ~0.5 us less host time than torch.empty
    lse = q.new_empty((p.total_out, p.heads), dtype=torch.float32)
    if p.total_out == 0 or p.num_seqs == 0:
        return out.zero_(), lse.fill_(float("inf"))
    if p.options.fp8:
        from gemrec.kernels import fp8_attention

        return fp8_attention.forward(p, out, lse)
    if p.block_kernel():
        from gemrec.kernels import block_attention

        return block_attention.forward(p, out, lse)
    args = p.kernel_args((q, k, v, out, lse), (q, k, v, out), qk_scale=True, tail=(p.heads,))
    consts = {**p.consts, "BLOCK_D": p.block_d, "SCALE_POS": p.scale > 0}
    if p.resident() == "kv":

        def grid(meta):
            return (_cdiv(max(p.max_q_len, 1), meta["CHUNK"]), p.heads, p.num_seqs)

        _KERNELS["fwd_rkv"](
            grid, args, {**consts, "BLOCK_N": _resident_block(p.max_kv_len)}, p.bucket, p.options, tma=p.tma_ok(q)
        )
    else:

        def grid(meta):
            return (_cdiv(max(p.max_q_len, 1), meta["BLOCK_M"]), p.heads, p.num_seqs)

        _KERNELS["fwd"](grid, args, consts, p.bucket, p.options, tma=p.tma_ok(k, v, rope_halves=True))
    return out, lse


def _delta(p: Problem, out, grad_out, dq=None):
    """The softmax delta per (row, head); with `dq` (a contiguous fp32 (rows, heads, head_dim) buffer of at least the
    output's rows: its counter rows too) zeroes it too."""
    delta = out.new_empty((p.total_out, p.heads), dtype=torch.float32)
    num_items = p.total_out * p.heads
    num_zero_items = 0 if dq is None else dq.shape[0] * p.heads

    def grid(meta):
        return (_cdiv(max(num_items, num_zero_items), meta["BLOCK_R"]),)

    out_strides, go_strides = out.stride(), grad_out.stride()
    args = (
        out,
        grad_out,
        delta,
        delta if dq is None else dq,
        num_items,
        num_zero_items,
        out_strides[0],
        out_strides[1],
        go_strides[0],
        go_strides[1],
        p.heads,
    )
    consts = {"HEAD_DIM": p.head_dim, "BLOCK_D": p.block_d, "ZERO_DQ": dq is not None}
    _KERNELS["delta"](grid, args, consts, 0, p.options)
    return delta


def _rope_dq(p: Problem, dqa, dq):
    """dQ w.r.t. the unrotated queries into `dq` (q's dtype, or `dqa` itself: in place) from the dK/dV kernel's fp32 sum
    w.r.t. the rotated ones (`_rope_dq_kernel`)."""

    def grid(meta):
        return (_cdiv(max(p.max_q_len, 1), meta["BLOCK_R"]), p.heads, p.num_seqs)

    args = (dqa, dq, p.rope, p.q_off, p.kv_off, dqa.stride(0), dqa.stride(1), dq.stride(0), dq.stride(1))
    names = ("HEAD_DIM", "Q_STRIDE", "KV_STRIDE", "FAST")
    consts = {**{n: p.consts[n] for n in names}, "BLOCK_D": p.block_d}
    _KERNELS["rope_dq"](grid, args, consts, 0, p.options)


def _bias_grad_args(p: Problem, dab, dpt, dtt) -> tuple:
    """The dQ-side kernels' DAB, DPT, DTT arguments: the autotuner zeroes DPT/DTT between trials, so absent tables
    get a scratch, never a live input."""
    scratch = torch.zeros(1, dtype=torch.float32, device=p.q.device) if p.has_bias else p.q_off
    return (
        dab if dab is not None else p.q_off,
        dpt if dpt is not None else scratch,
        dtt if dtt is not None else scratch,
    )


def _outputs(p: Problem, rows: tuple, views: bool) -> tuple:
    """Empty gradients in the inputs' dtype, (rows, heads, head_dim) for each entry of `rows`: views of one allocation
    where `views` (the eager path), else one allocation each (a custom op's outputs may not alias)."""
    shape = (p.heads, p.head_dim)
    if views:
        return p.q.new_empty((sum(rows), *shape)).split_with_sizes(rows)
    return tuple(p.q.new_empty((n, *shape)) for n in rows)


def _counter_rows(p: Problem, regions: int) -> int:
    """Rows (of heads x head_dim fp32) past an accumulator's data that hold one counter per region and head
    (`_last_arrival`)."""
    return _cdiv(regions, p.head_dim)


def _backward_one_launch(p: Problem, go, out, lse, num_kv_rows, dab, dpt, dtt, views):
    """(dq, dk, dv) from `_bwd_one_launch_kernel`, bias gradients in place: no delta kernel, no dQ buffer."""
    q, k, v = p.q, p.k, p.v
    dq, dk, dv = _outputs(p, (p.total_out, num_kv_rows, num_kv_rows), views)

    def grid(meta):
        blocks = _cdiv(max(p.max_kv_len, 1), meta["BLOCK_N"]) + _cdiv(max(p.max_q_len, 1), meta["BLOCK_N"])
        return (blocks, p.heads, p.num_seqs)

    args = p.kernel_args(
        (q, k, v, out, go, lse, dq, dk, dv),
        (q, k, v, out, go, dq, dk, dv),
        _bias_grad_args(p, dab, dpt, dtt),
        tail=(p.heads, max(p.max_kv_len, 1)),
    )
    _KERNELS["bwd1"](
        grid,
        args,
        {**p.consts, "BLOCK_D": p.block_d},
        p.bucket,
        p.options,
        reset=tuple(t for t in (dpt, dtt) if t is not None),
        tma=p.tma_ok(q, go, out, k, v),
    )
    return dq, dk, dv


def _backward_kv_resident(p: Problem, go, out, lse, num_kv_rows, dab, dpt, dtt, views):
    """(dq, dk, dv) from `_bwd_kv_resident_kernel`, bias gradients in place. dK and dV accumulate in fp32 in one buffer
    (one fill), which the kernel's last program per sequence and head casts into dk and dv (its counters in rows past
    theirs, zeroed with it); fp32 inputs take the sums themselves, two buffers unless `views` (the custom op's outputs
    may not alias)."""
    q, k, v = p.q, p.k, p.v
    cast = k.dtype != torch.float32
    rows = (num_kv_rows, num_kv_rows, _counter_rows(p, p.num_seqs) if cast else 0)
    if cast or views:
        dkva = q.new_zeros((sum(rows), p.heads, p.head_dim), dtype=torch.float32)
        dka, dva, _ = dkva.split_with_sizes(rows)
        accumulators: tuple = (dkva,)
    else:
        accumulators = dka, dva = tuple(
            torch.zeros((n, p.heads, p.head_dim), dtype=torch.float32, device=q.device) for n in rows[:2]
        )
    if cast:
        dq, dk, dv = _outputs(p, (p.total_out, num_kv_rows, num_kv_rows), views)
    else:
        dq = q.new_empty((p.total_out, p.heads, p.head_dim))
        dk, dv = dka, dva

    def grid(meta):
        return (_cdiv(max(p.max_q_len, 1), meta["CHUNK"]), p.heads, p.num_seqs)

    args = p.kernel_args(
        (q, k, v, out, go, lse, dq, dka, dva, dk, dv),
        (q, k, v, out, go, dq, dka),  # DVA, DK, DV: DKA's strides (one buffer or two alike)
        _bias_grad_args(p, dab, dpt, dtt),
        tail=(p.heads, 2 * num_kv_rows),
    )
    _KERNELS["bwd_rkv"](
        grid,
        args,
        {**p.consts, "BLOCK_D": p.block_d, "BLOCK_N": _resident_block(p.max_kv_len), "CAST_DKV": cast},
        p.bucket,
        p.options,
        reset=accumulators + tuple(t for t in (dpt, dtt) if t is not None),  # the counters too
        tma=p.tma_ok(q, go, out),
    )
    return dq, dk, dv


def _backward_q_resident(p: Problem, go, out, lse, num_kv_rows, dab, dpt, dtt, views):
    """(dq, already summed over the key sequences where the queries are shared, dk, dv) from `_bwd_q_resident_kernel`,
    bias gradients in place. dQ accumulates in fp32, which the kernel's last program per region casts into dq (its
    counters in rows past q's, zeroed with it); fp32 inputs take the sum itself."""
    q, k, v = p.q, p.k, p.v
    q_rows = q.shape[0]
    cast = q.dtype != torch.float32
    extra = _counter_rows(p, 1 if p.q_shared else p.num_seqs) if cast else 0
    dqa = q.new_zeros((q_rows + extra, p.heads, p.head_dim), dtype=torch.float32)
    if cast:
        dq, dk, dv = _outputs(p, (q_rows, num_kv_rows, num_kv_rows), views)
    else:
        dq = dqa
        dk, dv = _outputs(p, (num_kv_rows, num_kv_rows), views)

    def grid(meta):
        return (_cdiv(max(p.max_kv_len, 1), meta["CHUNK"]), p.heads, p.num_seqs)

    args = p.kernel_args(
        (q, k, v, out, go, lse, dqa, dk, dv, dq),
        (q, k, v, out, go, dqa, dk, dv),  # dQ: DQA's strides
        _bias_grad_args(p, dab, dpt, dtt),
        tail=(p.heads, q_rows),
    )
    _KERNELS["bwd_rq"](
        grid,
        args,
        {**p.consts, "BLOCK_D": p.block_d, "BLOCK_M": _resident_block(p.max_q_len), "CAST_DQ": cast},
        p.bucket,
        p.options,
        reset=tuple(t for t in (dqa, dpt, dtt) if t is not None),  # the counters too
        tma=p.tma_ok(k, v),
    )
    return dq, dk, dv


def backward(p: Problem, grad_out, out, lse, views: bool = False):
    """Gradients (dq, dk, dv, d_attn_bias, d_pos_table, d_time_table); bias grads None when absent. views: the eager
    path (the kernels launched straight from Python): dq, dk and dv may be views of one allocation (the custom op's
    outputs may not alias), and a small problem's fused dQ is cast in-kernel (its launches bound the call)."""
    q, k, v = p.q, p.k, p.v
    dev = q.device
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    num_kv_rows = k.shape[0] * p.num_seqs if p.kv_shared else k.shape[0]
    dab = torch.zeros_like(p.attn_bias) if p.attn_bias is not None else None
    dpt = torch.zeros(p.pos_table.shape, dtype=torch.float32, device=dev) if p.pos_table is not None else None
    dtt = torch.zeros(p.time_table.shape, dtype=torch.float32, device=dev) if p.time_table is not None else None
    fused = p.fuse_dq()
    resident = p.resident()
    q_summed = False  # dq of shared queries already summed over the key sequences
    if p.num_seqs == 0 or p.total_out == 0 or num_kv_rows == 0:
        dq = torch.zeros((p.total_out, p.heads, p.head_dim), dtype=q.dtype, device=dev)
        dk = torch.zeros((num_kv_rows, p.heads, p.head_dim), dtype=k.dtype, device=dev)
        dv = torch.zeros((num_kv_rows, p.heads, p.head_dim), dtype=v.dtype, device=dev)
    elif p.block_kernel():
        from gemrec.kernels import block_attention

        dq, dk, dv = block_attention.backward(p, grad_out, num_kv_rows, dab, dpt, dtt, views)
    elif resident == "kv":
        dq, dk, dv = _backward_kv_resident(p, grad_out, out, lse, num_kv_rows, dab, dpt, dtt, views)
    elif resident == "q":
        dq, dk, dv = _backward_q_resident(p, grad_out, out, lse, num_kv_rows, dab, dpt, dtt, views)
        q_summed = True
    elif p.one_launch():
        dq, dk, dv = _backward_one_launch(p, grad_out, out, lse, num_kv_rows, dab, dpt, dtt, views)
    else:
        # dQ in q's dtype goes straight into its gradient: from the dQ kernel, the RoPE kernel, or the dK/dV kernel's
        # last key block per sequence and head (`cast_dq`: small problems on the eager path, one launch less; on the
        # H200 it cost B's device time 5-14%, so compiled steps, whose host runs ahead, and long sequences, which one
        # program would cast alone, copy the fp32 sum after the kernel); the fused fp32 sum is the gradient itself for
        # fp32 inputs, and is summed over shared queries below
        own_dq = not fused or not (p.q_shared or q.dtype == torch.float32)
        cast_dq = fused and own_dq and not p.rope_base and views and p.small()
        dqa = lse  # a placeholder unless dQ is fused
        if fused:  # dQ added into an fp32 buffer, zeroed by the delta kernel where there is one (a fill launch less)
            shape = (p.total_out + (_counter_rows(p, p.num_seqs) if cast_dq else 0), p.heads, p.head_dim)
            dqa = (q.new_empty if p.mode == 0 else q.new_zeros)(shape, dtype=torch.float32)
        # pointwise modes never read delta; launched before dK and dV are allocated, so that the GPU starts earlier
        delta = _delta(p, out, grad_out, dqa if fused else None) if p.mode == 0 else lse
        if own_dq:
            dq, dk, dv = _outputs(p, (p.total_out, num_kv_rows, num_kv_rows), views)
        else:
            dq = dqa
            dk, dv = _outputs(p, (num_kv_rows, num_kv_rows), views)
        go = grad_out

        def grid_kv(meta):
            return (_cdiv(max(p.max_kv_len, 1), meta["BLOCK_N"]), p.heads, p.num_seqs)

        args: tuple = p.kernel_args(
            (q, k, v, out, go, lse, delta, dk, dv, dqa, dq),
            (q, k, v, out, go, dk, dv, dqa if fused else None),  # dQ: DQA's strides
            tail=(p.heads, p.total_out),
        )
        _KERNELS["dkdv"](
            grid_kv,
            args,
            {**p.consts, "FUSE_DQ": fused, "DELTA_INLINE": False, "BLOCK_D": p.block_d, "CAST_DQ": cast_dq},
            p.bucket,
            p.options,
            reset=(dqa,) if fused else (),  # the counters too
            tma=p.tma_ok(q, go, rope_halves=True),
        )
        if fused:
            if p.rope_base:
                _rope_dq(p, dqa, dq)
            elif own_dq and not cast_dq:
                dq.copy_(dqa)
        else:

            def grid_q(meta):
                return (_cdiv(max(p.max_q_len, 1), meta["BLOCK_M"]), p.heads, p.num_seqs)

            args = p.kernel_args(
                (q, k, v, out, go, lse, delta, dq),
                (q, k, v, out, go, dq),
                _bias_grad_args(p, dab, dpt, dtt),
                tail=(p.heads, 0),
            )
            _KERNELS["dq"](
                grid_q,
                args,
                {**p.consts, "DELTA_INLINE": False, "BLOCK_D": p.block_d},
                p.bucket,
                p.options,
                reset=tuple(t for t in (dpt, dtt) if t is not None),
                tma=p.tma_ok(k, v),
            )
    if p.q_shared and not q_summed:
        dq = dq.view(p.num_seqs, q.shape[0], p.heads, p.head_dim).sum(0, dtype=torch.float32)
    if dq.dtype != q.dtype:
        dq = dq.to(q.dtype)
    if p.kv_shared:
        dk = dk.view(p.num_seqs, k.shape[0], p.heads, p.head_dim).sum(0, dtype=torch.float32).to(k.dtype)
        dv = dv.view(p.num_seqs, k.shape[0], p.heads, p.head_dim).sum(0, dtype=torch.float32).to(v.dtype)
    if dpt is not None:
        dpt = dpt.to(p.pos_table.dtype)
    if dtt is not None:
        dtt = dtt.to(p.time_table.dtype)
    return dq, dk, dv, dab, dpt, dtt
