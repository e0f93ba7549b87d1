"""Triton kernels for jagged softmax attention (JFA) and generalized dot-product attention (GDPA).

One kernel family serves both ops: `MODE == 0` is softmax attention, other modes are pointwise
activations (see `ACTIVATIONS`). Every program works on one (query block, head, sequence) or
(key block, head, sequence) tile of the jagged layout `(total_tokens, heads, head_dim)`; nothing is
padded. Scores are `scale * q.k + attn_bias + pos_table[bucket(rel_pos)] + time_table[bucket(dt)]`.

With `TRITON_INTERPRET=1` set before triton is first imported, the same kernels run on CPU tensors
(triton's own `tl.*` helpers are decorated at import, so it cannot be switched on later).
"""

import math
import os

import torch
import triton
import triton.language as tl

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
def _activation(s, ACT: tl.constexpr):
    """Pointwise activation and its derivative, in fp32."""
    if ACT == 1:
        sig = _sigmoid(s)
        a = s * sig
        da = sig * (1.0 + s * (1.0 - sig))
    elif ACT == 2:
        cdf = 0.5 * (1.0 + tl.erf(s * 0.7071067811865476))
        a = s * cdf
        da = cdf + s * tl.exp(-0.5 * s * s) * 0.3989422804014327
    elif ACT == 3:
        u = 0.7978845608028654 * (s + 0.044715 * s * s * s)
        t = 2.0 * _sigmoid(2.0 * u) - 1.0
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


