"""Jagged attention forward (softmax and GDPA's activations) for Hopper (sm_90) in Gluon, warp-specialized.

One program takes 2 x 64 query rows of one (sequence, head) in two warp-specialized partitions of one warpgroup each.
Each runs QK^T (wgmma from shared memory), the activation in registers, then PV (wgmma with the activations as the
register operand) over key blocks that stream through a ring of shared-memory stages with TMA (per-sequence tensor
descriptors: reads past the sequence's end are zeros). The first warpgroup also issues the loads, each once both have
released the stage. The two only meet at the ring's barriers, so one's activation overlaps the other's matrix
products: what the Triton kernel gets from two programs per SM, here with 128-key blocks whose K/V loads the two
share. (A third, producer-only partition would make 384 threads, capping every thread at 168 registers: ptxas then
serializes the wgmma k-steps.)

It takes the Triton forward's arguments (`triton_attention._fwd_kernel`) and is one more candidate of its autotuner,
for what it covers (`covers`): no score biases, no block mask, no RoPE, head dim 64 or 128, 16-bit inputs. A sliding
window starts the ring at the program's first key block in the window; like the causal diagonal, its edges are masked.
"""

from gemrec.kernels.triton_attention import _key_range
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

CONSUMER_ROWS = gl.constexpr(64)
CONSUMER_REGS = gl.constexpr(240)


def covers(consts: dict, dtype) -> bool:
    return (
        not (consts["HAS_AB"] or consts["HAS_POS"] or consts["HAS_TIME"])
        and not (consts.get("MASK_BLOCK") or consts.get("ROPE"))
        and consts["HEAD_DIM"] in (64, 128)
        and consts["FAST"]
        and dtype.itemsize == 2
    )


@gluon.jit
def _tanh(x):
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _activation(qk, scale, MODE: gl.constexpr):
    """The Triton forward's activations (fast tanh) of the unscaled scores."""
    if MODE == 1:  # silu(s) = u + u * tanh(u), u = s / 2
        u = qk * (0.5 * scale)
        a = u + u * _tanh(u)
    elif MODE == 2:
        s = qk * scale
        a = s * (0.5 * (1.0 + gl.erf(s * 0.7071067811865476)))
    elif MODE == 3:
        s = qk * scale
        a = 0.5 * s * (1.0 + _tanh(0.7978845608028654 * (s + 0.044715 * s * s * s)))
    elif MODE == 4:
        a = gl.maximum(qk * scale, 0.0)
    else:
        r = gl.maximum(qk * scale, 0.0)
        a = r * r
    return a


