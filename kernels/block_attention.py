"""Block attention kernels: each query sees only the keys of its own block of `block` positions (64 or 128).

A program owns one block of positions of one (sequence, head): the keys at those positions and the queries at them
(query row i sits at position i + Lkv - Lq). Every score a query has lies in that program's one tile, so the forward
is a plain softmax (no online rescaling) and the backward recomputes it from the scores: no logsumexp read, no delta
pass (delta_i = sum_j p_ij dp_ij, in registers). K and V (and in the backward the dK, dV accumulators) stay loaded
while the program walks its queries in SUB_M-row slices. With RoPE, q and k are rotated as they load and dq, dk
rotated back in fp32 registers before their stores (`triton_attention._rope_load_cs` / `_rope_store_cs`); a query
sits at the position of its row's key, so one cos/sin of the block serves K, a whole-block slice of queries and dQ.
The backward has a program for every key block (zero dK, dV where no query sees them): its buffers need no fill.
Causal and window masks, score biases, activations and norms as in `triton_attention`, whose `Problem` drives these
launches.
"""

import triton
import triton.language as tl
from gemrec.kernels import triton_attention as ta


@triton.jit
def _block_rows(
    q_off,
    kv_off,
    b,
    Q_STRIDE: tl.constexpr,
    KV_STRIDE: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    EVERY_KEY: tl.constexpr,
):
    """Program i of axis 0 takes the i-th block of positions from the one of the sequence's first query (at Lkv - Lq,
    rounded down to a block), with EVERY_KEY from block 0 where that comes first (keys no query sees get a program):
    the sequence's starts and lengths, the block's first query row r0 (negative where the block starts before the
    first query) and its keys."""
    q_start, q_len, kv_start, kv_len, o_start, dkv_start = ta._seq_info(q_off, kv_off, b, Q_STRIDE, KV_STRIDE)
    shift = kv_len - q_len
    first = tl.where(shift >= 0, shift // MASK_BLOCK, -((MASK_BLOCK - 1 - shift) // MASK_BLOCK))
    if EVERY_KEY:
        first = tl.minimum(first, 0)
    p0 = (first + tl.program_id(0)) * MASK_BLOCK
    keys = p0 + tl.arange(0, MASK_BLOCK)
    return q_start, q_len, kv_start, kv_len, o_start, dkv_start, shift, p0 - shift, keys


@triton.jit
def _block_kv(
    K,
    V,
    c,
    s,
    kv_start,
    kv_len,
    keys,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr,
):
    """The block's K (with ROPE rotated by the key positions, whose cos and sin are `c`, `s`) and V tiles, which keys
    exist and the tiles' mask."""
    offs_d = tl.arange(0, BLOCK_D)
    key_ok = (keys >= 0) & (keys < kv_len)
    kmask = key_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    if ROPE:
        k = ta._rope_load_cs(K, kv_start + keys, stride_kt, stride_kh, h, key_ok, c, s, HEAD_DIM, BLOCK_D)
    else:
        k = ta._load_tile(K, kv_start + keys, stride_kt, stride_kh, h, offs_d, kmask, True)
    v = ta._load_tile(V, kv_start + keys, stride_vt, stride_vh, h, offs_d, kmask, True)
    return k, v, key_ok, kmask


@triton.jit
def _slice_cos_sin(
    c, s, pos, RF, SUB_M: tl.constexpr, MASK_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, FAST: tl.constexpr
):
    """cos and sin of a slice of queries at positions `pos`: a query's position is that of the key in its row of the
    block, so a slice of the whole block shares the keys' `c`, `s`; a smaller one computes its own."""
    if SUB_M == MASK_BLOCK:
        cq, sq = c, s
    else:
        cq, sq = ta._rope_cos_sin(pos, RF, BLOCK_D, FAST)
    return cq, sq


@triton.jit
def _block_scores(
    q,
    k,
    rows,
    keys,
    row_ok,
    key_ok,
    shift,
    h,
    o_start,
    kv_start,
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
    HAS_AB: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr,
    NUM_POS: tl.constexpr,
    NUM_TIME: tl.constexpr,
    FAST: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """A slice's scores against the block's keys and which pairs are seen; then softmax probabilities (MODE 0, the
    whole row is here: exact max and sum) or the activation and its derivative."""
    s = tl.dot(q, tl.trans(k)) * scale
    if HAS_AB or HAS_POS or HAS_TIME:
        s += ta._bias(
            rows[:, None],
            keys[None, :],
            row_ok[:, None],
            key_ok[None, :],
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
    valid = row_ok[:, None] & key_ok[None, :]
    if CAUSAL or WINDOW > 0:  # the block itself holds by construction
        valid = valid & ta._visible(rows[:, None] + shift, keys[None, :], CAUSAL, WINDOW, 0)
    if MODE == 0:
        t = tl.where(valid, s * 1.4426950408889634, float("-inf"))
        m = tl.max(t, 1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # a row that sees no key
        e = tl.math.exp2(t - m_safe[:, None])
        lsum = tl.sum(e, 1)
        l_ok = lsum > 0.0
        p = e / tl.where(l_ok, lsum, 1.0)[:, None]
        lse = tl.where(l_ok, m_safe + tl.math.log2(tl.where(l_ok, lsum, 1.0)), float("inf"))
        da = p
    else:
        a, da = ta._activation(s, MODE, FAST)
        p = tl.where(valid, a, 0.0)
        da = tl.where(valid, da, 0.0)
        lse = tl.zeros((q.shape[0],), dtype=tl.float32)
    return p, da, lse, valid


@triton.jit
def _block_fwd_kernel(
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
    WINDOW: tl.constexpr,
    MASK_BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SUB_M: tl.constexpr,
):
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start, _, shift, r0, keys = _block_rows(
        q_off, kv_off, b, Q_STRIDE, KV_STRIDE, MASK_BLOCK, False
    )
    if (r0 >= q_len) | (q_len == 0):
        return
    c, s = 0.0, 0.0
    if ROPE:
        c, s = ta._rope_cos_sin(keys, RF, BLOCK_D, FAST)
    k, v, key_ok, _ = _block_kv(
        K, V, c, s, kv_start, kv_len, keys, stride_kt, stride_kh, stride_vt, stride_vh, h, HEAD_DIM, BLOCK_D, ROPE
    )
    offs_d = tl.arange(0, BLOCK_D)
    ns = ta._norm_scale(kv_len, inv_max_len, NORM)
    for sub in tl.static_range(MASK_BLOCK // SUB_M):
        rows = r0 + sub * SUB_M + tl.arange(0, SUB_M)
        row_ok = (rows >= 0) & (rows < q_len)
        qmask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        if ROPE:
            cq, sq = _slice_cos_sin(c, s, rows + shift, RF, SUB_M, MASK_BLOCK, BLOCK_D, FAST)
            q = ta._rope_load_cs(Q, q_start + rows, stride_qt, stride_qh, h, row_ok, cq, sq, HEAD_DIM, BLOCK_D)
        else:
            q = ta._load_tile(Q, q_start + rows, stride_qt, stride_qh, h, offs_d, qmask, True)
        p, _, lse, _ = _block_scores(
            q,
            k,
            rows,
            keys,
            row_ok,
            key_ok,
            shift,
            h,
            o_start,
            kv_start,
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
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            FAST,
            WINDOW,
        )
        out = tl.dot(p.to(v.dtype), v)
        if MODE == 0:
            tl.store(LSE + (o_start + rows) * num_heads + h, lse, mask=row_ok)
        else:
            out = out * ns
        o_rows = o_start + rows
        tl.store(
            Out + o_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=qmask,
        )


@triton.jit
def _block_bwd_kernel(
    Q,
    K,
    V,
    DO,
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
    inv_max_len,
    pos_log_inv,
    time_log_inv,
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
    SUB_M: tl.constexpr,
):
    """dQ of the block's queries and dK, dV of its keys (every query that sees them is here: plain stores), the
    score-bias gradients; softmax recomputed whole per row, its delta sum_j p dp in registers. Each gradient is stored
    as soon as its last slice adds to it (registers: two programs per SM). Blocks without queries store zero dK, dV.
    With ROPE, one cos/sin of the block's positions rotates K, a whole-block slice of queries and dQ; dK's is computed
    again at its store rather than held."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start, dkv_start, shift, r0, keys = _block_rows(
        q_off, kv_off, b, Q_STRIDE, KV_STRIDE, MASK_BLOCK, True
    )
    if r0 >= q_len:  # past the last key (the last query's position is kv_len - 1)
        return
    offs_d = tl.arange(0, BLOCK_D)
    dkv_rows = dkv_start + keys
    if (r0 + MASK_BLOCK <= 0) | (q_len == 0):  # keys before the first query's block: no query sees them
        kmask = ((keys >= 0) & (keys < kv_len))[:, None] & (offs_d < HEAD_DIM)[None, :]
        zero = tl.zeros((MASK_BLOCK, BLOCK_D), dtype=DK.dtype.element_ty)
        tl.store(DK + dkv_rows[:, None] * stride_dkt + h * stride_dkh + offs_d[None, :], zero, mask=kmask)
        tl.store(DV + dkv_rows[:, None] * stride_dvt + h * stride_dvh + offs_d[None, :], zero, mask=kmask)
        return
    c, s = 0.0, 0.0
    if ROPE:
        c, s = ta._rope_cos_sin(keys, RF, BLOCK_D, FAST)
    k, v, key_ok, kmask = _block_kv(
        K, V, c, s, kv_start, kv_len, keys, stride_kt, stride_kh, stride_vt, stride_vh, h, HEAD_DIM, BLOCK_D, ROPE
    )
    ns = ta._norm_scale(kv_len, inv_max_len, NORM)
    LAST: tl.constexpr = MASK_BLOCK // SUB_M - 1
    dk = tl.zeros((MASK_BLOCK, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((MASK_BLOCK, BLOCK_D), dtype=tl.float32)
    for sub in tl.static_range(LAST + 1):
        rows = r0 + sub * SUB_M + tl.arange(0, SUB_M)
        row_ok = (rows >= 0) & (rows < q_len)
        o_rows = o_start + rows
        qmask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        cq, sq = c, s
        if ROPE:
            cq, sq = _slice_cos_sin(c, s, rows + shift, RF, SUB_M, MASK_BLOCK, BLOCK_D, FAST)
            q = ta._rope_load_cs(Q, q_start + rows, stride_qt, stride_qh, h, row_ok, cq, sq, HEAD_DIM, BLOCK_D)
        else:
            q = ta._load_tile(Q, q_start + rows, stride_qt, stride_qh, h, offs_d, qmask, True)
        do = ta._load_tile(DO, o_rows, stride_dot, stride_doh, h, offs_d, qmask, True)
        p, da, _, valid = _block_scores(
            q,
            k,
            rows,
            keys,
            row_ok,
            key_ok,
            shift,
            h,
            o_start,
            kv_start,
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
            HAS_AB,
            HAS_POS,
            HAS_TIME,
            NUM_POS,
            NUM_TIME,
            FAST,
            WINDOW,
        )
        if MODE != 0:
            da = da * ns
            p = p * ns
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
        if sub == LAST:
            tl.store(
                DV + dkv_rows[:, None] * stride_dvt + h * stride_dvh + offs_d[None, :],
                dv.to(DV.dtype.element_ty),
                mask=kmask,
            )
        dp = tl.dot(do, tl.trans(v))
        if MODE == 0:
            ds = p * (dp - tl.sum(p * dp, 1)[:, None])
        else:
            ds = dp * da
        ds_lo = ds.to(q.dtype)
        dq = tl.dot(ds_lo, k) * scale
        if ROPE:
            ta._rope_store_cs(DQ, o_rows, stride_dqt, stride_dqh, h, dq, row_ok, cq, sq, HEAD_DIM, BLOCK_D, False)
        else:
            tl.store(
                DQ + o_rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
                dq.to(DQ.dtype.element_ty),
                mask=qmask,
            )
        dk += tl.dot(tl.trans(ds_lo), q)
        ta._bias_grads(
            ds,
            rows[:, None],
            keys[None, :],
            row_ok[:, None],
            key_ok[None, :],
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
    if ROPE:
        ta._rope_store(
            DK, dkv_rows, stride_dkt, stride_dkh, h, dk * scale, keys, key_ok, RF, HEAD_DIM, BLOCK_D, FAST, False
        )
    else:
        tl.store(
            DK + dkv_rows[:, None] * stride_dkt + h * stride_dkh + offs_d[None, :],
            (dk * scale).to(DK.dtype.element_ty),
            mask=kmask,
        )


def _grid(p, every_key: bool):
    """Blocks from the first query's (`every_key`: or from key 0) to the last key's: one more than the rows need, as a
    first position may sit inside a block."""
    length = max(p.max_q_len, p.max_kv_len if every_key else 0, 1)

    def grid(meta):
        return (ta._cdiv(length, p.mask_block) + 1, p.heads, p.num_seqs)

    return grid


def forward(p, out, lse):
    """Fills `out` and, for softmax, the log2-domain logsumexp `lse` of a `Problem` with `block_kernel()`."""
    q, k, v = p.q, p.k, p.v
    args = p.kernel_args((q, k, v, out, lse), (q, k, v, out), tail=(p.heads,))
    KERNELS["block_fwd"](_grid(p, False), args, {**p.consts, "BLOCK_D": p.block_d}, p.bucket, p.options)
    return out, lse


def backward(p, go, num_kv_rows, dab, dpt, dtt, views):
    """(dq, dk, dv) in the rows of the output and of the (shared: expanded) keys, views of one allocation where `views`
    (`triton_attention.backward`); bias gradients in place."""
    q, k, v = p.q, p.k, p.v
    dq, dk, dv = ta._outputs(p, (p.total_out, num_kv_rows, num_kv_rows), views)
    args = p.kernel_args((q, k, v, go, dq, dk, dv), (q, k, v, go, dq, dk, dv), ta._bias_grad_args(p, dab, dpt, dtt))
    KERNELS["block_bwd"](
        _grid(p, True),
        args,
        {**p.consts, "BLOCK_D": p.block_d},
        p.bucket,
        p.options,
        reset=tuple(t for t in (dpt, dtt) if t is not None),
    )
    return dq, dk, dv


# slices of 32 query rows in the interpreter: a 64-key block takes two
KERNELS = {
    "block_fwd": ta._Kernel(_block_fwd_kernel, "block_fwd", interpret_tiles={"SUB_M": 32}),
    "block_bwd": ta._Kernel(_block_bwd_kernel, "block_bwd", interpret_tiles={"SUB_M": 32}),
}
ta._KERNELS.update(KERNELS)  # one registry of every kernel: `tuned_configs` reports these too
