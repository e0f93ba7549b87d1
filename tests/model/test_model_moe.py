import pytest
import torch
import torch.nn.functional as F
from gemrec.model import MoEFeedForward


def dense_reference(moe, x):
    """Every token through its top-k experts one by one, weighted by the renormalised router probs."""
    probs = moe.router(x).softmax(-1)
    weights, chosen = probs.topk(moe.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    ex = moe.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], chosen[t]):
            out[t] += w * ((F.silu(x[t] @ ex.w1[e]) * (x[t] @ ex.w3[e])) @ ex.w2[e])
    return out


def make(num_experts=4, top_k=2, dim=8, hidden=16, tokens=37, seed=0):
    torch.manual_seed(seed)
    moe = MoEFeedForward(dim, hidden, num_experts, top_k, init_std=0.5)
    return moe, torch.randn(tokens, dim)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moe_matches_per_token_reference(top_k):
    moe, x = make(top_k=top_k)
    y, aux = moe(x)
    torch.testing.assert_close(y, dense_reference(moe, x), rtol=1e-4, atol=1e-5)
    assert aux.ndim == 0 and aux.item() >= 1.0 - 1e-5  # >= 1, equal only when perfectly balanced
    y.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in moe.parameters())


def test_route_dispatch_combine_steps():
    moe, x = make()
    weights, experts, aux = moe.route(x)
    assert weights.shape == experts.shape == (37, 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(37))
    x_sorted, tokens_per_expert, order = moe.dispatch(x, experts)
    assert tokens_per_expert.sum().item() == 37 * 2
    assert torch.equal(tokens_per_expert, torch.bincount(experts.reshape(-1), minlength=4))
    # Rows come grouped by expert, in expert order.
    assert torch.equal(experts.reshape(-1)[order], torch.sort(experts.reshape(-1)).values)
    y = moe.combine(moe.experts(x_sorted, tokens_per_expert), order, weights)
    torch.testing.assert_close(y, moe(x)[0])


def test_aux_loss_rewards_balance():
    moe, x = make(num_experts=4, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 10.0 * x.mean(0) / x.mean(0).norm()  # most tokens prefer expert 0
    skewed = moe.route(x)[2].item()
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform probabilities -> aux = E * sum(f_e / E) = 1
    assert moe.route(x)[2].item() == pytest.approx(1.0)
    assert skewed > 1.2
    # The aux loss has a gradient into the router (that is what balances it).
    moe.router.weight.requires_grad_(True)
    moe.route(x)[2].backward()
    assert moe.router.weight.grad is not None


def test_an_expert_without_tokens_and_an_empty_batch():
    moe, x = make(num_experts=8, top_k=1, tokens=3)
    y, _ = moe(x)
    torch.testing.assert_close(y, dense_reference(moe, x), rtol=1e-4, atol=1e-5)
    y, _ = moe(torch.zeros(0, 8))
    assert y.shape == (0, 8)


def test_grouped_mm_path_matches_loop():
    # The CUDA path (torch._grouped_mm over aligned groups) also runs on the CPU in bf16: same result.
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    moe, x = make(num_experts=4, top_k=2, dim=16, hidden=32, tokens=45)
    x_sorted, counts, _ = moe.dispatch(x, moe.route(x)[1])
    x_sorted = x_sorted.bfloat16().float().requires_grad_(True)
    want = moe.experts._looped(x_sorted, counts)
    (want_grad,) = torch.autograd.grad(want.sum(), x_sorted)
    got = moe.experts._grouped(x_sorted, counts)
    (got_grad,) = torch.autograd.grad(got.float().sum(), x_sorted)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 0.03 * want.abs().max()
    assert (got_grad - want_grad).abs().max() <= 0.03 * want_grad.abs().max()
    assert torch.isfinite(got_grad).all()
