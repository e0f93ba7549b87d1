import re

import pytest
import torch
from gemrec.model import FeatureSchema, JaggedFeatures, ModelConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

MANIFEST = {
    "labels": ["like", "love"],
    "actions": ["rating", "like", "love"],
    "sparse_features": [
        {"name": "user_id", "source": "user", "num_embeddings": 610, "multi_valued": False},
        {"name": "item_id", "source": "item", "num_embeddings": 9742, "multi_valued": False},
        {"name": "item_genres", "source": "item", "num_embeddings": 21, "multi_valued": True},
    ],
    "seq_item_features": ["item_genres"],
    "dense_features": ["hour_of_day_sin"],
}


def test_jagged_features_reads_like_a_kjt():
    features = {
        "a": (torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1])),
        "b": (torch.tensor([7, 8]), torch.tensor([1, 1, 0])),
    }
    jf = JaggedFeatures.from_dict(features)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([1, 2, 3, 7, 8]), lengths=torch.tensor([2, 0, 1, 1, 1, 0])
    )
    assert jf.keys() == kjt.keys() and jf.stride() == kjt.stride() == 3
    assert torch.equal(jf.values(), kjt.values())
    assert torch.equal(jf.lengths(), kjt.lengths())
    assert torch.equal(jf.offsets(), kjt.offsets())
    values, lengths = jf["b"]
    assert values.tolist() == [7, 8] and lengths.tolist() == [1, 1, 0]
    assert torch.equal(JaggedFeatures.from_kjt(kjt).values(), jf.values())
    assert jf.to("cpu").keys() == ["a", "b"]
    with pytest.raises(KeyError, match="no key 'c'"):
        jf["c"]


def test_jagged_features_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match="do not split"):
        JaggedFeatures(["a", "b"], torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="duplicate"):
        JaggedFeatures(["a", "a"], torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long))


def test_schema_from_manifest():
    schema = FeatureSchema.from_manifest(MANIFEST)
    assert schema.feature_names == ["user_id", "item_id", "item_genres"]
    assert schema.num_tasks == 2 and schema.num_actions == 3 and schema.num_dense == 1
    assert schema.feature("item_genres").multi_valued


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sparse_features": MANIFEST["sparse_features"][1:]}, "user_id"),
        ({"seq_item_features": ["user_id"]}, "source 'item'"),
        ({"seq_item_features": ["nope"]}, "unknown sparse feature 'nope'"),
        ({"labels": []}, "at least one label"),
        ({"sparse_features": [{"name": "user_id"}]}, "malformed"),
    ],
)
def test_schema_errors_name_the_problem(change, message):
    with pytest.raises(ValueError, match=message):
        FeatureSchema.from_manifest({**MANIFEST, **change})


def test_manifest_problems_lists_every_problem_at_once():
    assert FeatureSchema.manifest_problems(MANIFEST) == []
    broken = {
        **MANIFEST,
        "sparse_features": [{**f, "num_embeddings": 0} for f in MANIFEST["sparse_features"][1:]],
        "labels": [],
    }
    problems = FeatureSchema.manifest_problems(broken)
    assert any("'user_id' is required" in p for p in problems)
    assert any("'item_id' needs num_embeddings >= 1, got 0" in p for p in problems)
    assert "at least one label is required" in problems
    with pytest.raises(ValueError, match="feature schema: .*user_id.*; .*num_embeddings.*; at least one label"):
        FeatureSchema.from_manifest(broken)
    assert FeatureSchema.manifest_problems({"labels": ["x"]}) == ["manifest lacks ['sparse_features']"]


def test_config_validation():
    assert ModelConfig().arch == "gem"
    with pytest.raises(ValueError, match="model.arch = 'bert': must be one of 'gem', 'dlrm'"):
        ModelConfig(arch="bert")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model.d_model = 30: must be divisible by num_heads 4"):
        ModelConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match=r"unknown setting model.nope = 1; \[model\] takes"):
        ModelConfig.from_dict({"nope": 1})
    assert ModelConfig.from_dict({"seq_layers": 3}).seq_layers == 3
    assert ModelConfig.from_dict({"dlrm_top_mlp": [8, 4]}).dlrm_top_mlp == (8, 4)


@pytest.mark.parametrize(
    "edges, message",
    [
        ({"hour_of_day_sin": [0.0, 1.0], "extra": [0.0, 1.0]}, None),  # edges of other features are ignored
        ({}, None),  # no bins: the linear dense encoding only
        ({"other": [0.0, 1.0]}, "dense_bins.edges must give a list of numbers for every dense feature"),
        ({"hour_of_day_sin": [0.0, 0.0, 1.0]}, r"dense_bins of 'hour_of_day_sin' must be at least 2 finite rising"),
        ({"hour_of_day_sin": [1.0]}, "at least 2 finite rising edges, got \\[1.0\\]"),
        ({"hour_of_day_sin": [0.0, float("inf")]}, "finite rising edges"),
        ({"hour_of_day_sin": ["a", 1.0]}, "list of numbers"),
    ],
)
def test_manifest_dense_bins_are_checked(edges, message):
    manifest = {**MANIFEST, "dense_bins": {"edges": edges}}
    if message is None:
        assert FeatureSchema.manifest_problems(manifest) == []
        assert len(FeatureSchema.from_manifest(manifest).dense_bins) == (1 if edges else 0)
        return
    assert any(re.search(message, p) for p in FeatureSchema.manifest_problems(manifest))
    with pytest.raises(ValueError, match=message):
        FeatureSchema.from_manifest(manifest)


def test_schema_dense_bins_must_match_the_dense_features():
    with pytest.raises(ValueError, match="dense_bins has 2 edge lists for 1 dense features"):
        FeatureSchema(
            sparse_features=FeatureSchema.from_manifest(MANIFEST).sparse_features,
            dense_features=("a",),
            dense_bins=((0.0, 1.0), (0.0, 1.0)),
        )
