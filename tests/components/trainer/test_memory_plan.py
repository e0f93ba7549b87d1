"""The memory plan: `[parallel] activation_checkpoint` (none | full | selective by block name and every N-th), applied
to the vanilla model by `parallelize` (or `setup_training` on one process), never written into the layers."""

import dataclasses

import pytest
import torch
from gemrec.components.trainer.config import load_recipe
from gemrec.components.trainer.parallel import ParallelConfig, ParallelConfigError, apply_activation_checkpointing
from gemrec.components.trainer.parallel.parallelize import activation_checkpoint_plan, checkpoint_block, fsdp_blocks
from gemrec.components.trainer.training import peak_memory_gib, setup_training
from gemrec.config import ConfigError
from gemrec.model import build_model, loss
from gemrec.model.synthetic import bench_schema, random_input

SCHEMA = bench_schema(100, 100, 4)
MODEL = ["model.embedding_backend=torch", "model.seq_layers=4", "model.interaction_layers=2", "model.dropout=0.1"]


def gem(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(load_recipe("tiny", MODEL).model, SCHEMA)


def plan(**config) -> list[str]:
    return activation_checkpoint_plan(fsdp_blocks(gem()), ParallelConfig(**config))


def test_the_plan_names_its_blocks():
    every_block = ["seq_tower.0", "seq_tower.1", "seq_tower.2", "seq_tower.3", "nonseq_tower.0", "interaction.0"]
    every_block += ["interaction.1", "heads.towers.0", "heads.towers.1"]
    assert plan() == []
    assert plan(activation_checkpoint="full") == every_block
    assert plan(activation_checkpoint="selective") == every_block
    seq = ["seq_tower.0", "seq_tower.1", "seq_tower.2", "seq_tower.3"]
    assert plan(activation_checkpoint="selective", activation_checkpoint_blocks=("seq_tower.*",)) == seq
    assert plan(
        activation_checkpoint="selective", activation_checkpoint_blocks=("seq_tower.*",), activation_checkpoint_every=2
    ) == ["seq_tower.0", "seq_tower.2"]
    assert plan(activation_checkpoint="selective", activation_checkpoint_blocks=("interaction.1", "seq_tower.3")) == [
        "seq_tower.3",
        "interaction.1",
    ]  # model order
    with pytest.raises(
        ParallelConfigError, match=r"\['seq.*'\] match no block; the model's blocks are \['seq_tower.0'"
    ):
        plan(activation_checkpoint="selective", activation_checkpoint_blocks=("seq.*",))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"activation_checkpoint": "some"}, "parallel.activation_checkpoint = 'some': must be one of 'none', 'full',"),
        (
            {"activation_checkpoint": "full", "activation_checkpoint_every": 2},
            "parallel.activation_checkpoint_every = 2: chooses blocks for activation_checkpoint = 'selective', "
            "not 'full'",
        ),
        (
            {"activation_checkpoint_blocks": ("seq_tower.*",)},
            r"parallel.activation_checkpoint_blocks = \('seq_tower.\*',\): chooses blocks for .* not 'none'",
        ),
        (
            {"activation_checkpoint": "selective", "activation_checkpoint_every": 0},
            "parallel.activation_checkpoint_every = 0: must be >= 1",
        ),
    ],
)
def test_contradictory_memory_plans_are_refused_by_name(config, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**config)


def step(model, inp, labels):
    """One forward + backward: (loss, gradients, elements kept for backward)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # dropout draws: the recomputed forward must replay them
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        total = loss(model(inp), labels)
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total.detach(), grads, sum(saved)


def count_forwards(model) -> dict[str, int]:
    """Forward calls of each block's modules from now on."""
    calls = {name: 0 for name, _ in fsdp_blocks(model)}
    for name, block in fsdp_blocks(model):
        for module in block.modules():
            module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    return calls


@pytest.mark.parametrize(
    "config",
    [
        {"activation_checkpoint": "full"},
        {"activation_checkpoint": "selective", "activation_checkpoint_blocks": ("seq_tower.*",)},
        {"activation_checkpoint": "selective", "activation_checkpoint_every": 3},
    ],
)
def test_checkpointed_blocks_recompute_and_give_the_same_gradients(config):
    inp = random_input(SCHEMA, 6, 24, lengths=[24, 0, 1, 9, 17, 24], seed=1)
    labels = torch.randint(0, 2, (6, 2)).float()
    plain = gem()
    plain_calls = count_forwards(plain)
    want_loss, want, plain_saved = step(plain, inp, labels)
    model = gem()
    names = apply_activation_checkpointing(model, ParallelConfig(**config))
    assert names == activation_checkpoint_plan(fsdp_blocks(gem()), ParallelConfig(**config))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]  # names unchanged
    calls = count_forwards(model)
    got_loss, got, saved = step(model, inp, labels)
    # The checkpointed blocks run (most of) their forward again in backward (it stops once it has what backward needs)
    assert {n for n, c in calls.items() if plain_calls[n] < c <= 2 * plain_calls[n]} == set(names)
    assert {n for n, c in calls.items() if c == plain_calls[n]} == set(calls) - set(names)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert saved < plain_saved  # fewer elements kept for backward


