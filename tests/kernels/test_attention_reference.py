"""The torch reference against a naive per-sequence implementation, the FLOP count, and input validation."""

import math

import pytest
import torch
from gemrec.kernels import RelativeBias, attention_pairs, gdpa, jagged_attention
from gemrec.kernels import triton_attention as kernels_module
from gemrec.kernels.reference import pos_bucket, time_bucket


def offsets_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def naive(
    q,
    k,
    v,
    q_lens,
    kv_lens,
    activation,
    causal,
    scale,
    normalize,
    attn_bias,
    pos,
    tim,
    q_ts,
    kv_ts,
    max_distance,
    log_base,
    max_kv,
):
    """One sequence at a time, scalar bucket math in float64: an independent statement of the semantics."""
    shared_q = len(q_lens) == 1 and len(kv_lens) > 1
    num_seqs = len(kv_lens) if shared_q else len(q_lens)
    outs, q0, k0, o0 = [], 0, 0, 0
    for b in range(num_seqs):
        lq, lk = (q_lens[0] if shared_q else q_lens[b]), kv_lens[b]
        qs = q[0:lq] if shared_q else q[q0 : q0 + lq]
        ks, vs = k[k0 : k0 + lk], v[k0 : k0 + lk]
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        for i in range(lq):
            for j in range(lk):
                rel = abs(i + lk - lq - j)
                if attn_bias is not None:
                    s[:, i, j] += attn_bias[o0 + i, :, j]
                if pos is not None:
                    nb, exact = pos.shape[1], pos.shape[1] // 2
                    bucket = (
                        rel
                        if rel < exact
                        else min(
                            nb - 1, exact + int(math.log(rel / exact) / math.log(max_distance / exact) * (nb - exact))
                        )
                    )
                    s[:, i, j] += pos[:, bucket]
                if tim is not None:
                    dt = abs(int(q_ts[o0 + i]) - int(kv_ts[k0 + j]))
                    s[:, i, j] += tim[:, min(tim.shape[1] - 1, int(math.log(max(dt, 1)) / math.log(log_base)))]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        if activation == "softmax":
            w = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
        else:
            act = {"silu": torch.nn.functional.silu, "relu": torch.relu, "gelu": torch.nn.functional.gelu}[activation]
            w = act(s) * allowed
            w = w / (lk if normalize == "kv_len" else max_kv) if lk else w * 0
        outs.append(torch.einsum("hij,jhd->ihd", w, vs))
        q0, k0, o0 = q0 + lq, k0 + lk, o0 + lq
    return torch.cat(outs) if outs else q[:0]


