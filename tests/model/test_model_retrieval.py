"""Next-item retrieval: GEM's sequence/item vectors, the SASRec baseline, the retrieval losses, dropout."""

import pytest
import torch
import torch.nn.functional as F
from gemrec.model import FeatureSchema, ModelConfig, build_model
from gemrec.model.retrieval import bce_loss, sampled_softmax_loss, softmax_loss
from gemrec.model.sasrec import SASRec, SASRecConfig
from gemrec.model.synthetic import random_input

MANIFEST = {
    "labels": ["interaction"],
    "sparse_features": [
        {"name": "user_id", "source": "user", "num_embeddings": 30},
        {"name": "item_id", "source": "item", "num_embeddings": 40},
        {"name": "item_attributes", "source": "item", "num_embeddings": 7, "multi_valued": True},
    ],
    "seq_item_features": ["item_attributes"],
}
SCHEMA = FeatureSchema.from_manifest(MANIFEST)
SMALL = dict(embedding_dim=8, d_model=16, num_heads=2, head_hidden=16, pma_seeds=2, moe_every=0)


def gem(backend="torch", **overrides):
    torch.manual_seed(0)
    return build_model(ModelConfig(**{**SMALL, "embedding_backend": backend, **overrides}), SCHEMA).eval()


def sasrec(**overrides):
    torch.manual_seed(0)
    return SASRec(SASRecConfig(**{"d_model": 16, "max_positions": 8, **overrides}), SCHEMA).eval()


@pytest.mark.parametrize("make", [gem, sasrec], ids=["gem", "sasrec"])
def test_sequence_vectors_are_causal(make):
    model = make()
    inp = random_input(SCHEMA, 3, 6, lengths=[4, 0, 6], seed=1)
    base = model.sequence_vectors(inp)
    assert base.shape == (10, 16) and torch.isfinite(base).all()
    inp.seq_item_ids = inp.seq_item_ids.clone()
    inp.seq_item_ids[2] = (inp.seq_item_ids[2] + 1) % 40  # token 2 of example 0
    moved = model.sequence_vectors(inp)
    torch.testing.assert_close(moved[:2], base[:2])  # earlier tokens of the same history do not see it
    torch.testing.assert_close(moved[4:], base[4:])  # other histories do not either
    assert not torch.allclose(moved[2:4], base[2:4])


def test_gem_item_vectors_are_the_history_token_projection():
    model = gem()
    inp = random_input(SCHEMA, 2, 5, lengths=[3, 2], seed=2)
    tokens = model.embeddings(inp.sparse_features, inp.seq_item_ids, inp.seq_item_features, batch_size=2)[1]
    vectors = model.item_vectors(inp.seq_item_ids, inp.seq_item_features)
    torch.testing.assert_close(vectors, model.seq_input.token_proj(tokens.flatten(1)))
    # The sequence path reads no example features: the target and user do not change it.
    inp2 = random_input(SCHEMA, 2, 5, lengths=[3, 2], seed=3)
    inp2.seq_item_ids, inp2.seq_item_features = inp.seq_item_ids, inp.seq_item_features
    inp2.seq_timestamps, inp2.timestamps = inp.seq_timestamps, inp.timestamps
    torch.testing.assert_close(model.sequence_vectors(inp2), model.sequence_vectors(inp))


def test_gem_token_lookup_agrees_across_backends():
    ref, plain = gem("torchrec"), gem("torch")
    bags = ref.embeddings.tables.ebc.embedding_bags
    weight = torch.cat([bags[f"t_{name}"].weight for name in SCHEMA.feature_names])
    plain.embeddings.tables.weight.data.copy_(weight)
    inp = random_input(SCHEMA, 3, 7, seed=4)
    torch.testing.assert_close(
        plain.embeddings.tokens(inp.seq_item_ids, inp.seq_item_features),
        ref.embeddings.tokens(inp.seq_item_ids, inp.seq_item_features),
    )


def test_sasrec_checks_history_length_and_ties_items():
    model = sasrec(max_positions=4)
    with pytest.raises(ValueError, match="longer than max_positions=4"):
        model.sequence_vectors(random_input(SCHEMA, 1, 5, lengths=[5], seed=5))
    ids = torch.tensor([3, 7])
    torch.testing.assert_close(model.item_vectors(ids), model.items.weight[ids])


def test_dropout_only_in_training():
    model = gem(dropout=0.5)
    inp = random_input(SCHEMA, 2, 6, lengths=[3, 3], seed=6)
    torch.testing.assert_close(model.sequence_vectors(inp), model.sequence_vectors(inp))
    model.train()
    assert not torch.allclose(model.sequence_vectors(inp), model.sequence_vectors(inp))
    with pytest.raises(ValueError, match=r"model.dropout = 1.0: must be in \[0, 1\)"):
        ModelConfig(dropout=1.0)