def test_a_checkpointed_block_compiles_into_one_graph_and_copies_with_its_module():
    """torch.utils.checkpoint is traced by dynamo (the composable `checkpoint` broke the graph at every block)."""
    import copy

    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    checkpoint_block(block)
    x = torch.randn(4, 8, requires_grad=True)
    explained = torch._dynamo.explain(lambda x: block(x).sum())(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    twin = copy.deepcopy(block)
    with torch.no_grad():
        twin[0].weight.mul_(2.0)
    assert not torch.allclose(twin(x), block(x))  # the copy runs its own weights


def test_one_process_training_applies_the_plan():
    config = load_recipe(
        "tiny",
        [*MODEL, "parallel.activation_checkpoint=selective", 'parallel.activation_checkpoint_blocks=["seq_tower.*"]'],
    )
    training = setup_training(config, SCHEMA, torch.device("cpu"), 4)
    assert training.checkpointed == ["seq_tower.0", "seq_tower.1", "seq_tower.2", "seq_tower.3"]
    inp = random_input(SCHEMA, 4, 12, seed=2)
    assert torch.isfinite(training.step(inp, torch.ones(4, 2)).loss)
    off = setup_training(dataclasses.replace(config, parallel=ParallelConfig()), SCHEMA, torch.device("cpu"), 4)
    assert off.checkpointed == [] and peak_memory_gib(torch.device("cpu")) is None


def test_training_keeps_the_task_weights_as_a_tensor_the_loss_reads_as_is():
    """A Python list would be copied host-to-device (a synchronizing copy from pageable memory) at every step."""
    labels = list(SCHEMA.labels)
    config = load_recipe("tiny", [*MODEL, f"train.task_weights={{{labels[0]} = 2.0}}"])
    training = setup_training(config, SCHEMA, torch.device("cpu"), 4)
    assert isinstance(training.task_weights, torch.Tensor)
    weights = [2.0] + [1.0] * (len(labels) - 1)
    assert training.task_weights.tolist() == weights
    inp, target = random_input(SCHEMA, 4, 12, seed=3), torch.ones(4, len(labels))
    output = training.model(inp)
    assert torch.equal(loss(output, target, training.task_weights), loss(output, target, weights))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_weighted_loss_does_not_synchronize_on_the_gpu():
    config = load_recipe("tiny", [*MODEL, f"train.task_weights={{{SCHEMA.labels[0]} = 2.0}}"])
    training = setup_training(config, SCHEMA, torch.device("cuda"), 4)
    inp, target = random_input(SCHEMA, 4, 12, seed=3).to("cuda"), torch.ones(4, len(SCHEMA.labels), device="cuda")
    output = training.model(inp)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss(output, target, training.task_weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_checkpointing_the_sequence_tower_lowers_the_peak_on_the_gpu():
    overrides = [
        "model.d_model=512",
        "model.num_heads=4",
        "model.seq_layers=4",
        "data.max_seq_len=4096",
        "train.precision=bf16",
    ]
    inp = random_input(SCHEMA, 8, 4096, lengths=[4096, 3000, 2000, 1000, 4096, 10, 0, 2500], seed=4).to("cuda")
    labels = torch.ones(8, 2, device="cuda")
    peaks = {}
    for plan_args in (
        [],
        ["parallel.activation_checkpoint=selective", 'parallel.activation_checkpoint_blocks=["seq*"]'],
    ):
        config = load_recipe("tiny", [*MODEL, *overrides, *plan_args])
        torch.manual_seed(0)
        training = setup_training(config, SCHEMA, torch.device("cuda"), 4)
        training.step(inp, labels)  # optimizer state allocated
        torch.cuda.synchronize()
        peak_memory_gib(torch.device("cuda"))
        training.step(inp, labels)
        torch.cuda.synchronize()
        peaks[bool(plan_args)] = peak_memory_gib(torch.device("cuda"))
        del training
        torch.cuda.empty_cache()
    assert 0 < peaks[True] < 0.8 * peaks[False], peaks
