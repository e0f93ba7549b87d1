"""Window and block masks and RoPE (`window`, `block`, `rope_base`) in the torch reference, against the naive
per-sequence statement of the API; their closed-form pair counts against brute force; their input checks."""

import itertools
import random

import pytest
import torch
from gemrec.kernels import RelativeBias, attention_flops, attention_pairs, gdpa, jagged_attention
from gemrec.kernels.ops import sequence_pairs
from gemrec.kernels.reference import rope_cos_sin, rotate_half
from kernel_harness import naive, offsets_of, sees

MASKS = [
    dict(window=3),
    dict(window=40),  # longer than every sequence: the plain (causal) mask
    dict(block=4),
    dict(block=4, window=2),
    dict(rope_base=10.0),
    dict(window=5, rope_base=100.0),
    dict(block=8, rope_base=10000.0),
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", ["jfa", "silu"])
def test_reference_matches_naive(mask, causal, op):
    gen = torch.Generator().manual_seed(7)
    heads, dim = 2, 8
    shapes = [([6, 0, 13, 1], [6, 0, 13, 1]), ([9, 2], [5, 11]), ([3], [7, 0, 12])]  # self, cross, shared seeds
    for q_lens, kv_lens in shapes:
        rows = q_lens[0] * len(kv_lens) if len(q_lens) == 1 else sum(q_lens)
        q = torch.randn(sum(q_lens), heads, dim, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(sum(kv_lens), heads, dim, generator=gen, dtype=torch.float64) for _ in range(2))
        rel = RelativeBias(position=torch.randn(heads, 6, generator=gen, dtype=torch.float64), max_distance=11)
        attn_bias = torch.randn(rows, heads, max(kv_lens), generator=gen, dtype=torch.float64)
        args = (q, k, v, offsets_of(q_lens), offsets_of(kv_lens), max(q_lens), max(kv_lens))
        kw = dict(causal=causal, attn_bias=attn_bias, rel_bias=rel, backend="reference", **mask)
        got = jagged_attention(*args, **kw) if op == "jfa" else gdpa(*args, activation=op, **kw)
        want = naive(
            q,
            k,
            v,
            q_lens,
            kv_lens,
            activation="softmax" if op == "jfa" else op,
            causal=causal,
            attn_bias=attn_bias,
            rel=rel,
            **mask,
        )
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_rope_is_rotate_half_with_the_models_angles():
    # head dim 4, base 100, position 3: halves (x0, x1) and (x2, x3), angles 3 * 100^0 and 3 * 100^(-1/2)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    a0, a1 = torch.tensor(3.0, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)
    want = [
        1.0 * a0.cos() - 3.0 * a0.sin(),
        2.0 * a1.cos() - 4.0 * a1.sin(),
        1.0 * a0.sin() + 3.0 * a0.cos(),
        2.0 * a1.sin() + 4.0 * a1.cos(),
    ]
    torch.testing.assert_close(rotate_half(x, *rope_cos_sin(torch.tensor([3]), 4, 100.0)), torch.stack(want)[None])


def _brute_pairs(lq: int, lk: int, causal: bool, window: int | None, block: int | None) -> int:
    return sum(sees(i + lk - lq, j, causal, window, block) for i, j in itertools.product(range(lq), range(lk)))


def test_pair_counts_are_closed_form_and_exact():
    rng = random.Random(0)
    for _ in range(1500):
        lq, lk = rng.randint(0, 60), rng.randint(0, 60)
        causal = rng.random() < 0.5
        window, block = rng.choice([None, 1, 2, 5, 16, 100]), rng.choice([None, 1, 3, 4, 16, 64])
        assert sequence_pairs(lq, lk, causal, window, block) == _brute_pairs(lq, lk, causal, window, block), (
            lq,
            lk,
            causal,
            window,
            block,
        )
    # 16k-event histories: counted in closed form, no tokens x tokens anything
    assert sequence_pairs(16384, 16384, True, 1024, None) == 1024 * 16384 - 1024 * 1023 // 2
    assert sequence_pairs(16384, 16384, True, None, 64) == 256 * (64 * 65 // 2)


def test_flops_count_only_the_pairs_the_mask_lets_through():
    lens = [5, 0, 130, 1]
    off = offsets_of(lens)
    full = attention_flops(off, off, 4, 32, causal=True)
    windowed = attention_flops(off, off, 4, 32, causal=True, window=16)
    blocked = attention_flops(off, off, 4, 32, causal=True, block=64)
    pairs = sum(_brute_pairs(n, n, True, 16, None) for n in lens)
    assert windowed == (4 * pairs * 4 * 32, 8 * pairs * 4 * 32)
    assert blocked[0] == 4 * 4 * 32 * sum(_brute_pairs(n, n, True, None, 64) for n in lens)
    assert windowed[0] < full[0] and blocked[0] < full[0]
    assert attention_pairs([0, 3], [0, 10, 20], causal=False, window=2) == 2 * _brute_pairs(3, 10, False, 2, None)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(window=0), "window must be None or a positive int"),
        (dict(window=2.5), "window must be None or a positive int"),
        (dict(block=-64), "block must be None or a positive int"),
        (dict(block=True), "block must be None or a positive int"),
        (dict(rope_base=0.0), "rope_base must be None or a positive finite float"),
        (dict(rope_base=float("inf")), "rope_base must be None or a positive finite float"),
        (dict(rope_base="10000"), "rope_base must be None or a positive finite float"),
    ],
)
def test_bad_mask_arguments_are_refused_by_name(kwargs, message):
    x = torch.randn(6, 2, 16)
    off = offsets_of([6])
    for op in (jagged_attention, gdpa):
        with pytest.raises(ValueError, match=message):
            op(x, x, x, off, off, 6, 6, **kwargs)


def test_rope_needs_an_even_head_dim():
    x = torch.randn(6, 2, 17)
    off = offsets_of([6])
    with pytest.raises(ValueError, match="head_dim must be even, got 17"):
        jagged_attention(x, x, x, off, off, 6, 6, rope_base=10000.0)
