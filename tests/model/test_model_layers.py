import pytest
import torch
from gemrec.kernels.reference import rotate_half
from gemrec.model.layers import FewRowsEmbedding, Rotary, lookup_with_gemm_grad


def test_rotary_is_a_rotation_that_keeps_only_relative_position():
    rotary = Rotary(8, 10000.0, 16)
    gen = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, 2, 8, generator=gen, dtype=torch.float64),
        torch.randn(1, 2, 8, generator=gen, dtype=torch.float64),
    )

    def score(pq, pk):
        cq, sq = rotary(torch.tensor([pq]), pq + 1)
        ck, sk = rotary(torch.tensor([pk]), pk + 1)
        return (rotate_half(q, cq.double(), sq.double()) * rotate_half(k, ck.double(), sk.double())).sum(-1)

    torch.testing.assert_close(score(3, 1), score(10, 8))
    torch.testing.assert_close(score(0, 0), (q * k).sum(-1))
    assert not torch.allclose(score(3, 1), score(3, 2))
    cos, sin = rotary(torch.tensor([5]), 6)
    rotated = rotate_half(q, cos.double(), sin.double())
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))  # norms kept
    # q and k rotated together as (tokens, 2, heads, head_dim) equals rotating each.
    both = rotate_half(torch.stack([q, k], 1), cos[:, None].double(), sin[:, None].double())
    torch.testing.assert_close(both[:, 0], rotated)


def test_rotary_runs_in_the_input_dtype():
    cos, sin = Rotary(16, 10000.0, 4)(torch.arange(4), 4)
    x = torch.randn(4, 2, 16).bfloat16()
    out = rotate_half(x, cos, sin)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), rotate_half(x.float(), cos, sin), rtol=2e-2, atol=2e-2)


def test_rotary_tables_match_the_angles_and_refuse_longer_sequences():
    rotary = Rotary(16, 10000.0, 64)
    positions = torch.tensor([0, 5, 63, 17])
    cos, sin = rotary(positions, 64)
    angles = positions.double()[:, None] * 10000.0 ** (-torch.arange(0, 16, 2).double() / 16)
    torch.testing.assert_close(cos[:, 0].double(), angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0].double(), angles.sin(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="65 tokens is longer than the 64 positions"):
        rotary(positions, 65)


@pytest.mark.parametrize("compiled", [False, True])
def test_lookup_with_gemm_grad_has_the_gradient_of_an_embedding(compiled):
    torch.manual_seed(0)
    weight = torch.randn(7, 5, requires_grad=True)
    plain = weight.detach().clone().requires_grad_(True)
    indices = torch.randint(0, 6, (300,))  # row 6 never looked up
    upstream = torch.randn(300, 5)
    lookup = torch.compile(lookup_with_gemm_grad) if compiled else lookup_with_gemm_grad
    (lookup(indices, weight) * upstream).sum().backward()
    (torch.nn.functional.embedding(indices, plain) * upstream).sum().backward()
    torch.testing.assert_close(weight.grad, plain.grad)
    assert weight.grad[6].abs().sum() == 0 and weight.grad[:6].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_few_rows_embedding_on_the_gpu_matches_an_embedding():
    ours = FewRowsEmbedding(64, 256).cuda()
    plain = torch.nn.Embedding(64, 256).cuda()
    plain.weight.data.copy_(ours.weight.data)
    indices = torch.randint(0, 64, (20_000,), device="cuda")
    upstream = torch.randn(20_000, 256, device="cuda")
    (ours(indices) * upstream).sum().backward()
    (plain(indices) * upstream).sum().backward()
    torch.testing.assert_close(ours.weight.grad, plain.weight.grad, rtol=1e-4, atol=1e-3)
    assert ours.flops(20_000) == (0, 2 * 20_000 * 64 * 256)