@pytest.mark.parametrize(
    "q_lens,kv_lens,op,causal",
    [
        ([5, 0, 9, 1], [5, 0, 9, 1], "jfa", False),
        ([5, 0, 9, 1], [5, 0, 9, 1], "jfa", True),
        ([6, 2, 7], [3, 8, 1], "silu", True),
        ([3], [7, 0, 12], "jfa", False),  # PMA: one seed sequence shared by all key sequences
        ([4], [7, 1, 12], "relu", True),
        ([9, 4], [2, 6], "gelu", False),
    ],
)
def test_reference_matches_naive(q_lens, kv_lens, op, causal):
    gen = torch.Generator().manual_seed(len(q_lens) * 31 + len(kv_lens) + int(causal))
    heads, dim = 2, 8
    shared = len(q_lens) == 1 and len(kv_lens) > 1
    rows = q_lens[0] * len(kv_lens) if shared else sum(q_lens)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(kv_lens), heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(kv_lens), heads, dim, generator=gen, dtype=torch.float64)
    max_kv = max(kv_lens)
    attn_bias = torch.randn(rows, heads, max_kv, generator=gen, dtype=torch.float64)
    pos = torch.randn(heads, 6, generator=gen, dtype=torch.float64)
    tim = torch.randn(heads, 5, generator=gen, dtype=torch.float64)
    q_ts = torch.randint(0, 500, (rows,), generator=gen)
    kv_ts = torch.randint(0, 500, (k.shape[0],), generator=gen)
    rel = RelativeBias(
        position=pos, time=tim, q_timestamps=q_ts, kv_timestamps=kv_ts, max_distance=11, time_log_base=2.5
    )
    args = (q, k, v, offsets_of(q_lens), offsets_of(kv_lens), max(q_lens), max_kv)
    kw = dict(causal=causal, scale=0.3, attn_bias=attn_bias, rel_bias=rel, backend="reference")
    if op == "jfa":
        got = jagged_attention(*args, **kw)
    else:
        got = gdpa(*args, activation=op, normalize="kv_len", **kw)
    want = naive(
        q,
        k,
        v,
        q_lens,
        kv_lens,
        "softmax" if op == "jfa" else op,
        causal,
        0.3,
        "kv_len",
        attn_bias,
        pos,
        tim,
        q_ts,
        kv_ts,
        11,
        2.5,
        max_kv,
    )
    assert got.shape == (rows, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_attention_pairs_counts_real_pairs():
    q_lens, kv_lens = [0, 1, 5, 7, 3], [4, 1, 5, 2, 9]
    brute_causal = sum(sum(1 for i in range(a) for j in range(b) if j <= i + b - a) for a, b in zip(q_lens, kv_lens))
    assert attention_pairs(offsets_of(q_lens), offsets_of(kv_lens), causal=True) == brute_causal
    assert attention_pairs(offsets_of(q_lens), offsets_of(kv_lens), causal=False) == sum(
        a * b for a, b in zip(q_lens, kv_lens)
    )
    assert attention_pairs(offsets_of([3]), offsets_of([4, 0, 2]), causal=False) == 3 * 6  # shared q


def test_buckets():
    rel = torch.arange(-40, 41)
    b = pos_bucket(rel, 8, 20)
    assert b[40:44].tolist() == [0, 1, 2, 3]  # exact below num_buckets // 2
    assert (b == pos_bucket(-rel, 8, 20)).all() and int(b.max()) == 7
    assert (b[40:].diff() >= 0).all()
    t = time_bucket(torch.tensor([0, 1, 2, 5, 100, 10**9]), 6, 2.0)
    assert t.tolist() == [0, 0, 1, 2, 5, 5]


def _inputs(lens=(3, 4), heads=2, dim=16):
    off = offsets_of(list(lens))
    x = [torch.randn(sum(lens), heads, dim) for _ in range(3)]
    return (*x, off, off, max(lens), max(lens))


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: (a[0][:, :, :8], *a[1:]), "q and k heads/head_dim differ"),
        (lambda a: (a[0], a[1][:-1], *a[2:]), "k and v shapes differ"),
        (lambda a: (*a[:3], offsets_of([3, 4, 0]), *a[4:]), "must hold the same B\\+1 entries"),
        (lambda a: (*a[:3], offsets_of([3, 3]), *a[4:]), "must start at 0 and end at 7"),
        (lambda a: (*a[:5], 3, a[6]), "max_q_len=3 is below the longest q sequence"),
        (lambda a: (a[0].long(), *a[1:]), "must be floating point"),
        (lambda a: (*a[:3], a[3].float(), *a[4:]), "1-D integer tensor"),
    ],
)
def test_bad_input_is_named(mutate, message):
    with pytest.raises(ValueError, match=message):
        jagged_attention(*mutate(_inputs()), backend="reference")


def test_bad_options_are_named():
    args = _inputs()
    with pytest.raises(ValueError, match="unknown activation"):
        gdpa(*args, activation="tanh", backend="reference")
    with pytest.raises(ValueError, match="use jagged_attention for softmax"):
        gdpa(*args, activation="softmax", backend="reference")
    with pytest.raises(ValueError, match="unknown normalize"):
        gdpa(*args, normalize="sum", backend="reference")
    with pytest.raises(ValueError, match="rel_bias position table"):
        jagged_attention(*args, rel_bias=torch.zeros(3, 8), backend="reference")
    with pytest.raises(ValueError, match="needs q_timestamps"):
        jagged_attention(*args, rel_bias=RelativeBias(time=torch.zeros(2, 4)), backend="reference")
    with pytest.raises(ValueError, match="attn_bias must have shape"):
        jagged_attention(*args, attn_bias=torch.zeros(7, 2, 3), backend="reference")
    with pytest.raises(ValueError, match="unknown backend"):
        jagged_attention(*args, backend="cuda")


@pytest.mark.skipif(kernels_module.INTERPRET, reason="the interpreter is active in this process")
def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        jagged_attention(*_inputs(), backend="triton")


def test_auto_backend_on_cpu_uses_reference_and_differentiates():
    q, k, v, off, _, mq, mk = _inputs()
    q.requires_grad_()
    out = jagged_attention(q, k, v, off, off, mq, mk, causal=True)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    assert torch.allclose(out[0], v[0])  # the first query of a causal sequence sees only its own key
