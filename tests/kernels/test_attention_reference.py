"""The torch reference against a naive per-sequence implementation (every feature, every length grouping), the FLOP
count, and input validation."""

import pytest
import torch
import torch.nn.functional as F
from gemrec.kernels import RelativeBias, attention_flops, attention_pairs, gdpa, jagged_attention
from gemrec.kernels import triton_attention as kernels_module
from gemrec.kernels.reference import attention_reference, pos_bucket, time_bucket
from kernel_harness import naive, offsets_of


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
    activation = "softmax" if op == "jfa" else op
    want = naive(
        q, k, v, q_lens, kv_lens, activation=activation, causal=causal, scale=0.3, attn_bias=attn_bias, rel=rel
    )
    assert got.shape == (rows, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def _leaves(q_lens, kv_lens, heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(sum(q_lens), heads, dim), (sum(kv_lens), heads, dim), (sum(kv_lens), heads, dim)]
    return [torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True) for shape in shapes]


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("max_padding", [0.0, 0.125, 0.5])
def test_length_groups_match_naive_with_gradients(activation, causal, max_padding):
    """Grouping pads sequences to their group's longest member: padded rows and keys never leak, biases included."""
    lengths = [5, 0, 1, 17, 16, 3, 9, 1, 0, 12, 30, 29]
    q, k, v = _leaves(lengths, lengths)
    gen = torch.Generator().manual_seed(1)
    attn_bias = torch.randn(sum(lengths), 2, 30, generator=gen, dtype=torch.float64, requires_grad=True)
    rel = RelativeBias(
        position=torch.randn(2, 8, generator=gen, dtype=torch.float64, requires_grad=True),
        time=torch.randn(2, 6, generator=gen, dtype=torch.float64, requires_grad=True),
        q_timestamps=torch.randint(0, 300, (sum(lengths),), generator=gen),
        kv_timestamps=torch.randint(0, 300, (sum(lengths),), generator=gen),
        max_distance=20,
    )
    off = offsets_of(lengths)
    out = attention_reference(
        q,
        k,
        v,
        off,
        off,
        30,
        30,
        activation=activation,
        causal=causal,
        normalize="kv_len",
        attn_bias=attn_bias,
        pos_table=rel.position,
        time_table=rel.time,
        q_timestamps=rel.q_timestamps,
        kv_timestamps=rel.kv_timestamps,
        pos_max_distance=rel.max_distance,
        max_padding=max_padding,
    )
    want = naive(q, k, v, lengths, lengths, activation=activation, causal=causal, attn_bias=attn_bias, rel=rel)
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(out)
    leaves = (q, k, v, attn_bias, rel.position, rel.time)
    for got, expected in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("q_lens,kv_lens", [([6] * 4, [9] * 4), ([5], [8] * 3), ([7] * 3, [4])])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [{}, dict(window=3, rope_base=100.0), dict(block=4)], ids=["none", "window", "block"])
def test_equal_lengths_with_every_bias(q_lens, kv_lens, causal, mask):
    """Every sequence of the same lengths (a shared side included) is computed on views, without gathers."""
    q, k, v = _leaves(q_lens, kv_lens, seed=5)
    gen = torch.Generator().manual_seed(6)
    rows = q_lens[0] * max(len(q_lens), len(kv_lens))
    attn_bias = torch.randn(rows, 2, kv_lens[0], generator=gen, dtype=torch.float64, requires_grad=True)
    rel = RelativeBias(
        position=torch.randn(2, 6, generator=gen, dtype=torch.float64, requires_grad=True),
        time=torch.randn(2, 5, generator=gen, dtype=torch.float64, requires_grad=True),
        q_timestamps=torch.randint(0, 300, (rows,), generator=gen),
        kv_timestamps=torch.randint(0, 300, (sum(kv_lens),), generator=gen),
        max_distance=11,
    )
    args = (q, k, v, offsets_of(q_lens), offsets_of(kv_lens), q_lens[0], kv_lens[0])
    for op, activation in ((jagged_attention, "softmax"), (gdpa, "silu")):
        out = op(*args, causal=causal, attn_bias=attn_bias, rel_bias=rel, **mask)
        want = naive(
            q, k, v, q_lens, kv_lens, activation=activation, causal=causal, attn_bias=attn_bias, rel=rel, **mask
        )
        torch.testing.assert_close(out, want)
        leaves = (q, k, v, attn_bias, rel.position, rel.time)
        grad = torch.randn_like(out)
        for got, expected in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(want, leaves, grad)):
            torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_shared_key_sequence_and_sequences_without_keys(activation):
    q, k, v = _leaves([2, 5, 0], [4], seed=3)
    op = jagged_attention if activation == "softmax" else gdpa
    out = op(q, k, v, offsets_of([2, 5, 0]), offsets_of([4]), 5, 4, causal=True)
    torch.testing.assert_close(out, naive(q, k, v, [2, 5, 0], [4], activation=activation, causal=True))
    q, k, v = _leaves([4] * 3, [7, 0, 3], seed=4)
    out = op(q, k, v, offsets_of([4] * 3), offsets_of([7, 0, 3]), 4, 7)
    assert torch.all(out[4:8] == 0)  # no keys: zeros, not NaN
    torch.testing.assert_close(out, naive(q, k, v, [4] * 3, [7, 0, 3], activation=activation))


