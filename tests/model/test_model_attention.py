import math

import gemrec.model.attention as attn_mod
import pytest
import torch
import torch.nn.functional as F
from gemrec.model.attention import attention


def naive(q, k, v, q_offsets, kv_offsets, kind, causal, scale=None):
    """One sequence at a time, no padding at all."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    for i in range(len(q_offsets) - 1):
        qs, qe, ks, ke = q_offsets[i], q_offsets[i + 1], kv_offsets[i], kv_offsets[i + 1]
        if qe == qs or ke == ks:
            continue
        qi, ki, vi = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        s = qi @ ki.transpose(-1, -2) * scale
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if causal:
            mask = torch.tril(mask, diagonal=(ke - ks) - (qe - qs))  # bottom-right aligned
        if kind == "softmax":
            p = s.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
        else:
            p = F.silu(s).masked_fill(~mask, 0.0) / (ke - ks)
        out[qs:qe] = (p @ vi).transpose(0, 1)
    return out


def offsets_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def make(q_lengths, kv_lengths, heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lengths), heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(kv_lengths), heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(kv_lengths), heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v, offsets_of(q_lengths), offsets_of(kv_lengths)


@pytest.mark.parametrize("kind", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [0.0, 0.125, 0.5])
def test_self_attention_matches_per_sequence_loop(kind, causal, padding, monkeypatch):
    monkeypatch.setattr(attn_mod, "REFERENCE_MAX_PADDING", padding)
    lengths = [5, 0, 1, 17, 16, 3, 9, 1, 0, 12, 30, 29]
    q, k, v, qo, ko = make(lengths, lengths)
    out = attention(q, k, v, qo, ko, max(lengths), max(lengths), kind=kind, causal=causal)
    ref = naive(q, k, v, qo.tolist(), ko.tolist(), kind, causal)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("kind", ["softmax", "silu"])
def test_cross_attention_few_queries_long_keys(kind):
    kv_lengths = [40, 0, 1, 7, 33]
    q_lengths = [4] * len(kv_lengths)
    q, k, v, qo, ko = make(q_lengths, kv_lengths, heads=3, dim=4, seed=1)
    out = attention(q, k, v, qo, ko, 4, 40, kind=kind, scale=0.3)
    torch.testing.assert_close(out, naive(q, k, v, qo.tolist(), ko.tolist(), kind, False, scale=0.3))
    # A sequence without keys gives zero outputs, not NaN.
    assert torch.all(out[4:8] == 0)


def test_causal_output_ignores_future_tokens():
    lengths = [6, 4]
    q, k, v, qo, ko = make(lengths, lengths)
    base = attention(q, k, v, qo, ko, 6, 6, causal=True)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[3:6] += 5.0  # change tokens 3.. of sequence 0
    v2[3:6] -= 5.0
    moved = attention(q, k2, v2, qo, ko, 6, 6, causal=True)
    torch.testing.assert_close(moved[:3], base[:3])
    assert not torch.allclose(moved[3:6], base[3:6])
    torch.testing.assert_close(moved[6:], base[6:])  # other sequences untouched


def test_all_empty_and_length_one():
    q, k, v, qo, ko = make([0, 0], [0, 0])
    assert attention(q, k, v, qo, ko, 0, 0).shape == (0, 2, 8)
    q, k, v, qo, ko = make([1, 1], [1, 1])
    # One key: softmax weight 1, so the output is that key's value.
    torch.testing.assert_close(attention(q, k, v, qo, ko, 1, 1, causal=True), v.detach())


def test_bad_input_is_named():
    q, k, v, qo, ko = make([3], [3])
    with pytest.raises(ValueError, match="kind"):
        attention(q, k, v, qo, ko, 3, 3, kind="relu")
    with pytest.raises(ValueError, match="max_q_len"):
        attention(q, k, v, qo, ko, 2, 3)
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        attention(q[:, 0], k, v, qo, ko, 3, 3)


def test_reference_never_materialises_whole_batch(monkeypatch):
    # One long sequence among many short ones: the score tensors stay far below B x max_len^2.
    sizes = []
    real_matmul = torch.matmul

    def spy(a, b):
        out = real_matmul(a, b)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(attn_mod.torch, "matmul", spy)
    lengths = [256] + [2] * 63
    q, k, v, qo, ko = make(lengths, lengths, heads=1, dim=4)
    attention(q, k, v, qo, ko, 256, 256)
    assert max(sizes) <= 256 * 256 * 1 and sum(sizes) < 64 * 256 * 256 / 10
    assert math.isfinite(float(sum(sizes)))


@pytest.mark.parametrize("kind", ["softmax", "silu"])
def test_shared_query_or_key_sequence(kind):
    kv_lengths = [6, 0, 1, 9]
    q, k, v, _, ko = make([3], kv_lengths, seed=2)
    shared = attention(q, k, v, torch.tensor([0, 3]), ko, 3, 9, kind=kind)
    q_rep = q.detach().repeat(4, 1, 1)
    torch.testing.assert_close(shared, naive(q_rep, k, v, [0, 3, 6, 9, 12], ko.tolist(), kind, False))
    q, k, v, qo, _ = make([2, 5, 0], [4], seed=3)
    shared = attention(q, k, v, qo, torch.tensor([0, 4]), 5, 4, kind=kind, causal=True)
    k_rep, v_rep = k.detach().repeat(3, 1, 1), v.detach().repeat(3, 1, 1)
    torch.testing.assert_close(shared, naive(q, k_rep, v_rep, qo.tolist(), [0, 4, 8, 12], kind, True))


def test_causal_is_bottom_right_aligned():
    # 2 queries over 5 keys: query 0 sees keys 0..3, query 1 all 5; 4 queries over 2 keys: the first two see none.
    q, k, v, qo, ko = make([2, 4], [5, 2], seed=4)
    out = attention(q, k, v, qo, ko, 4, 5, causal=True)
    torch.testing.assert_close(out, naive(q, k, v, qo.tolist(), ko.tolist(), "softmax", True))
    assert torch.all(out[2:4] == 0) and torch.all(out[4:6] != 0)


def test_backend_reference_is_honoured_and_bad_backend_named():
    q, k, v, qo, ko = make([3, 5], [3, 5])
    expected = naive(q, k, v, qo, ko, "softmax", False)
    torch.testing.assert_close(attention(q, k, v, qo, ko, 5, 5, backend="reference"), expected)
    with pytest.raises(ValueError, match="backend must be one of"):
        attention(q, k, v, qo, ko, 5, 5, backend="flash")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_and_reference_backends_agree_on_gpu():
    q, k, v, qo, ko = make([0, 1, 70, 300], [0, 1, 70, 300], heads=2, dim=64)
    args = [t.detach().cuda().to(torch.bfloat16) for t in (q, k, v)] + [qo.cuda(), ko.cuda(), 300, 300]
    for kind in ("softmax", "silu"):
        fast = attention(*args, kind=kind, causal=True).double()
        ref = attention(*args, kind=kind, causal=True, backend="reference").double()
        assert (fast - ref).norm() / ref.norm() < 1e-2