def test_losses_by_hand():
    torch.manual_seed(7)
    hidden, items = torch.randn(5, 4), torch.randn(9, 4)
    targets = torch.tensor([0, 3, 3, 8, 1])
    torch.testing.assert_close(softmax_loss(hidden, items, targets), F.cross_entropy(hidden @ items.t(), targets))
    negatives = torch.tensor([3, 5])
    hits = negatives[None, :] == targets[:, None]
    got = sampled_softmax_loss(hidden, items[targets], items[negatives], hits)
    expected = []
    for row in range(5):
        logits = [hidden[row] @ items[targets[row]]] + [
            hidden[row] @ items[n] for n in negatives.tolist() if n != targets[row]
        ]
        expected.append(-torch.log_softmax(torch.stack(logits), 0)[0])
    torch.testing.assert_close(got, torch.stack(expected).mean())
    neg = torch.tensor([2, 2, 4, 0, 6])
    pos_logit, neg_logit = (hidden * items[targets]).sum(1), (hidden * items[neg]).sum(1)
    manual = -(torch.log(torch.sigmoid(pos_logit)).mean() + torch.log(1 - torch.sigmoid(neg_logit)).mean())
    torch.testing.assert_close(bce_loss(hidden, items[targets], items[neg]), manual)


def test_shared_histories_score_like_copies():
    """Candidates sharing one pass of the sequence tower (history_index) get the logits of full copies."""
    from dataclasses import replace

    from gemrec.model import JaggedFeatures, model_flops

    model = gem(target_aware=False)
    hist = random_input(SCHEMA, 2, 5, lengths=[3, 5], seed=8)
    candidates = random_input(SCHEMA, 6, 1, seed=9).sparse_features  # 3 candidates per history
    index = torch.tensor([0, 0, 0, 1, 1, 1])
    timestamps = hist.timestamps[index]
    shared = replace(hist, sparse_features=candidates, dense_features=torch.zeros(6, 0), timestamps=timestamps)
    shared.history_index = index
    # The same examples with each history copied per candidate.
    rows = torch.cat([torch.arange(0, 3)] * 3 + [torch.arange(3, 8)] * 3)
    item_values, item_lengths = hist.seq_item_features["item_attributes"]
    starts = torch.nn.functional.pad(torch.cumsum(item_lengths, 0), (1, 0))
    attr_values = torch.cat([item_values[starts[r] : starts[r + 1]] for r in rows.tolist()])
    copies = replace(
        shared,
        seq_offsets=torch.tensor([0, 3, 6, 9, 14, 19, 24]),
        seq_item_ids=hist.seq_item_ids[rows],
        seq_timestamps=hist.seq_timestamps[rows],
        seq_actions=hist.seq_actions[rows],
        seq_item_features=JaggedFeatures(["item_attributes"], attr_values, item_lengths[rows]),
        history_index=None,
    )
    torch.testing.assert_close(model(shared).logits, model(copies).logits)
    flops_shared, flops_copies = model_flops(model, shared), model_flops(model, copies)
    assert flops_shared["seq_tower.0"][0] * 3 == flops_copies["seq_tower.0"][0]
    assert flops_shared["nonseq_tower.0"] == flops_copies["nonseq_tower.0"]
    with pytest.raises(ValueError, match="need model.target_aware=false"):
        gem(target_aware=True)(shared)
    shared.history_index = torch.tensor([0, 0, 0, 1, 1, 2])
    with pytest.raises(ValueError, match=r"history_index must be in \[0, 2\)"):
        model(shared)


def test_sasrec_layers_are_post_norm_with_small_normal_init():
    model, pre = sasrec(), sasrec(post_norm=False)
    assert isinstance(pre.norm_out, torch.nn.LayerNorm) and isinstance(model.norm_out, torch.nn.Identity)
    inp = random_input(SCHEMA, 2, 6, lengths=[6, 3], seed=6)
    x = torch.randn(9, 16)
    layer = model.layers[0]
    attended = layer.norm1(x + layer.attn(x, x, inp.seq_offsets, inp.seq_offsets, 6, 6))
    torch.testing.assert_close(layer(x, inp.seq_offsets, 6), layer.norm2(attended + layer.mlp(attended)))
    assert not torch.allclose(pre.layers[0](x, inp.seq_offsets, 6), layer(x, inp.seq_offsets, 6))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.bias.abs().max() == 0 for m in linears)
    weights = torch.cat([m.weight.flatten() for m in linears])
    assert abs(float(weights.std()) - 0.02) < 0.002
