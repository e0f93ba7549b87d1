import pytest
import torch
from gemrec.model import FeatureSchema, JaggedFeatures, ModelConfig, ModelOutput, build_model, loss
from gemrec.model.gem import CrossNetwork, PiecewiseLinearTokens
from gemrec.model.synthetic import random_input
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

MANIFEST = {
    "labels": ["like", "love"],
    "actions": ["rating", "like", "love"],
    "sparse_features": [
        {"name": "user_id", "source": "user", "num_embeddings": 50},
        {"name": "item_id", "source": "item", "num_embeddings": 100},
        {"name": "item_genres", "source": "item", "num_embeddings": 12, "multi_valued": True},
        {"name": "user_tags", "source": "user", "num_embeddings": 9, "multi_valued": True},
    ],
    "seq_item_features": ["item_genres"],
    "dense_features": ["hour_sin", "hour_cos"],
}
SCHEMA = FeatureSchema.from_manifest(MANIFEST)
SMALL = dict(embedding_dim=8, d_model=16, num_heads=2, moe_hidden=16, head_hidden=16, pma_seeds=2)


def build(seed=0, **overrides):
    torch.manual_seed(seed)
    return build_model(ModelConfig(**{**SMALL, **overrides}), SCHEMA)


def to_kjt(jf):
    return KeyedJaggedTensor(keys=jf.keys(), values=jf.values(), lengths=jf.lengths(), stride=jf.stride())


@pytest.mark.parametrize("arch", ["gem", "dlrm"])
@pytest.mark.parametrize("backend", ["torchrec", "torch"])
def test_output_shapes_and_finite(arch, backend):
    model = build(arch=arch, embedding_backend=backend)
    inp = random_input(SCHEMA, 6, 9, seed=1)
    out = model(inp)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (6, 2) and out.aux_loss.shape == ()
    assert torch.isfinite(out.logits).all()
    if arch == "gem":
        assert out.aux_loss.item() > 0  # an MoE layer is in the interaction stack by default


@pytest.mark.parametrize("kind", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_and_length_one_histories(kind, causal):
    model = build(seq_attention=kind, seq_causal=causal, time_encoding="continuous")
    for lengths in ([0, 0, 0], [1, 0, 1], [0, 5, 1]):
        inp = random_input(SCHEMA, 3, 5, lengths=lengths, seed=2)
        out = model(inp)
        assert torch.isfinite(out.logits).all()
        loss(out, torch.ones(3, 2)).backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        model.zero_grad()


def test_history_changes_only_its_own_example():
    model = build().eval()
    inp = random_input(SCHEMA, 3, 6, lengths=[4, 2, 5], seed=3)
    base = model(inp).logits
    inp.seq_item_ids = inp.seq_item_ids.clone()
    inp.seq_item_ids[4:6] = (inp.seq_item_ids[4:6] + 1) % 100  # example 1's history
    moved = model(inp).logits
    assert torch.allclose(moved[0], base[0]) and torch.allclose(moved[2], base[2])
    assert not torch.allclose(moved[1], base[1])


@pytest.mark.parametrize("arch", ["gem", "dlrm"])
def test_torch_and_torchrec_backends_agree(arch):
    ref = build(arch=arch, embedding_backend="torchrec")
    plain = build(arch=arch, embedding_backend="torch")
    state = {k: v for k, v in ref.state_dict().items() if "embedding_bags" not in k}
    bags = ref.embeddings.tables.ebc.embedding_bags
    state["embeddings.tables.weight"] = torch.cat([bags[f"t_{name}"].weight for name in SCHEMA.feature_names])
    plain.load_state_dict(state)
    inp = random_input(SCHEMA, 5, 7, seed=4)
    torch.testing.assert_close(plain(inp).logits, ref(inp).logits)


def test_kjt_and_jagged_features_inputs_agree_and_key_order_does_not_matter():
    model = build()
    inp = random_input(SCHEMA, 4, 6, seed=5)
    want = model(inp).logits
    kjt_inp = random_input(SCHEMA, 4, 6, seed=5)
    kjt_inp.sparse_features = to_kjt(kjt_inp.sparse_features)
    kjt_inp.seq_item_features = to_kjt(kjt_inp.seq_item_features)
    torch.testing.assert_close(model(kjt_inp).logits, want)
    # The same features listed in another key order.
    names = list(reversed(SCHEMA.feature_names))
    shuffled = JaggedFeatures.from_dict({n: inp.sparse_features[n] for n in names})
    inp.sparse_features = shuffled
    torch.testing.assert_close(model(inp).logits, want)


def test_bad_inputs_are_named():
    model = build()
    inp = random_input(SCHEMA, 3, 4, seed=6)
    inp.dense_features = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="dense_features must be \\(3, 2\\)"):
        model(inp)
    inp = random_input(SCHEMA, 3, 4, seed=6)
    inp.sparse_features = JaggedFeatures.from_dict({"user_id": inp.sparse_features["user_id"]})
    with pytest.raises(ValueError, match="must be exactly the schema's"):
        model(inp)
    inp = random_input(SCHEMA, 3, 4, seed=6)
    with pytest.raises(ValueError, match="labels must have"):
        loss(model(inp), torch.zeros(3))
    with pytest.raises(ValueError, match="task_weights"):
        loss(model(inp), torch.zeros(3, 2), [1.0])


