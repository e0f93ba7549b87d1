"""Public ops: `jagged_attention` and `gdpa`, one dispatcher over the Triton kernels and the torch reference.

The Triton path is a `torch.library` custom op pair (`gemrec::attention_fwd` / `gemrec::attention_bwd`)
with fake implementations (so `torch.compile(fullgraph=True)` traces through it), autograd, and FLOP
formulas for `FlopCounterMode` that count only real (unpadded, unmasked) query-key pairs, the window and block masks
included.
"""

from dataclasses import dataclass
from typing import NoReturn

import torch
from gemrec.kernels import triton_attention
from gemrec.kernels.options import KernelOptions
from gemrec.kernels.reference import attention_reference, sequences
from torch.utils.flop_counter import register_flop_formula

ACTIVATIONS = triton_attention.ACTIVATIONS
NORMALIZE = triton_attention.NORMALIZE
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class RelativeBias:
    """Learnable relative-position / time-difference bias tables, indexed in-kernel.

    position: `[heads, num_buckets]`; bucket of |q_pos - k_pos| (bottom-right aligned positions), exact
      below num_buckets // 2, log-spaced up to `max_distance`, the last bucket beyond.
    time: `[heads, num_time_buckets]`; bucket floor(log(max(|ts_q - ts_k|, 1)) / log(time_log_base)),
      clamped; needs `q_timestamps` (one per output row) and `kv_timestamps` (one per key row), int64.
    """

    position: torch.Tensor | None = None
    time: torch.Tensor | None = None
    q_timestamps: torch.Tensor | None = None
    kv_timestamps: torch.Tensor | None = None
    max_distance: int = 128
    time_log_base: float = 2.0


NO_BIAS = RelativeBias()
DEFAULT_OPTIONS = KernelOptions()


def _kernels(q: torch.Tensor):
    if q.is_cuda or triton_attention.INTERPRET:
        return triton_attention
    raise RuntimeError(
        "the Triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is first imported "
        "(the CPU interpreter); use backend='reference' on CPU"
    )


def _problem(
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
    window,
    block,
    rope_base,
    options,
):
    return _kernels(q).Problem(
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
        window=window,
        block=block,
        rope_base=rope_base,
    )


def _num_out_rows(q, q_offsets, kv_offsets) -> int:
    if q_offsets.numel() == 2 and kv_offsets.numel() > 2:
        return q.shape[0] * (kv_offsets.numel() - 1)
    return q.shape[0]


@torch.library.custom_op("gemrec::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    mode: int,
    causal: bool,
    scale: float,
    norm: int,
    attn_bias: torch.Tensor | None,
    pos_table: torch.Tensor | None,
    time_table: torch.Tensor | None,
    q_timestamps: torch.Tensor | None,
    kv_timestamps: torch.Tensor | None,
    pos_max_distance: int,
    time_log_base: float,
    window: int,
    block: int,
    rope_base: float,
    options: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse); lse is the log2-domain logsumexp per (row, head) for softmax, unused otherwise."""
    problem = _problem(
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
        window,
        block,
        rope_base,
        KernelOptions.from_flags(options),
    )
    return triton_attention.forward(problem)


@attention_fwd.register_fake
def _(
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
    window,
    block,
    rope_base,
    options,
):
    rows = _num_out_rows(q, q_offsets, kv_offsets)
    return q.new_empty((rows, q.shape[1], q.shape[2])), q.new_empty((rows, q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("gemrec::attention_bwd", mutates_args=())
def attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    mode: int,
    causal: bool,
    scale: float,
    norm: int,
    attn_bias: torch.Tensor | None,
    pos_table: torch.Tensor | None,
    time_table: torch.Tensor | None,
    q_timestamps: torch.Tensor | None,
    kv_timestamps: torch.Tensor | None,
    pos_max_distance: int,
    time_log_base: float,
    window: int,
    block: int,
    rope_base: float,
    options: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d_attn_bias, d_pos_table, d_time_table); absent biases get empty tensors."""
    problem = _problem(
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
        window,
        block,
        rope_base,
        KernelOptions.from_flags(options),
    )
    grads = triton_attention.backward(problem, grad_out, out, lse)
    dq, dk, dv, d_bias, d_pos, d_time = (g if g is not None else q.new_empty(0) for g in grads)
    return dq, dk, dv, d_bias, d_pos, d_time