@triton.jit
def _bias(rows, cols, row_ok, col_ok, shift, h, o_start, kv_start,
          AB, stride_abt, stride_abh, PT, stride_pth, TT, stride_tth, QTS, KTS,
          pos_log_inv, time_log_inv,
          HAS_AB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
          NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr):
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
def _seq_info(q_off, kv_off, o_off, b, Q_STRIDE: tl.constexpr, KV_STRIDE: tl.constexpr):
    """Start/length of sequence b's queries and keys; `o_start` indexes output-shaped tensors."""
    q_start = tl.load(q_off + b * Q_STRIDE)
    q_len = tl.load(q_off + b * Q_STRIDE + 1) - q_start
    kv_start = tl.load(kv_off + b * KV_STRIDE)
    kv_len = tl.load(kv_off + b * KV_STRIDE + 1) - kv_start
    o_start = tl.load(o_off + b)
    return q_start, q_len, kv_start, kv_len, o_start


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, K, V, n0, kv_start, kv_len, shift, h, o_start,
              offs_m, offs_n, offs_d, row_ok, d_ok, stride_kt, stride_kh, stride_vt, stride_vh,
              qk_scale, scale,
              AB, stride_abt, stride_abh, PT, stride_pth, TT, stride_tth, QTS, KTS,
              pos_log_inv, time_log_inv,
              MODE: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
              HAS_AB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
              NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr, EVEN_D: tl.constexpr):
    cols = n0 + offs_n
    col_ok = cols < kv_len
    kv_rows = (kv_start + cols).to(tl.int64)
    if MASKED or not EVEN_D:
        kmask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=kmask, other=0.0)
        v = tl.load(V + kv_rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=kmask, other=0.0)
    else:
        k = tl.load(K + kv_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :])
        v = tl.load(V + kv_rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :])
    qk = tl.dot(q, tl.trans(k))
    HAS_BIAS: tl.constexpr = HAS_AB or HAS_POS or HAS_TIME
    if HAS_BIAS:
        s = qk * scale + _bias(offs_m[:, None], cols[None, :], row_ok[:, None], col_ok[None, :], shift, h,
                               o_start, kv_start, AB, stride_abt, stride_abh, PT, stride_pth, TT, stride_tth,
                               QTS, KTS, pos_log_inv, time_log_inv, HAS_AB, HAS_POS, HAS_TIME, NUM_POS, NUM_TIME)
    if MODE == 0:
        if HAS_BIAS:
            s = s * 1.4426950408889634
        else:
            s = qk * qk_scale
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None] + shift)
            s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    else:
        if not HAS_BIAS:
            s = qk * scale
        a, _ = _activation(s, MODE)
        if MASKED:
            valid = col_ok[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None] + shift)
            a = tl.where(valid, a, 0.0)
        acc += tl.dot(a.to(v.dtype), v)
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(Q, K, V, Out, LSE, AB, PT, TT, QTS, KTS, q_off, kv_off, o_off,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                stride_abt, stride_abh, stride_pth, stride_tth,
                scale, qk_scale, inv_max_len, pos_log_inv, time_log_inv, num_heads, len_bucket,
                HEAD_DIM: tl.constexpr, MODE: tl.constexpr, CAUSAL: tl.constexpr, NORM: tl.constexpr,
                Q_STRIDE: tl.constexpr, KV_STRIDE: tl.constexpr,
                HAS_AB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
                NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start = _seq_info(q_off, kv_off, o_off, b, Q_STRIDE, KV_STRIDE)
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
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # Keys every row of the block may see (no mask needed), then the ragged/diagonal rest.
    n_end = kv_len
    n_full = kv_len
    if CAUSAL:
        n_end = tl.minimum(kv_len, m0 + BLOCK_M + shift)
        n_full = tl.minimum(kv_len, m0 + 1 + shift)
    n_full = tl.maximum(n_full, 0) // BLOCK_N * BLOCK_N
    for n0 in range(0, n_full, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, n0, kv_start, kv_len, shift, h, o_start,
                                  offs_m, offs_n, offs_d, row_ok, d_ok, stride_kt, stride_kh, stride_vt,
                                  stride_vh, qk_scale, scale, AB, stride_abt, stride_abh, PT, stride_pth,
                                  TT, stride_tth, QTS, KTS, pos_log_inv, time_log_inv,
                                  MODE, CAUSAL, False, HAS_AB, HAS_POS, HAS_TIME, NUM_POS, NUM_TIME, EVEN_D)
    for n0 in range(n_full, n_end, BLOCK_N):
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, K, V, n0, kv_start, kv_len, shift, h, o_start,
                                  offs_m, offs_n, offs_d, row_ok, d_ok, stride_kt, stride_kh, stride_vt,
                                  stride_vh, qk_scale, scale, AB, stride_abt, stride_abh, PT, stride_pth,
                                  TT, stride_tth, QTS, KTS, pos_log_inv, time_log_inv,
                                  MODE, CAUSAL, True, HAS_AB, HAS_POS, HAS_TIME, NUM_POS, NUM_TIME, EVEN_D)
    o_rows = (o_start + offs_m).to(tl.int64)
    if MODE == 0:
        l_ok = l_i > 0.0
        out = acc / tl.where(l_ok, l_i, 1.0)[:, None]
        # log2-domain logsumexp; +inf for rows that see no key makes their probabilities 0 in backward
        lse = tl.where(l_ok, m_i + tl.math.log2(tl.where(l_ok, l_i, 1.0)), float("inf"))
        tl.store(LSE + o_rows * num_heads + h, lse, mask=row_ok)
    else:
        if NORM == 1:
            out = acc * tl.where(kv_len > 0, 1.0 / tl.maximum(kv_len, 1).to(tl.float32), 0.0)
        elif NORM == 2:
            out = acc * inv_max_len
        else:
            out = acc
    tl.store(Out + o_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, AB, PT, TT, QTS, KTS, q_off, kv_off, o_off, dkv_off,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                     stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                     stride_abt, stride_abh, stride_pth, stride_tth,
                     scale, norm_scale, pos_log_inv, time_log_inv, num_heads, len_bucket,
                     HEAD_DIM: tl.constexpr, MODE: tl.constexpr, CAUSAL: tl.constexpr, NORM: tl.constexpr,
                     Q_STRIDE: tl.constexpr, KV_STRIDE: tl.constexpr,
                     HAS_AB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
                     NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dK and dV for one key block, looping over the query blocks that see it (transposed tiles)."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start = _seq_info(q_off, kv_off, o_off, b, Q_STRIDE, KV_STRIDE)
    n0 = pid_n * BLOCK_N
    if n0 >= kv_len:
        return
    dkv_start = tl.load(dkv_off + b)
    shift = kv_len - q_len
    if NORM == 1:
        ns = tl.where(kv_len > 0, 1.0 / tl.maximum(kv_len, 1).to(tl.float32), 0.0)
    elif NORM == 2:
        ns = norm_scale
    else:
        ns = 1.0
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < kv_len
    d_ok = offs_d < HEAD_DIM
    kv_rows = (kv_start + offs_n).to(tl.int64)
    kmask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=kmask, other=0.0)
    v = tl.load(V + kv_rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=kmask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    m_lo = 0
    if CAUSAL:
        m_lo = tl.maximum(n0 - shift, 0) // BLOCK_M * BLOCK_M
    HAS_BIAS: tl.constexpr = HAS_AB or HAS_POS or HAS_TIME
    for m0 in range(m_lo, q_len, BLOCK_M):
        offs_m = m0 + offs_m0
        row_ok = offs_m < q_len
        q_rows = (q_start + offs_m).to(tl.int64)
        o_rows = (o_start + offs_m).to(tl.int64)
        qmask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qmask, other=0.0)
        do = tl.load(DO + o_rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=qmask, other=0.0)
        qkT = tl.dot(k, tl.trans(q))
        sT = qkT * scale
        if HAS_BIAS:
            sT += _bias(offs_m[None, :], offs_n[:, None], row_ok[None, :], col_ok[:, None], shift, h, o_start,
                        kv_start, AB, stride_abt, stride_abh, PT, stride_pth, TT, stride_tth, QTS, KTS,
                        pos_log_inv, time_log_inv, HAS_AB, HAS_POS, HAS_TIME, NUM_POS, NUM_TIME)
        valid = col_ok[:, None] & row_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :] + shift)
        dpT = tl.dot(v, tl.trans(do))
        if MODE == 0:
            lse = tl.load(LSE + o_rows * num_heads + h, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + o_rows * num_heads + h, mask=row_ok, other=0.0)
            pT = tl.math.exp2(sT * 1.4426950408889634 - lse[None, :])
            pT = tl.where(valid, pT, 0.0)
            dsT = pT * (dpT - delta[None, :])
        else:
            pT, daT = _activation(sT, MODE)
            pT = tl.where(valid, pT, 0.0) * ns
            dsT = tl.where(valid, dpT * daT, 0.0) * ns
        dv += tl.dot(pT.to(do.dtype), do)
        dk += tl.dot(dsT.to(q.dtype), q)
    dk_rows = (dkv_start + offs_n).to(tl.int64)
    tl.store(DK + dk_rows[:, None] * stride_dkt + h * stride_dkh + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kmask)
    tl.store(DV + dk_rows[:, None] * stride_dvt + h * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kmask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, AB, DAB, PT, DPT, TT, DTT, QTS, KTS, q_off, kv_off, o_off,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_dqt, stride_dqh, stride_abt, stride_abh, stride_pth, stride_tth,
                   scale, norm_scale, pos_log_inv, time_log_inv, num_heads, len_bucket,
                   HEAD_DIM: tl.constexpr, MODE: tl.constexpr, CAUSAL: tl.constexpr, NORM: tl.constexpr,
                   Q_STRIDE: tl.constexpr, KV_STRIDE: tl.constexpr,
                   HAS_AB: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
                   NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dQ for one query block, plus the score-bias gradients (dense bias rows, bucket tables)."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len, kv_start, kv_len, o_start = _seq_info(q_off, kv_off, o_off, b, Q_STRIDE, KV_STRIDE)
    m0 = pid_m * BLOCK_M
    if m0 >= q_len:
        return
    shift = kv_len - q_len
    if NORM == 1:
        ns = tl.where(kv_len > 0, 1.0 / tl.maximum(kv_len, 1).to(tl.float32), 0.0)
    elif NORM == 2:
        ns = norm_scale
    else:
        ns = 1.0
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    o_rows = (o_start + offs_m).to(tl.int64)
    qmask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qmask, other=0.0)
    do = tl.load(DO + o_rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=qmask, other=0.0)
    if MODE == 0:
        lse = tl.load(LSE + o_rows * num_heads + h, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + o_rows * num_heads + h, mask=row_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    n_end = kv_len
    if CAUSAL:
        n_end = tl.minimum(kv_len, m0 + BLOCK_M + shift)
    HAS_BIAS: tl.constexpr = HAS_AB or HAS_POS or HAS_TIME
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + offs_n0
        col_ok = offs_n < kv_len
        kv_rows = (kv_start + offs_n).to(tl.int64)
        kmask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_rows[:, None] * stride_kt + h * stride_kh + offs_d[None, :], mask=kmask, other=0.0)
        v = tl.load(V + kv_rows[:, None] * stride_vt + h * stride_vh + offs_d[None, :], mask=kmask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        if HAS_BIAS:
            s += _bias(offs_m[:, None], offs_n[None, :], row_ok[:, None], col_ok[None, :], shift, h, o_start,
                       kv_start, AB, stride_abt, stride_abh, PT, stride_pth, TT, stride_tth, QTS, KTS,
                       pos_log_inv, time_log_inv, HAS_AB, HAS_POS, HAS_TIME, NUM_POS, NUM_TIME)
        valid = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + shift)
        dp = tl.dot(do, tl.trans(v))
        if MODE == 0:
            p = tl.math.exp2(s * 1.4426950408889634 - lse[:, None])
            ds = tl.where(valid, p * (dp - delta[:, None]), 0.0)
        else:
            _, da = _activation(s, MODE)
            ds = tl.where(valid, dp * da, 0.0) * ns
        dq += tl.dot(ds.to(k.dtype), k)
        if HAS_AB:
            tl.store(DAB + o_rows[:, None] * stride_abt + h * stride_abh + offs_n[None, :],
                     ds.to(DAB.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        if HAS_POS:
            bucket = _pos_bucket(offs_m[:, None] + shift - offs_n[None, :], NUM_POS, pos_log_inv)
            tl.atomic_add(DPT + h * NUM_POS + bucket, ds, mask=valid)
        if HAS_TIME:
            qts = tl.load(QTS + o_start + offs_m, mask=row_ok, other=0)
            kts = tl.load(KTS + kv_start + offs_n, mask=col_ok, other=0)
            bucket = _time_bucket(qts[:, None] - kts[None, :], NUM_TIME, time_log_inv)
            tl.atomic_add(DTT + h * NUM_TIME + bucket, ds, mask=valid)
    tl.store(DQ + o_rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=qmask)


@triton.jit
def _delta_kernel(Out, DO, DELTA, num_items, stride_ot, stride_oh, stride_dot, stride_doh, num_heads,
                  HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta[row, h] = sum_d out * grad_out, in fp32 (softmax backward), over flattened (row, head) items."""
    item = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = item < num_items
    row = (item // num_heads).to(tl.int64)
    h = item % num_heads
    offs_d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(Out + row[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + row[:, None] * stride_dot + h[:, None] * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    tl.store(DELTA + item, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


def _configs(kind: str) -> list:
    """Candidate tiles per kernel; pruned by head dim in `_prune`."""
    out = []
    if kind == "fwd":
        for bm, bn, w, s in [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 2)]:
            out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s))
    elif kind == "dkdv":
        for bm, bn, w, s in [(32, 128, 4, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 2)]:
            out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s))
    else:
        for bm, bn, w, s in [(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)]:
            out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s))
    return out


def _prune(configs, named_args, **kwargs):
    """Large head dims only get tiles that fit in registers and shared memory."""
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    if head_dim > 128:
        small = [c for c in configs if c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_N"] <= 64]
        return small or configs[-1:]
    return configs


_KEY = ["len_bucket", "HEAD_DIM", "MODE", "CAUSAL", "HAS_AB", "HAS_POS", "HAS_TIME", "Q_STRIDE", "KV_STRIDE"]
_PRUNE = {"early_config_prune": _prune}
_TUNED = {
    "fwd": triton.autotune(_configs("fwd"), key=_KEY, prune_configs_by=_PRUNE)(_fwd_kernel),
    "dkdv": triton.autotune(_configs("dkdv"), key=_KEY, prune_configs_by=_PRUNE)(_bwd_dkdv_kernel),
    "dq": triton.autotune(_configs("dq"), key=_KEY, prune_configs_by=_PRUNE, reset_to_zero=["DPT", "DTT"])(
        _bwd_dq_kernel),
}
_PLAIN = {"fwd": _fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel}
# (BLOCK_M, BLOCK_N, num_warps, num_stages) when autotuning is off (GEMREC_KERNEL_AUTOTUNE=0), by head dim
_DEFAULT = {
    "fwd": {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 64, 8, 2)},
    "dkdv": {64: (32, 128, 4, 3), 128: (32, 128, 4, 3), 256: (32, 64, 4, 2)},
    "dq": {64: (128, 32, 4, 3), 128: (128, 32, 4, 3), 256: (64, 32, 4, 2)},
}


def _launcher(kind: str, head_dim: int):
    """(kernel, extra launch kwargs): fixed 16x16 tiles in the interpreter, autotuned or default tiles on GPU."""
    if INTERPRET:
        return _PLAIN[kind], {"BLOCK_M": 16, "BLOCK_N": 16}
    if os.environ.get("GEMREC_KERNEL_AUTOTUNE", "1") != "0":
        return _TUNED[kind], {}
    table = _DEFAULT[kind]
    bm, bn, warps, stages = table[min(k for k in table if k >= head_dim)]
    return _PLAIN[kind], {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}


def _len_bucket(n: int) -> int:
    return max(64, triton.next_power_of_2(max(n, 1)))


def _log_inv(num_pos: int, max_distance: int) -> float:
    exact = num_pos // 2
    return (num_pos - exact) / math.log(max_distance / exact) if num_pos >= 2 else 0.0


class Problem:
    """Everything the three kernels share about one call, resolved on the host."""

    def __init__(self, q, k, v, q_offsets, kv_offsets, out_offsets, max_q_len, max_kv_len, mode, causal, scale,
                 norm, attn_bias, pos_table, time_table, q_timestamps, kv_timestamps, pos_max_distance,
                 time_log_base):
        self.q, self.k, self.v = q, k, v
        self.heads, self.head_dim = q.shape[1], q.shape[2]
        self.q_shared = q_offsets.numel() == 2 and kv_offsets.numel() > 2
        self.kv_shared = kv_offsets.numel() == 2 and q_offsets.numel() > 2
        self.num_seqs = out_offsets.numel() - 1
        self.q_off = q_offsets.to(torch.int32)
        self.kv_off = kv_offsets.to(torch.int32)
        self.o_off = out_offsets.to(torch.int32)
        self.total_out = q.shape[0] * self.num_seqs if self.q_shared else q.shape[0]
        self.max_q_len, self.max_kv_len = max_q_len, max_kv_len
        self.mode, self.causal, self.scale, self.norm = mode, causal, scale, norm
        self.attn_bias, self.pos_table, self.time_table = attn_bias, pos_table, time_table
        self.q_ts, self.kv_ts = q_timestamps, kv_timestamps
        self.num_pos = pos_table.shape[1] if pos_table is not None else 1
        self.num_time = time_table.shape[1] if time_table is not None else 1
        self.pos_log_inv = _log_inv(self.num_pos, pos_max_distance) if pos_table is not None else 0.0
        self.time_log_inv = 1.0 / math.log(time_log_base) if time_table is not None else 0.0
        self.inv_max_len = 1.0 / max(max_kv_len, 1)

    def dummy(self):
        return self.q_off

    def common(self):
        """Keyword arguments every kernel takes."""
        return dict(
            HEAD_DIM=self.head_dim, MODE=self.mode, CAUSAL=self.causal, NORM=self.norm,
            Q_STRIDE=0 if self.q_shared else 1, KV_STRIDE=0 if self.kv_shared else 1,
            HAS_AB=self.attn_bias is not None, HAS_POS=self.pos_table is not None,
            HAS_TIME=self.time_table is not None, NUM_POS=self.num_pos, NUM_TIME=self.num_time,
            BLOCK_D=max(16, triton.next_power_of_2(self.head_dim)),
        )

    def bias_args(self):
        ab = self.attn_bias if self.attn_bias is not None else self.dummy()
        pt = self.pos_table if self.pos_table is not None else self.dummy()
        tt = self.time_table if self.time_table is not None else self.dummy()
        qts = self.q_ts if self.q_ts is not None else self.dummy()
        kts = self.kv_ts if self.kv_ts is not None else self.dummy()
        strides = (
            ab.stride(0) if self.attn_bias is not None else 0, ab.stride(1) if self.attn_bias is not None else 0,
            pt.stride(0) if self.pos_table is not None else 0, tt.stride(0) if self.time_table is not None else 0,
        )
        return ab, pt, tt, qts, kts, strides


def forward(p: Problem):
    q, k, v = p.q, p.k, p.v
    out = torch.empty((p.total_out, p.heads, p.head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((p.total_out, p.heads), dtype=torch.float32, device=q.device)
    if p.total_out == 0 or p.num_seqs == 0:
        return out.zero_(), lse.fill_(float("inf"))
    ab, pt, tt, qts, kts, (sabt, sabh, spt, stt) = p.bias_args()

    kernel, launch = _launcher("fwd", p.head_dim)

    def grid(meta):
        return (triton.cdiv(max(p.max_q_len, 1), meta["BLOCK_M"]), p.heads, p.num_seqs)

    kernel[grid](
        q, k, v, out, lse, ab, pt, tt, qts, kts, p.q_off, p.kv_off, p.o_off,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        sabt, sabh, spt, stt,
        p.scale, p.scale * LOG2E, p.inv_max_len, p.pos_log_inv, p.time_log_inv, p.heads, _len_bucket(p.max_q_len),
        **p.common(), **launch,
    )
    return out, lse


def backward(p: Problem, grad_out, out, lse):
    """Gradients (dq, dk, dv, d_attn_bias, d_pos_table, d_time_table); bias grads None when absent."""
    q, k, v = p.q, p.k, p.v
    grad_out = grad_out.contiguous()
    num_kv_rows = k.shape[0] * p.num_seqs if p.kv_shared else k.shape[0]
    dq = torch.empty((p.total_out, p.heads, p.head_dim), dtype=q.dtype, device=q.device)
    dk = torch.empty((num_kv_rows, p.heads, p.head_dim), dtype=k.dtype, device=q.device)
    dv = torch.empty((num_kv_rows, p.heads, p.head_dim), dtype=v.dtype, device=q.device)
    dab = torch.zeros_like(p.attn_bias) if p.attn_bias is not None else None
    dpt = torch.zeros(p.pos_table.shape, dtype=torch.float32, device=q.device) if p.pos_table is not None else None
    dtt = torch.zeros(p.time_table.shape, dtype=torch.float32, device=q.device) if p.time_table is not None else None
    delta = lse  # unused by pointwise modes
    if p.mode == 0:
        delta = torch.empty_like(lse)
        num_items = p.total_out * p.heads
        block_r = 16 if INTERPRET else 64
        if num_items > 0:
            _delta_kernel[(triton.cdiv(num_items, block_r),)](
                out, grad_out, delta, num_items, out.stride(0), out.stride(1), grad_out.stride(0),
                grad_out.stride(1), p.heads, HEAD_DIM=p.head_dim, BLOCK_R=block_r,
                BLOCK_D=max(16, triton.next_power_of_2(p.head_dim)))
    if p.kv_shared:
        dkv_off = torch.arange(p.num_seqs + 1, device=q.device, dtype=torch.int32) * k.shape[0]
    else:
        dkv_off = p.kv_off
    ab, pt, tt, qts, kts, (sabt, sabh, spt, stt) = p.bias_args()
    go = grad_out
    if p.num_seqs > 0 and num_kv_rows > 0:

        kernel, launch = _launcher("dkdv", p.head_dim)

        def grid_kv(meta):
            return (triton.cdiv(max(p.max_kv_len, 1), meta["BLOCK_N"]), p.heads, p.num_seqs)

        kernel[grid_kv](
            q, k, v, go, lse, delta, dk, dv, ab, pt, tt, qts, kts, p.q_off, p.kv_off, p.o_off, dkv_off,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), go.stride(0), go.stride(1),
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), sabt, sabh, spt, stt,
            p.scale, p.inv_max_len, p.pos_log_inv, p.time_log_inv, p.heads, _len_bucket(p.max_kv_len),
            **p.common(), **launch,
        )
    else:
        dk.zero_()
        dv.zero_()
    if p.num_seqs > 0 and p.total_out > 0:
        # the autotuner zeroes DPT/DTT between trials: absent tables get their own scratch, never a live input
        scratch = torch.zeros(1, dtype=torch.float32, device=q.device)
        dab_arg = dab if dab is not None else p.dummy()
        dpt_arg = dpt if dpt is not None else scratch
        dtt_arg = dtt if dtt is not None else scratch

        kernel, launch = _launcher("dq", p.head_dim)

        def grid_q(meta):
            return (triton.cdiv(max(p.max_q_len, 1), meta["BLOCK_M"]), p.heads, p.num_seqs)

        kernel[grid_q](
            q, k, v, go, lse, delta, dq, ab, dab_arg, pt, dpt_arg, tt, dtt_arg, qts, kts, p.q_off, p.kv_off, p.o_off,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), go.stride(0), go.stride(1),
            dq.stride(0), dq.stride(1), sabt, sabh, spt, stt,
            p.scale, p.inv_max_len, p.pos_log_inv, p.time_log_inv, p.heads, _len_bucket(p.max_q_len),
            **p.common(), **launch,
        )
    else:
        dq.zero_()
    if p.q_shared:
        dq = dq.view(p.num_seqs, q.shape[0], p.heads, p.head_dim).sum(0, dtype=torch.float32).to(q.dtype)
    if p.kv_shared:
        dk = dk.view(p.num_seqs, k.shape[0], p.heads, p.head_dim).sum(0, dtype=torch.float32).to(k.dtype)
        dv = dv.view(p.num_seqs, k.shape[0], p.heads, p.head_dim).sum(0, dtype=torch.float32).to(v.dtype)
    if dpt is not None:
        dpt = dpt.to(p.pos_table.dtype)
    if dtt is not None:
        dtt = dtt.to(p.time_table.dtype)
    return dq, dk, dv, dab, dpt, dtt