@gluon.jit
def _consume(j, j0, acc, m_i, l_i, ring, k_desc, v_desc, tile, MASKED: gl.constexpr, cfg: gl.constexpr):
    """The program's key block j (block j0 + j of the sequence) into acc (online softmax in m_i, l_i for MODE 0): its
    PV product stays in flight until the next block's QK^T has been waited for. LOADS: this warpgroup also loads block
    j + STAGES - 1, into the stage block j - 1 leaves. `ring`: q and the K/V stages with their barriers; `tile`:
    the score tile's rows, columns and scales; `cfg`: the kernel's constants."""
    q_s, k_smem, v_smem, k_ready, v_ready, kv_empty, num_blocks = ring
    rows, cols, kv_len, shift, scale, qk_scale, zero_qk = tile
    MODE, CAUSAL, WINDOW, SCALE_POS, LOADS, BLOCK_N, STAGES, p_layout, acc_rows = cfg
    s = j % STAGES
    phase = (j // STAGES) & 1
    mbarrier.wait(k_ready.index(s), phase)
    qk = warpgroup_mma(q_s, k_smem.index(s).permute((1, 0)), zero_qk, use_acc=False, is_async=True)
    qk, acc = warpgroup_mma_wait(0, deps=[qk, acc])
    # block j - 1's PV has retired too: its stage may be refilled
    mbarrier.arrive(kv_empty.index((j + STAGES - 1) % STAGES), count=1, pred=j > 0)
    if MASKED:
        key = cols[None, :] + (j0 + j) * BLOCK_N
        pos = rows[:, None] + shift
        if CAUSAL:
            valid = (key <= pos) & (key < kv_len)
        else:
            valid = (key < kv_len) & (rows[:, None] >= 0)
        if WINDOW > 0:
            valid = valid & (key > pos - WINDOW)
            if not CAUSAL:
                valid = valid & (key < pos + WINDOW)
    if MODE == 0:
        # log2-domain scores t * c; a positive scale rides the exp2's FMA (one op per score)
        if SCALE_POS:
            t = qk
            c = qk_scale
        else:
            t = qk * qk_scale
            c = 1.0
        if MASKED:
            t = gl.where(valid, t, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(t, 1) * c)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet
        a = gl.exp2(t * c - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(a, 1)
        acc = acc * gl.convert_layout(alpha, acc_rows)[:, None]
        m_i = m_new
    else:
        a = _activation(qk, scale, MODE)
        if MASKED:  # keys past the sequence's end are zeros, and every activation maps 0 to 0: only causal masks
            a = gl.where(valid, a, 0.0)
    p = gl.convert_layout(a.to(v_smem.dtype), p_layout)
    mbarrier.wait(v_ready.index(s), phase)
    acc = warpgroup_mma(p, v_smem.index(s), acc, is_async=True)
    acc = warpgroup_mma_wait(1, deps=[acc])
    if LOADS:
        _load_block(
            j + STAGES - 1, j0, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, num_blocks, BLOCK_N, STAGES
        )
    return acc, m_i, l_i


@gluon.jit
def _consumer(
    Q,
    K,
    V,
    Out,
    LSE,
    bufs,
    seq,
    io,
    kv_io,
    HEAD_DIM: gl.constexpr,
    MODE: gl.constexpr,
    CAUSAL: gl.constexpr,
    WINDOW: gl.constexpr,
    NORM: gl.constexpr,
    SCALE_POS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    C: gl.constexpr,
):
    q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty = bufs
    q_start, q_len, kv_len, o_start, m0, shift, h, num_heads, j0, num_blocks = seq
    stride_qt, stride_qh, stride_ot, stride_oh, scale, qk_scale, inv_max_len = io
    kv_start, stride_kt, stride_kh, stride_vt, stride_vh = kv_io
    LOADS: gl.constexpr = C == 0
    if LOADS:
        k_desc, v_desc = _kv_descs(
            K, V, kv_start, kv_len, h, stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM, BLOCK_N
        )
        for i in gl.static_range(STAGES - 1):
            _load_block(i, j0, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, num_blocks, BLOCK_N, STAGES)
    else:
        k_desc = None
        v_desc = None
    dtype: gl.constexpr = Q.dtype.element_ty
    qk_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    load_layout: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[256 // HEAD_DIM, HEAD_DIM // 8], warps_per_cta=[4, 1], order=[1, 0]
    )
    r0 = m0 + C * CONSUMER_ROWS

    rows_ld = r0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, load_layout))
    d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_layout))
    q = gl.load(
        Q + (q_start + rows_ld.to(gl.int64))[:, None] * stride_qt + h * stride_qh + d_ld[None, :],
        mask=(rows_ld < q_len)[:, None] & (d_ld < HEAD_DIM)[None, :],
        other=0.0,
    )
    q_s = q_smem.index(C)
    q_s.store(q)
    fence_async_shared()
    gl.thread_barrier()

    rows = r0 + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, qk_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, qk_layout))
    zero_qk = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, qk_layout)
    acc = gl.zeros([CONSUMER_ROWS, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([CONSUMER_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, qk_layout))
    l_i = gl.zeros([CONSUMER_ROWS], gl.float32, gl.SliceLayout(1, qk_layout))
    acc_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    # the program's blocks j0 + [0, n_mine) this warpgroup takes: masked ones below the window's edge (some may be
    # wholly below for this warpgroup: the program's first block is the first warpgroup's), then blocks every row here
    # sees whole, then masked ones again: the causal diagonal or the window's far edge and, for softmax, the ragged end
    lo_first, hi_first = _key_range(r0 + shift, CAUSAL, WINDOW, 0)
    lo_last, hi_last = _key_range(r0 + CONSUMER_ROWS - 1 + shift, CAUSAL, WINDOW, 0)
    n_mine = gl.maximum(gl.cdiv(gl.maximum(gl.minimum(kv_len, hi_last), 0), BLOCK_N) - j0, 0)
    n_mid = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(lo_last, 0), BLOCK_N) - j0, 0), n_mine)
    n_full = gl.maximum(gl.maximum(gl.minimum(kv_len, hi_first), 0) // BLOCK_N - j0, n_mid)
    if MODE != 0 and not CAUSAL and WINDOW == 0:  # keys past the end are zeros, which every activation maps to 0
        n_full = n_mine
    ring = (q_s, k_smem, v_smem, k_ready, v_ready, kv_empty, num_blocks)
    tile = (rows, cols, kv_len, shift, scale, qk_scale, zero_qk)
    cfg: gl.constexpr = (MODE, CAUSAL, WINDOW, SCALE_POS, LOADS, BLOCK_N, STAGES, p_layout, acc_rows)
    for j in range(0, n_mid):
        acc, m_i, l_i = _consume(j, j0, acc, m_i, l_i, ring, k_desc, v_desc, tile, True, cfg)
    for j in range(n_mid, n_full):
        acc, m_i, l_i = _consume(j, j0, acc, m_i, l_i, ring, k_desc, v_desc, tile, False, cfg)
    for j in range(n_full, n_mine):
        acc, m_i, l_i = _consume(j, j0, acc, m_i, l_i, ring, k_desc, v_desc, tile, True, cfg)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(kv_empty.index((n_mine + STAGES - 1) % STAGES), count=1, pred=n_mine > 0)

    rows_o = r0 + gl.arange(0, CONSUMER_ROWS, layout=acc_rows)
    if MODE == 0:
        l_ok = l_i > 0.0
        acc = acc / gl.convert_layout(gl.where(l_ok, l_i, 1.0), acc_rows)[:, None]
        # log2-domain logsumexp; +inf for rows that see no key makes their probabilities 0 in backward
        lse = gl.where(l_ok, m_i + gl.log2(gl.where(l_ok, l_i, 1.0)), float("inf"))
        gl.store(LSE + (o_start + rows.to(gl.int64)) * num_heads + h, lse, mask=rows < q_len)
    elif NORM == 1:
        acc = acc * gl.where(kv_len > 0, 1.0 / gl.maximum(kv_len, 1).to(gl.float32), 0.0)
    elif NORM == 2:
        acc = acc * inv_max_len
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(
        Out + (o_start + rows_o.to(gl.int64))[:, None] * stride_ot + h * stride_oh + d_o[None, :],
        acc.to(dtype),
        mask=(rows_o < q_len)[:, None] & (d_o < HEAD_DIM)[None, :],
    )


@gluon.jit
def _kv_descs(
    K, V, kv_start, kv_len, h, stride_kt, stride_kh, stride_vt, stride_vh, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr
):
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], K.dtype.element_ty)
    k_desc = tma.make_tensor_descriptor(
        K + kv_start * stride_kt + h * stride_kh,
        shape=[kv_len, HEAD_DIM],
        strides=[stride_kt, 1],
        block_shape=[BLOCK_N, HEAD_DIM],
        layout=layout,
    )
    v_desc = tma.make_tensor_descriptor(
        V + kv_start * stride_vt + h * stride_vh,
        shape=[kv_len, HEAD_DIM],
        strides=[stride_vt, 1],
        block_shape=[BLOCK_N, HEAD_DIM],
        layout=layout,
    )
    return k_desc, v_desc