def test_loss_weights_tasks():
    out = ModelOutput(logits=torch.tensor([[0.0, 2.0]]), aux_loss=torch.tensor(0.5))
    labels = torch.tensor([[1.0, 0.0]])
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    want = 2 * bce(torch.tensor(0.0), torch.tensor(1.0)) + 0.5 * bce(torch.tensor(2.0), torch.tensor(0.0)) + 0.5
    torch.testing.assert_close(loss(out, labels, [2.0, 0.5]), want)


@pytest.mark.parametrize("arch", ["gem", "dlrm"])
def test_loss_goes_down_training_a_few_steps(arch):
    model = build(arch=arch, embedding_backend="torch", seq_attention="silu")
    inp = random_input(SCHEMA, 32, 8, seed=7)
    # Labels the model can learn: from the target item (both archs see it) and, for gem, the history length.
    item = inp.sparse_features["item_id"][0]
    labels = torch.stack([(item % 2 == 0).float(), (inp.seq_lengths() > 4).float()], dim=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        opt.zero_grad()
        value = loss(model(inp), labels)
        value.backward()
        opt.step()
        losses.append(value.item())
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("arch", ["gem", "dlrm"])
def test_same_seed_same_model_and_output(arch):
    inp = random_input(SCHEMA, 4, 5, seed=8)
    a, b, c = build(1, arch=arch), build(1, arch=arch), build(2, arch=arch)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert torch.equal(a(inp).logits, b(inp).logits)
    assert not torch.equal(a(inp).logits, c(inp).logits)


def test_recency_buckets_exact_then_log():
    from gemrec.model.gem import recency_bucket

    ranks = torch.tensor([0, 1, 15, 16, 31, 32, 64, 10_000])
    assert recency_bucket(ranks, 32).tolist() == [0, 1, 15, 16, 19, 20, 24, 31]


def reversed_rows(features):
    """The same JaggedFeatures with the row order reversed (per key)."""
    flipped = {}
    for key in features.keys():
        values, lengths = features[key]
        rows = list(torch.split(values, lengths.tolist()))[::-1]
        flipped[key] = (torch.cat(rows) if rows else values, lengths.flip(0))
    return JaggedFeatures.from_dict(flipped, stride=features.stride())


def test_the_model_sees_the_order_of_events():
    # Same tokens, same timestamps, reversed order: only the recency (and rotary) encodings can tell.
    inp = random_input(SCHEMA, 1, 0, lengths=[5], seed=9)
    inp.seq_timestamps = torch.full_like(inp.seq_timestamps, int(inp.timestamps[0]) - 100)
    flipped = random_input(SCHEMA, 1, 0, lengths=[5], seed=9)
    flipped.seq_timestamps = inp.seq_timestamps
    flipped.seq_item_ids, flipped.seq_actions = inp.seq_item_ids.flip(0), inp.seq_actions.flip(0)
    flipped.seq_item_features = reversed_rows(inp.seq_item_features)
    with_recency = build(seq_causal=False, rope="none").eval()
    without = build(seq_causal=False, rope="none", recency_buckets=0).eval()
    assert not torch.allclose(with_recency(flipped).logits, with_recency(inp).logits)
    torch.testing.assert_close(without(flipped).logits, without(inp).logits)


def test_target_aware_history_encoding():
    # With target_aware the history summaries depend on the target item; without, only on the history.
    def summaries(model, inp):
        captured = []
        handle = model.pma.register_forward_hook(lambda mod, args, out: captured.append(out))
        model(inp)
        handle.remove()
        return captured[0]

    inp = random_input(SCHEMA, 2, 4, lengths=[3, 4], seed=10)
    other = random_input(SCHEMA, 2, 4, lengths=[3, 4], seed=10)
    values, lengths = other.sparse_features["item_id"]
    features = {k: other.sparse_features[k] for k in other.sparse_features.keys()}
    features["item_id"] = ((values + 1) % 100, lengths)
    other.sparse_features = JaggedFeatures.from_dict(features)
    aware, blind = build(target_aware=True).eval(), build(target_aware=False).eval()
    assert not torch.allclose(summaries(aware, inp), summaries(aware, other))
    torch.testing.assert_close(summaries(blind, inp), summaries(blind, other))


def test_inconsistent_history_offsets_are_named():
    model = build()
    inp = random_input(SCHEMA, 3, 4, lengths=[2, 3, 1], seed=11)
    inp.seq_offsets = torch.tensor([0, 2, 5, 7])
    with pytest.raises(ValueError, match="seq_offsets must rise from 0 to the 6 history tokens"):
        model(inp)
    inp = random_input(SCHEMA, 3, 4, lengths=[2, 3, 1], seed=11)
    inp.max_seq_len = 2
    with pytest.raises(ValueError, match="max_seq_len 2 is below the longest history \\(3\\)"):
        model(inp)


def test_attention_backend_reaches_every_attention_layer():
    model = build(attention_backend="reference")
    backends = {m.backend for m in model.modules() if hasattr(m, "backend")}
    assert backends == {"reference"}
    with pytest.raises(ValueError, match="model.attention_backend = .flash.: must be one of .auto., .reference."):
        build(attention_backend="flash")


@pytest.mark.parametrize("backend", ["torchrec", "torch"])
def test_id_dropout_hides_ids_in_training_only(backend):
    model = build(embedding_backend=backend, user_id_dropout=0.5, item_id_dropout=0.3)
    tables = model.embeddings.tables
    assert tables.table("user_id").abs().sum() == 0 and tables.table("item_id").abs().sum() == 0  # start at zero
    assert tables.table("item_genres").abs().sum() > 0
    with torch.no_grad():
        tables.table("user_id").normal_()
        tables.table("item_id").normal_()
    inp = random_input(SCHEMA, 400, 1200, seed=3)
    columns = model.embeddings.features
    model.eval()
    example_emb, token_emb = model.embeddings(inp.sparse_features, inp.seq_item_ids, inp.seq_item_features)
    ids = [columns.index("user_id"), columns.index("item_id")]
    assert (example_emb[:, ids].abs().sum(-1) > 0).all() and (token_emb[:, 0].abs().sum(-1) > 0).all()  # eval
    model.train()
    hidden_example, hidden_token = model.embeddings(inp.sparse_features, inp.seq_item_ids, inp.seq_item_features)
    zero = hidden_example.abs().sum(-1) == 0
    assert abs(zero[:, columns.index("user_id")].float().mean() - 0.5) < 0.1
    assert abs(zero[:, columns.index("item_id")].float().mean() - 0.3) < 0.1
    genres = example_emb[:, columns.index("item_genres")].abs().sum(-1) > 0  # rows with genres are never hidden
    assert not zero[genres, columns.index("item_genres")].any()
    kept = ~zero[:, columns.index("user_id")]
    assert torch.equal(hidden_example[kept, columns.index("user_id")], example_emb[kept, columns.index("user_id")])
    token_zero = hidden_token.abs().sum(-1) == 0
    assert abs(token_zero[:, 0].float().mean() - 0.3) < 0.1
    assert torch.equal(hidden_token[:, 1], token_emb[:, 1])


def test_no_id_dropout_leaves_training_unchanged():
    model = build(seed=4)
    inp = random_input(SCHEMA, 8, 20, seed=5)
    model.train()
    first = model.embeddings(inp.sparse_features, inp.seq_item_ids, inp.seq_item_features)
    model.eval()
    second = model.embeddings(inp.sparse_features, inp.seq_item_ids, inp.seq_item_features)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_embeddings_compile_to_one_graph_in_training(dropout):
    """Whether ids are hidden is known when the model is built: no host sync, no graph break per step."""
    model = build(seed=4, embedding_backend="torch", user_id_dropout=dropout, item_id_dropout=dropout).train()
    inp = random_input(SCHEMA, 8, 20, seed=5)
    explained = torch._dynamo.explain(model.embeddings)(inp.sparse_features, inp.seq_item_ids, inp.seq_item_features)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_piecewise_linear_encoding_on_hand_computed_edges():
    # Feature 0: bins [0, 1), [1, 3); feature 1: the one bin [-1, 1). The first bin is open below, the last above.
    tokens = PiecewiseLinearTokens(((0.0, 1.0, 3.0), (-1.0, 1.0)), dim=3)
    dense = torch.tensor([[-1.0, -3.0], [0.5, 0.0], [2.0, 1.0], [5.0, 2.0]])
    expected = torch.tensor(
        [
            [[-1.0, 0.0], [-1.0, 0.0]],
            [[0.5, 0.0], [0.5, 0.0]],
            [[1.0, 0.5], [1.0, 0.0]],
            [[1.0, 2.0], [1.5, 0.0]],
        ]
    )
    torch.testing.assert_close(tokens.encode(dense), expected)
    with torch.no_grad():
        tokens.weight.copy_(torch.arange(12.0).view(2, 2, 3))
        tokens.bias.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0]]))
    out = tokens(dense)
    # Row 2, feature 0: 1 * [0, 1, 2] + 0.5 * [3, 4, 5] + [1, 0, 0]; feature 1: 1 * [6, 7, 8] + [0, 0, -1].
    torch.testing.assert_close(out[2], torch.tensor([[2.5, 3.0, 4.5], [6.0, 7.0, 7.0]]))