def test_empty_and_length_one_sequences():
    q, k, v = _leaves([0, 0], [0, 0])
    out = jagged_attention(q, k, v, offsets_of([0, 0]), offsets_of([0, 0]), 0, 0)
    assert out.shape == (0, 2, 8)
    q, k, v = _leaves([1, 1], [1, 1])
    out = jagged_attention(q, k, v, offsets_of([1, 1]), offsets_of([1, 1]), 1, 1, causal=True)
    torch.testing.assert_close(out, v.detach())  # one key: softmax weight 1, the output is its value
    q, k, v = _leaves([3, 2], [0, 0])
    out = gdpa(q, k, v, offsets_of([3, 2]), offsets_of([0, 0]), 3, 0)
    assert torch.all(out == 0) and out.requires_grad  # still in the autograd graph


def test_no_score_tensor_spans_the_whole_batch(monkeypatch):
    # One long sequence among many short ones: the score tensors stay far below B x max_len^2.
    sizes = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        sizes.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])  # the scores this call's softmax spans
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    lengths = [256] + [2] * 63
    q, k, v = _leaves(lengths, lengths, heads=1, dim=4)
    jagged_attention(q, k, v, offsets_of(lengths), offsets_of(lengths), 256, 256)
    assert max(sizes) <= 256 * 256 and sum(sizes) < 64 * 256 * 256 / 10


def test_attention_pairs_counts_real_pairs():
    q_lens, kv_lens = [0, 1, 5, 7, 3], [4, 1, 5, 2, 9]
    brute_causal = sum(sum(1 for i in range(a) for j in range(b) if j <= i + b - a) for a, b in zip(q_lens, kv_lens))
    assert attention_pairs(offsets_of(q_lens), offsets_of(kv_lens), causal=True) == brute_causal
    assert attention_pairs(offsets_of(q_lens), offsets_of(kv_lens), causal=False) == sum(
        a * b for a, b in zip(q_lens, kv_lens)
    )
    assert attention_pairs(offsets_of([3]), offsets_of([4, 0, 2]), causal=False) == 3 * 6  # shared q
    # host lists work the same (the model counts from its host-side lengths)
    assert attention_pairs([0, 4], [0, 4], causal=True) == 10
    assert attention_pairs([0, 4, 4, 5], [0, 4, 4, 5], causal=False) == 17
    assert attention_pairs([0, 3], [0, 2], causal=True) == 0 + 1 + 2  # bottom-right aligned
    assert attention_pairs([0, 2], [0, 5], causal=True) == 4 + 5


def test_attention_flops_are_model_flops():
    fwd, bwd = attention_flops([0, 3, 7], [0, 3, 7], heads=2, head_dim=8, causal=False)
    pairs = 9 + 16
    assert (fwd, bwd) == (4 * pairs * 16, 8 * pairs * 16)  # backward = 2x forward: recomputed scores not counted


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
        (lambda a: (a[0], a[1].double(), *a[2:]), "q, k, v dtypes differ"),
        (lambda a: (a[0], a[1], a[2][:, 0], *a[3:]), "v must be a \\(total_tokens, heads, head_dim\\) tensor"),
        (
            lambda a: (a[0].tolist(), *a[1:]),
            "q must be a \\(total_tokens, heads, head_dim\\) tensor, got <class 'list'>",
        ),
        (lambda a: (*a[:4], a[4].float(), *a[5:]), "kv_offsets must be a 1-D integer tensor"),
        (lambda a: (*a[:3], a[3][:0], *a[4:]), "q_offsets must be a 1-D integer tensor"),
        (lambda a: (*a[:4], a[4][None], *a[5:]), "kv_offsets must be a 1-D integer tensor"),
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
