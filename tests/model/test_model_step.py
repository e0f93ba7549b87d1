"""The one training step: forward under the given autocast, loss, backward, then the optimizer."""

import contextlib
import threading

import pytest
import torch
from gemrec.model import ModelConfig, build_model, loss, train_step
from gemrec.model.synthetic import bench_schema, random_input, random_labels

SCHEMA = bench_schema(num_users=50, num_items=60, num_dense=3)


def small_model():
    torch.manual_seed(0)
    return build_model(ModelConfig(embedding_backend="torch", d_model=16, embedding_dim=8, num_heads=2), SCHEMA)


def test_train_step_is_forward_loss_backward_then_the_optimizer():
    model = small_model()
    gen = torch.Generator().manual_seed(1)
    inp = random_input(SCHEMA, 4, 6, generator=gen)
    labels = random_labels(4, SCHEMA.num_tasks, gen)
    opened, seen_grads = [], []

    @contextlib.contextmanager
    def autocast():
        opened.append(True)
        yield

    def optimizer_step():
        seen_grads.append(all(p.grad is not None for p in model.heads.parameters()))

    result = train_step(model, inp, labels, task_weights=[2.0, 0.5], autocast=autocast, optimizer_step=optimizer_step)
    assert opened == [True] and seen_grads == [True]  # the optimizer ran once, after backward
    assert not result.loss.requires_grad
    model.zero_grad()
    with torch.no_grad():
        expected = loss(model(inp), labels, [2.0, 0.5])
    assert torch.allclose(result.loss, expected)
    assert result.output.logits.shape == (4, SCHEMA.num_tasks)


def test_forward_backward_alone_leaves_the_parameters():
    model = small_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, random_input(SCHEMA, 3, 5, seed=2), torch.ones(3, SCHEMA.num_tasks))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_an_objective_replaces_the_multi_task_loss():
    model = small_model()
    inp = random_input(SCHEMA, 3, 5, seed=3)
    opened, calls = [], []

    @contextlib.contextmanager
    def autocast():
        opened.append(True)
        yield

    def objective(m, i):
        calls.append(torch.is_autocast_enabled() or bool(opened))
        return m.sequence_vectors(i).square().mean()

    result = train_step(model, inp, None, autocast=autocast, objective=objective)
    assert calls == [True] and result.output is None
    assert torch.allclose(result.loss, model.sequence_vectors(inp).square().mean().detach())
    assert model.seq_input.token_proj.weight.grad is not None and model.heads.trunk.weight.grad is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_backward_runs_on_the_calling_thread():
    """On a GPU autograd would hand the backward to its device thread; the step keeps it on the caller's."""
    model = small_model().cuda()
    gen = torch.Generator().manual_seed(3)
    inp = random_input(SCHEMA, 4, 6, generator=gen).to("cuda")
    threads = []
    model.heads.register_full_backward_hook(lambda *_: threads.append(threading.get_ident()))
    train_step(model, inp, random_labels(4, SCHEMA.num_tasks, gen).cuda())
    assert threads == [threading.get_ident()]