def test_ple_dense_encoding_gives_one_token_per_dense_feature():
    edges = {"hour_sin": [-1.0, 0.0, 1.0], "hour_cos": [-1.0, -0.5, 0.5, 1.0]}
    schema = FeatureSchema.from_manifest({**MANIFEST, "dense_bins": {"edges": edges}})
    assert schema.dense_bins == ((-1.0, 0.0, 1.0), (-1.0, -0.5, 0.5, 1.0))
    torch.manual_seed(0)
    linear = build_model(ModelConfig(**SMALL), schema)
    ple = build_model(ModelConfig(**SMALL, dense_encoding="ple"), schema)
    assert ple.feature_input.num_tokens == linear.feature_input.num_tokens + 1  # two dense tokens instead of one
    inp = random_input(schema, 4, 6, seed=1)
    out = ple(inp)
    assert out.logits.shape == (4, 2) and torch.isfinite(out.logits).all()
    with pytest.raises(ValueError, match="dense_encoding = 'ple' needs the dataset's quantile bins"):
        build_model(ModelConfig(**SMALL, dense_encoding="ple"), SCHEMA)


def test_cross_network_starts_as_a_rescaling_then_crosses_features():
    cross = CrossNetwork(dim=4, layers=2, rank=2)
    x0 = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    b1, b2 = (up.bias.detach() for up in cross.up)
    torch.testing.assert_close(cross(x0), x0 * (1 + b1 + b2))  # the up weights start at 0: x_l = x_0 (1 + b_1 + ...)
    with torch.no_grad():
        for down, up in zip(cross.down, cross.up):
            down.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))
            up.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
            up.bias.zero_()
    # Layer 1: u = (1, 0, -2, 0), x1 = x0 * u + x0 = (2, -2, -0.5, 3); layer 2: u = (2, 0, -2, 0), x2 = x0 * u + x1.
    torch.testing.assert_close(cross(x0), torch.tensor([[4.0, -2.0, -1.5, 3.0]]))