@gluon.jit
def _load_block(
    j,
    j0,
    k_desc,
    v_desc,
    k_smem,
    v_smem,
    k_ready,
    v_ready,
    kv_empty,
    num_blocks,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """The program's key block j (block j0 + j of the sequence): K and V into their stage once both warpgroups have
    released its previous block."""
    s = j % STAGES
    pred = j < num_blocks
    mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1, pred=pred)  # a fresh barrier passes parity 1
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [(j0 + j) * BLOCK_N, 0], k_ready.index(s), k_smem.index(s), pred=pred)
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(v_desc, [(j0 + j) * BLOCK_N, 0], v_ready.index(s), v_smem.index(s), pred=pred)


@gluon.jit
def fwd_kernel(
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
    HEAD_DIM: gl.constexpr,
    MODE: gl.constexpr,
    CAUSAL: gl.constexpr,
    NORM: gl.constexpr,
    Q_STRIDE: gl.constexpr,
    KV_STRIDE: gl.constexpr,
    HAS_AB: gl.constexpr,
    HAS_POS: gl.constexpr,
    HAS_TIME: gl.constexpr,
    NUM_POS: gl.constexpr,
    NUM_TIME: gl.constexpr,
    FAST: gl.constexpr,
    BLOCK_D: gl.constexpr,
    SCALE_POS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    WINDOW: gl.constexpr,
    MASK_BLOCK: gl.constexpr,
    ROPE: gl.constexpr,
):
    gl.static_assert(BLOCK_M == 2 * CONSUMER_ROWS)
    gl.static_assert(MASK_BLOCK == 0 and not ROPE, "no block mask or RoPE here (`covers`)")
    pid_m = gl.program_id(0)
    if CAUSAL:  # longest programs first
        pid_m = gl.num_programs(0) - 1 - pid_m
    h = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    q_start = gl.load(q_off + b * Q_STRIDE).to(gl.int64)
    q_len = (gl.load(q_off + b * Q_STRIDE + 1) - q_start).to(gl.int32)
    kv_start = gl.load(kv_off + b * KV_STRIDE).to(gl.int64)
    kv_len = (gl.load(kv_off + b * KV_STRIDE + 1) - kv_start).to(gl.int32)
    o_start = q_start
    if Q_STRIDE == 0:
        o_start = b * q_len
    m0 = pid_m * BLOCK_M
    if m0 < q_len:
        shift = kv_len - q_len
        lo, _ = _key_range(m0 + shift, CAUSAL, WINDOW, 0)
        _, hi = _key_range(m0 + BLOCK_M - 1 + shift, CAUSAL, WINDOW, 0)
        j0 = gl.maximum(lo, 0) // BLOCK_N
        num_blocks = gl.maximum(gl.cdiv(gl.maximum(gl.minimum(kv_len, hi), 0), BLOCK_N) - j0, 0)
        dtype: gl.constexpr = Q.dtype.element_ty
        q_smem = gl.allocate_shared_memory(
            dtype, [2, CONSUMER_ROWS, HEAD_DIM], gl.NVMMASharedLayout.get_default_for([CONSUMER_ROWS, HEAD_DIM], dtype)
        )
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        bufs = (q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty)
        seq = (q_start, q_len, kv_len, o_start, m0, shift, h, num_heads, j0, num_blocks)
        io = (stride_qt, stride_qh, stride_ot, stride_oh, scale, qk_scale, inv_max_len)
        kv_io = (kv_start, stride_kt, stride_kh, stride_vt, stride_vh)
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        Q,
                        K,
                        V,
                        Out,
                        LSE,
                        bufs,
                        seq,
                        io,
                        kv_io,
                        HEAD_DIM,
                        MODE,
                        CAUSAL,
                        WINDOW,
                        NORM,
                        SCALE_POS,
                        BLOCK_N,
                        STAGES,
                        0,
                    ),
                ),
                (
                    _consumer,
                    (
                        Q,
                        K,
                        V,
                        Out,
                        LSE,
                        bufs,
                        seq,
                        io,
                        kv_io,
                        HEAD_DIM,
                        MODE,
                        CAUSAL,
                        WINDOW,
                        NORM,
                        SCALE_POS,
                        BLOCK_N,
                        STAGES,
                        1,
                    ),
                ),
            ],
            [4],
            [CONSUMER_REGS],
        )


KERNELS = {"fwd": fwd_kernel}