@attention_bwd.register_fake
def _(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
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
    window,
    block,
    rope_base,
    options,
):
    def like(t):
        return torch.empty_like(t) if t is not None else q.new_empty(0)

    return like(q), like(k), like(v), like(attn_bias), like(pos_table), like(time_table)


def _setup_context(ctx, inputs, output):
    (
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
        window,
        block,
        rope_base,
        options,
    ) = inputs
    out, lse = output
    ctx.save_for_backward(
        q, k, v, out, lse, q_offsets, kv_offsets, attn_bias, pos_table, time_table, q_timestamps, kv_timestamps
    )
    ctx.set_materialize_grads(False)  # lse gets no gradient: skip allocating zeros for it
    ctx.params = (max_q_len, max_kv_len, mode, causal, scale, norm)
    ctx.extra_params = (pos_max_distance, time_log_base, window, block, rope_base)
    ctx.options = options


def _backward(ctx, grad_out, grad_lse):
    (q, k, v, out, lse, q_offsets, kv_offsets, attn_bias, pos_table, time_table, q_timestamps, kv_timestamps) = (
        ctx.saved_tensors
    )
    dq, dk, dv, dab, dpt, dtt = attention_bwd(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        q_offsets,
        kv_offsets,
        *ctx.params,
        attn_bias,
        pos_table,
        time_table,
        q_timestamps,
        kv_timestamps,
        *ctx.extra_params,
        ctx.options,
    )
    return (
        dq,
        dk,
        dv,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        dab if attn_bias is not None else None,
        dpt if pos_table is not None else None,
        dtt if time_table is not None else None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _direct(q: torch.Tensor) -> bool:
    """Eager calls on plain tensors run the kernels straight from Python: the custom ops' dispatch is for
    tracing (fake tensors) and dispatch modes (FlopCounterMode), which still get them. (Under torch.compile the
    public ops call the custom ops themselves, never `_Attention`.)"""
    return type(q) is torch.Tensor and torch._C._len_torch_dispatch_stack() == 0


class _Attention(torch.autograd.Function):
    """The public ops' autograd path: the kernels straight from Python in eager mode, the custom ops otherwise.

    Calls `attention_fwd` with grad mode off, which skips the per-call schema walk of the op's registered
    autograd (`fill_defaults`: about a millisecond of host time per step, which dominated small configs). Only
    the differentiable tensors are arguments (`call` holds the rest): each argument costs host time in `apply`.
    The forward's `Problem` is kept, without the differentiable tensors (autograd saves those), and bound in place to
    the saved ones in the backward, which neither validates nor derives it again. Its gradients may be views of one
    allocation (`triton_attention.backward`'s `views`), which the custom op's may not.
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, pos_table, time_table, call):
        q_offsets, kv_offsets, q_timestamps, kv_timestamps, params, extra_params, options = call
        tables = (attn_bias, pos_table, time_table, q_timestamps, kv_timestamps)
        if _direct(q):
            # `_problem` without its frame: (pos_max_distance, time_log_base), options, (window, block, rope_base)
            problem = _kernels(q).Problem(
                q, k, v, q_offsets, kv_offsets, *params, *tables, *extra_params[:2], options, *extra_params[2:]
            )
            out, lse = triton_attention.forward(problem)
            ctx.problem = problem.bind(None)  # autograd saves the differentiable tensors
        else:
            out, lse = attention_fwd(q, k, v, q_offsets, kv_offsets, *params, *tables, *extra_params, options.flags)
            ctx.problem = None
        ctx.save_for_backward(q, k, v, out, lse, attn_bias, pos_table, time_table)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, attn_bias, pos_table, time_table = ctx.saved_tensors
        problem = ctx.problem
        if problem is not None and _direct(q) and type(grad_out) is torch.Tensor:
            problem.bind((q, k, v, attn_bias, pos_table, time_table))
            dq, dk, dv, dab, dpt, dtt = triton_attention.backward(problem, grad_out, out, lse, views=True)
            problem.bind(None)  # a retained graph keeps ctx: not the unpacked tensors too
        else:
            q_offsets, kv_offsets, q_timestamps, kv_timestamps, params, extra_params, options = ctx.call
            dq, dk, dv, dab, dpt, dtt = attention_bwd(
                grad_out,
                q,
                k,
                v,
                out,
                lse,
                q_offsets,
                kv_offsets,
                *params,
                attn_bias,
                pos_table,
                time_table,
                q_timestamps,
                kv_timestamps,
                *extra_params,
                options.flags,
            )
        return (
            dq,
            dk,
            dv,
            dab if attn_bias is not None else None,
            dpt if pos_table is not None else None,
            dtt if time_table is not None else None,
            None,
        )


_APPLY = super(torch.autograd.Function, _Attention).apply  # the C++ apply under `Function.apply`


def _distinct(q, k, v, attn_bias, rel: RelativeBias, q_offsets, kv_offsets) -> bool:
    """Whether no tensor of the call has two roles."""
    kv_arg = None if kv_offsets is q_offsets else kv_offsets
    inputs = (q, k, v, attn_bias, rel.position, rel.time, q_offsets, kv_arg, rel.q_timestamps, rel.kv_timestamps)
    present = [t for t in inputs if t is not None]
    return len(set(map(id, present))) == len(present)


def _triangle(n: int) -> int:
    """0 + 1 + ... + (n - 1), 0 for n <= 0."""
    return n * (n - 1) // 2 if n > 0 else 0


def _clamped_prefix(n: int, cap: int) -> int:
    """sum of min(t, cap) over 0 <= t < n (0 for n <= 0)."""
    if n <= cap + 1:
        return _triangle(n)
    return _triangle(cap + 1) + (n - 1 - cap) * cap


def sequence_pairs(q_len: int, kv_len: int, causal: bool, window: int | None = None, block: int | None = None) -> int:
    """(query, key) pairs one sequence's mask lets through, in closed form: query i sits at position
    i + kv_len - q_len and sees key j as `jagged_attention` says (causal, window, block)."""
    if q_len <= 0 or kv_len <= 0:
        return 0
    first = kv_len - q_len  # the first query's position; keys sit at 0 .. kv_len - 1
    if not block:

        def below(c: int) -> int:  # sum over the queries' positions p of clamp(p + c, 0, kv_len)
            return _clamped_prefix(kv_len + c, kv_len) - _clamped_prefix(first + c, kv_len)

        seen = below(1) if causal else below(window) if window else q_len * kv_len
        return seen - (below(1 - window) if window else 0)
    # a query at p = B * block + r (p >= 0; below 0 it shares no block with a key) sees the keys
    # B * block + [max(r - window + 1, 0), min(r + c, block)) that lie below kv_len
    c = 1 if causal else window if window else block
    w = window if window else block

    def rows(r_from: int, r_to: int, cap: int) -> int:  # queries r_from <= r < r_to of a block, keys below cap
        ends = _clamped_prefix(r_to + c, cap) - _clamped_prefix(r_from + c, cap)
        return ends - (_triangle(r_to - w + 1) - _triangle(r_from - w + 1))

    start = max(first, 0)
    b0, b1 = start // block, (kv_len - 1) // block
    last = kv_len - b1 * block
    if b0 == b1:
        return rows(start - b0 * block, last, last)
    return rows(start - b0 * block, block, block) + (b1 - b0 - 1) * rows(0, block, block) + rows(0, last, last)


def attention_pairs(q_offsets, kv_offsets, causal: bool, *, window: int | None = None, block: int | None = None) -> int:
    """Number of (query, key) pairs that are really computed: the unit of the FLOP count, counting only the pairs
    the mask lets through (`sequence_pairs`, closed form per sequence). Offsets are (B+1,) tensors or lists of
    ints; a 2-entry side is shared by every sequence of the other."""
    _, q_lens, _, kv_lens = sequences(_host_list(q_offsets), _host_list(kv_offsets))
    return sum(sequence_pairs(lq, lk, causal, window, block) for lq, lk in zip(q_lens, kv_lens))


def _host_list(offsets) -> list[int]:
    return [int(x) for x in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets)]


def attention_flops(
    q_offsets,
    kv_offsets,
    heads: int,
    head_dim: int,
    causal: bool,
    *,
    window: int | None = None,
    block: int | None = None,
) -> tuple[int, int]:
    """(forward, backward) model FLOPs over the real query-key pairs only (those the mask lets through), 2 per
    multiply-add: forward the 2 matmuls (scores, weighted sum of values), backward the 4 gradient matmuls
    (backward = 2x forward). The scores the kernels recompute in the backward are not model FLOPs and are not
    counted (FlashAttention's benchmarks count them: their fwd+bwd TFLOP/s read 14/12 of ours for the same time).
    RoPE's elementwise work is not counted."""
    pairs = attention_pairs(q_offsets, kv_offsets, causal, window=window, block=block)
    return 4 * pairs * heads * head_dim, 8 * pairs * heads * head_dim


def _flops_from_args(q, q_offsets, kv_offsets, max_q_len, max_kv_len, causal, window, block) -> tuple[int, int]:
    window, block = window or None, block or None
    try:
        return attention_flops(q_offsets, kv_offsets, q.shape[1], q.shape[2], causal, window=window, block=block)
    except (RuntimeError, NotImplementedError):  # fake tensors (compile-time counting): padded upper bound
        num_seqs = max(q_offsets.shape[0], kv_offsets.shape[0]) - 1
        keys = min(max_kv_len, window * (1 if causal else 2) if window else max_kv_len, block or max_kv_len)
        pairs = num_seqs * max_q_len * keys
        return 4 * pairs * q.shape[1] * q.shape[2], 8 * pairs * q.shape[1] * q.shape[2]


@register_flop_formula(torch.ops.gemrec.attention_fwd, get_raw=True)
def _attention_fwd_flops(
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
    window,
    block,
    *args,
    out_val=None,
    **kwargs,
) -> int:
    return _flops_from_args(q, q_offsets, kv_offsets, max_q_len, max_kv_len, causal, window, block)[0]


@register_flop_formula(torch.ops.gemrec.attention_bwd, get_raw=True)
def _attention_bwd_flops(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
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
    window,
    block,
    *args,
    out_val=None,
    **kwargs,
) -> int:
    return _flops_from_args(q, q_offsets, kv_offsets, max_q_len, max_kv_len, causal, window, block)[1]


def _refuse_qkv(q, k, v) -> NoReturn:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not (isinstance(t, torch.Tensor) and t.dim() == 3):
            raise ValueError(
                f"{name} must be a (total_tokens, heads, head_dim) tensor, got {getattr(t, 'shape', type(t))}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def _refuse_offsets(q_offsets, kv_offsets) -> NoReturn:
    def ok(t) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() >= 1 and not t.is_floating_point()

    name = "q_offsets" if not ok(q_offsets) else "kv_offsets"
    raise ValueError(f"{name} must be a 1-D integer tensor of B+1 offsets")


def _on_device(on: bool, attn_bias, rel: RelativeBias) -> bool:
    optional = (attn_bias, rel.position, rel.time, rel.q_timestamps, rel.kv_timestamps)
    return all(t.is_cuda is on for t in optional if t is not None)


def _refuse_devices(q, k, v, q_offsets, kv_offsets, attn_bias, rel: RelativeBias) -> NoReturn:
    named = {"k": k, "v": v, "q_offsets": q_offsets, "kv_offsets": kv_offsets, "attn_bias": attn_bias}
    named |= {f"rel_bias {f}": getattr(rel, f) for f in ("position", "time", "q_timestamps", "kv_timestamps")}
    name, t = next((n, t) for n, t in named.items() if t is not None and t.is_cuda != q.is_cuda)
    raise ValueError(f"{name} must be on q's device ({q.device}) for the Triton backend, got {t.device}")


def _validate(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, attn_bias, rel: RelativeBias, backend, compiling):
    """Refuses malformed calls with a message naming the problem; the messages are formatted only on failure (this
    runs on every eager call: one combined test per group, the one-by-one checks only to name what failed)."""
    if not (
        isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and q.dim() == k.dim() == v.dim() == 3
        and q.dtype == k.dtype == v.dtype
        and q.dtype.is_floating_point
    ):
        _refuse_qkv(q, k, v)
    # shapes compared as ints: torch.Size comparisons cost microseconds each
    (_, heads, dim), (kv_rows, k_heads, k_dim), v_shape = q.shape, k.shape, v.shape
    if (kv_rows, k_heads, k_dim) != (v_shape[0], v_shape[1], v_shape[2]):
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if (heads, dim) != (k_heads, k_dim):
        raise ValueError(f"q and k heads/head_dim differ: {tuple(q.shape)} vs {tuple(k.shape)}")
    if not (
        isinstance(q_offsets, torch.Tensor)
        and isinstance(kv_offsets, torch.Tensor)
        and q_offsets.dim() == kv_offsets.dim() == 1
        and not q_offsets.dtype.is_floating_point
        and not kv_offsets.dtype.is_floating_point
    ):
        _refuse_offsets(q_offsets, kv_offsets)
    nq, nkv = q_offsets.numel(), kv_offsets.numel()
    if not (nq >= 1 and nkv >= 1):
        _refuse_offsets(q_offsets, kv_offsets)
    if not (nq == nkv or nq == 2 or nkv == 2):
        raise ValueError(
            f"q_offsets ({nq}) and kv_offsets ({nkv}) must hold the same B+1 entries (or 2 for a shared q or kv)"
        )
    if not (int(max_q_len) >= 0 and int(max_kv_len) >= 0):
        raise ValueError("max_q_len and max_kv_len must be >= 0")
    if backend == "triton":
        if not 16 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be in [16, {MAX_HEAD_DIM}], got {dim}")
        # the launches pass addresses, which the launcher does not check: a tensor off q's device is refused here
        on = q.is_cuda
        if not (k.is_cuda is on and v.is_cuda is on and q_offsets.is_cuda is on and kv_offsets.is_cuda is on) or (
            (attn_bias is not None or rel is not NO_BIAS) and not _on_device(on, attn_bias, rel)
        ):
            _refuse_devices(q, k, v, q_offsets, kv_offsets, attn_bias, rel)
    rows = _num_out_rows(q, q_offsets, kv_offsets)
    if attn_bias is not None and tuple(attn_bias.shape) != (rows, heads, max_kv_len):
        want = (rows, heads, max_kv_len)
        raise ValueError(f"attn_bias must have shape {want}, got {tuple(attn_bias.shape)}")
    if rel.position is not None:
        table = rel.position
        if not (table.dim() == 2 and table.shape[0] == heads and table.shape[1] >= 2):
            raise ValueError(
                f"rel_bias position table must be [heads={heads}, num_buckets>=2], got {tuple(table.shape)}"
            )
        if rel.max_distance <= table.shape[1] // 2:
            raise ValueError(f"rel_bias max_distance ({rel.max_distance}) must exceed num_buckets // 2")
    if rel.time is not None:
        if not (rel.time.dim() == 2 and rel.time.shape[0] == heads):
            raise ValueError(f"rel_bias time table must be [heads={heads}, num_buckets], got {tuple(rel.time.shape)}")
        if rel.q_timestamps is None or rel.kv_timestamps is None:
            raise ValueError("rel_bias time table needs q_timestamps and kv_timestamps")
        if rel.q_timestamps.shape != (rows,):
            raise ValueError(f"q_timestamps must have shape ({rows},) (one per output row)")
        if rel.kv_timestamps.shape != (kv_rows,):
            raise ValueError(f"kv_timestamps must have shape ({kv_rows},)")
        if rel.time_log_base <= 1.0:
            raise ValueError("rel_bias time_log_base must be > 1")
    if q_offsets.is_cpu and not compiling:
        for name, off, total, max_len in (
            ("q", q_offsets.tolist(), q.shape[0], max_q_len),
            ("kv", kv_offsets.tolist(), k.shape[0], max_kv_len),
        ):
            lens = [b - a for a, b in zip(off, off[1:])]
            if not (off[0] == 0 and off[-1] == total):
                raise ValueError(f"{name}_offsets must start at 0 and end at {total} (the number of rows), got {off}")
            if min(lens, default=0) < 0:
                raise ValueError(f"{name}_offsets must be non-decreasing")
            if max(lens, default=0) > max_len:
                raise ValueError(
                    f"max_{name}_len={max_len} is below the longest {name} sequence ({max(lens, default=0)})"
                )


def _validate_masks(q, window, block, rope_base) -> None:
    """Refuses a bad window, block or rope_base by name (messages formatted only on failure)."""
    for name, value in (("window", window), ("block", block)):
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{name} must be None or a positive int, got {value!r}")
    if rope_base is not None:
        if type(rope_base) not in (int, float) or not 0 < rope_base < float("inf"):
            raise ValueError(f"rope_base must be None or a positive finite float, got {rope_base!r}")
        if q.shape[-1] % 2:
            raise ValueError(f"rope_base rotates halves of the head dim: head_dim must be even, got {q.shape[-1]}")


def _attention(
    q,
    k,
    v,
    q_offsets,
    kv_offsets,
    max_q_len,
    max_kv_len,
    activation,
    causal,
    scale,
    normalize,
    attn_bias,
    rel_bias,
    backend,
    window,
    block,
    rope_base,
    options,
):
    if window is not None or block is not None or rope_base is not None:
        _validate_masks(q, window, block, rope_base)
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(ACTIVATIONS)}")
    if normalize not in NORMALIZE:
        raise ValueError(f"unknown normalize {normalize!r}; expected one of {sorted(NORMALIZE)}")
    if backend == "auto":
        backend = "triton" if q.is_cuda and 16 <= q.shape[2] <= MAX_HEAD_DIM else "reference"
    if backend not in ("triton", "reference"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'triton' or 'reference'")
    if options is None:
        options = DEFAULT_OPTIONS
    elif not isinstance(options, KernelOptions):
        raise ValueError(f"options must be a gemrec.kernels.KernelOptions, got {type(options).__name__}")
    if options.fp8 and rope_base:
        raise ValueError(
            "options.fp8: the FP8 attention forward does not support rope_base (RoPE); run this call with fp8=False"
        )
    if isinstance(rel_bias, torch.Tensor):
        rel_bias = RelativeBias(position=rel_bias)
    rel = rel_bias if rel_bias is not None else NO_BIAS
    compiling = torch.compiler.is_compiling()
    _validate(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, attn_bias, rel, backend, compiling)
    scale = float(q.shape[2] ** -0.5 if scale is None else scale)
    if backend == "reference":
        return attention_reference(
            q,
            k,
            v,
            q_offsets,
            kv_offsets,
            max_q_len,
            max_kv_len,
            activation=activation,
            causal=causal,
            scale=scale,
            normalize=normalize,
            attn_bias=attn_bias,
            pos_table=rel.position,
            time_table=rel.time,
            q_timestamps=rel.q_timestamps,
            kv_timestamps=rel.kv_timestamps,
            pos_max_distance=rel.max_distance,
            time_log_base=rel.time_log_base,
            window=window,
            block=block,
            rope_base=rope_base,
            fp8=options.fp8,
        )
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if attn_bias is not None and attn_bias.stride(-1) != 1:
        attn_bias = attn_bias.contiguous()
    params = (int(max_q_len), int(max_kv_len), ACTIVATIONS[activation], bool(causal), scale, NORMALIZE[normalize])
    extra_params = (int(rel.max_distance), float(rel.time_log_base), window or 0, block or 0, float(rope_base or 0.0))
    # Under torch.compile, the op's registered autograd: dynamo guards on the `id()`s below (a recompile per call,
    # the H200 trace showed the model cut at every attention call). Eagerly, the Function, unless one tensor has
    # two roles (k is v, say; the offsets are integer tensors, never q, k or v).
    if not compiling and (
        q is not k and q is not v and k is not v
        if attn_bias is None and rel is NO_BIAS
        else _distinct(q, k, v, attn_bias, rel, q_offsets, kv_offsets)
    ):
        call = (q_offsets, kv_offsets, rel.q_timestamps, rel.kv_timestamps, params, extra_params, options)
        if torch._C._are_functorch_transforms_active():
            return _Attention.apply(q, k, v, attn_bias, rel.position, rel.time, call)
        # what `Function.apply` does without functorch transforms, minus its Python (~4 us a call on the CPU machine)
        unwrap = torch._C._functorch.unwrap_if_dead
        biases = (attn_bias, rel.position, rel.time)
        if attn_bias is not None or rel is not NO_BIAS:
            biases = tuple(t if t is None else unwrap(t) for t in biases)
        return _APPLY(unwrap(q), unwrap(k), unwrap(v), *biases, call)
    out, _ = attention_fwd(
        q,
        k,
        v,
        q_offsets,
        kv_offsets,
        *params,
        attn_bias,
        rel.position,
        rel.time,
        rel.q_timestamps,
        rel.kv_timestamps,
        *extra_params,
        options.flags,
    )
    return out


def jagged_attention(
    q,
    k,
    v,
    q_offsets,
    kv_offsets,
    max_q_len,
    max_kv_len,
    *,
    causal=False,
    scale=None,
    attn_bias=None,
    rel_bias=None,
    window=None,
    block=None,
    rope_base=None,
    backend="auto",
    options=None,
):
    """Softmax attention of each query sequence over its own key/value sequence (jagged, no padding).

    q: (total_q, H, D); k, v: (total_kv, H, D); offsets: (B+1,) int64. A 2-entry `q_offsets` with B > 1
    shares one query sequence across all B key sequences (PMA seeds; output is (B * len_q, H, D)); a
    2-entry `kv_offsets` likewise shares one key/value sequence. Positions are 0-based within each sequence; query
    i of a length-Lq sequence sits at position i + (Lkv - Lq) (bottom-right aligned). causal: it sees keys
    j <= its position. `attn_bias`: (output rows, H, max_kv_len) dense per-query-row bias; `rel_bias`: a
    `[H, num_buckets]` position table or a `RelativeBias`.
    window=W: causal, key j is seen iff pos - W < j <= pos; not causal, iff |pos - j| < W. block=b: iff
    pos // b == j // b (and j <= pos when causal). rope_base=theta: q and k rotated by their positions before the
    dot product (rotate-half: [x1 cos - x2 sin, x1 sin + x2 cos] for the halves x1, x2 of the head dim, angle
    pos * theta^(-2m/D)), inside the kernels; gradients are w.r.t. the unrotated q and k. All combine.
    backend: "auto" (Triton on CUDA for head dims 16..256, the reference otherwise), "triton" (the interpreter on
    CPU) or "reference" (`reference.attention_reference`). options: a `KernelOptions` for the Triton path (tiles,
    kernel variants, autotuning; never the result beyond rounding), its defaults when None.
    """
    return _attention(
        q,
        k,
        v,
        q_offsets,
        kv_offsets,
        max_q_len,
        max_kv_len,
        "softmax",
        causal,
        scale,
        "none",
        attn_bias,
        rel_bias,
        backend,
        window,
        block,
        rope_base,
        options,
    )


def gdpa(
    q,
    k,
    v,
    q_offsets,
    kv_offsets,
    max_q_len,
    max_kv_len,
    *,
    activation="silu",
    causal=False,
    scale=None,
    normalize="kv_len",
    attn_bias=None,
    rel_bias=None,
    window=None,
    block=None,
    rope_base=None,
    backend="auto",
    options=None,
):
    """Generalized dot-product attention: out = act(scale * q k^T + bias) v * norm, no softmax.

    activation: silu, gelu, gelu_tanh, relu, relu2. normalize: "kv_len" (1 / the sequence's key count),
    "max_len" (1 / max_kv_len, as HSTU) or "none". Layout, sharing, causal, bias, window, block, rope_base, backend
    and options as
    `jagged_attention`.
    """
    if activation == "softmax":
        raise ValueError("gdpa takes a pointwise activation; use jagged_attention for softmax")
    return _attention(
        q,
        k,
        v,
        q_offsets,
        kv_offsets,
        max_q_len,
        max_kv_len,
        activation,
        causal,
        scale,
        normalize,
        attn_bias,
        rel_bias,
        backend,
        window,
        block,
        rope_base,
        options,
    )