def test_head_cross_layers_start_as_the_plain_head_without_biases_and_train():
    inp = random_input(SCHEMA, 4, 6, seed=1)
    plain, crossed = build(seed=0), build(seed=0, head_cross_layers=2, head_cross_rank=4)
    crossed.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        for up in crossed.cross.up:
            up.bias.zero_()
    torch.testing.assert_close(crossed(inp).logits, plain(inp).logits)
    loss(crossed(inp), torch.ones(4, 2)).backward()
    assert all(up.weight.grad.abs().sum() > 0 for up in crossed.cross.up)


@pytest.mark.parametrize("arch", ["gem", "dlrm"])
def test_task_parents_make_love_a_conditional_of_like(arch):
    inp = random_input(SCHEMA, 6, 7, seed=3)
    plain, chained = build(seed=0, arch=arch), build(seed=0, arch=arch, task_parents={"love": "like"})
    chained.load_state_dict(plain.state_dict())
    raw = plain(inp).logits
    p = torch.sigmoid(chained(inp).logits)
    torch.testing.assert_close(p[:, 0], torch.sigmoid(raw[:, 0]))
    torch.testing.assert_close(p[:, 1], torch.sigmoid(raw[:, 0]) * torch.sigmoid(raw[:, 1]))
    assert (p[:, 1] <= p[:, 0]).all()
    loss(chained(inp), torch.tensor([[0.0, 0.0]] * 6)).backward()  # love's loss reaches like's tower too
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in chained.heads.towers[0].parameters())


def test_task_parents_saturated_logits_stay_finite():
    model = build(task_parents={"love": "like"})
    with torch.no_grad():
        for tower in model.heads.towers:
            tower[-1].bias.fill_(60.0)
    out = model(random_input(SCHEMA, 3, 4, seed=4))
    assert torch.isfinite(out.logits).all()
    loss(out, torch.ones(3, 2)).backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("parents", "message"),
    [
        ({"love": "click"}, "parent 'click' \\(love -> click\\) is not one of the dataset's labels \\(like, love\\)"),
        ({"watch": "like"}, "label 'watch'"),
        ({"love": "like", "like": "love"}, "task_parents has a cycle: love -> like, like -> love"),
    ],
)
def test_task_parents_refuse_unknown_labels_and_cycles(parents, message):
    with pytest.raises(ValueError, match=message):
        build(task_parents=parents)
