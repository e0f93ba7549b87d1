SCRIPT = """
    import torch

    from gemrec.model import FeatureSchema, ModelConfig, build_model, train_step
    from gemrec.model.synthetic import random_input

    schema = FeatureSchema.from_manifest({
        "labels": ["like"], "actions": ["like"], "seq_item_features": ["genres"], "dense_features": [],
        "sparse_features": [
            {"name": "user_id", "num_embeddings": 10}, {"name": "item_id", "source": "item", "num_embeddings": 20},
            {"name": "genres", "source": "item", "num_embeddings": 5, "multi_valued": True},
        ],
    })
    for arch in ("gem", "dlrm"):
        model = build_model(ModelConfig(arch=arch, embedding_backend="torch", d_model=16, embedding_dim=8), schema)
        out = train_step(model, random_input(schema, 3, 4), torch.ones(3, 1)).output
        assert torch.isfinite(out.logits).all()
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.optim import Optimizers, apply_sparse_optimizer

    model = build_model(ModelConfig(embedding_backend="torch", d_model=16, embedding_dim=8), schema)
    optim_config = load_recipe("tiny").optim
    assert apply_sparse_optimizer(model, optim_config).startswith("gemrec RowWiseAdagrad")
    optimizers = Optimizers(model, optim_config, total_steps=2)
    table = next(iter(optimizers.sparse_params.values()))
    before = table.detach().clone()
    train_step(model, random_input(schema, 3, 4), torch.ones(3, 1), optimizer_step=optimizers.clip_and_step)
    changed = (table.detach() != before).any(1)
    assert 0 < int(changed.sum()) < table.shape[0], "the in-backward row-wise Adagrad left the table as it was"
    try:
        build_model(ModelConfig(embedding_backend="torchrec"), schema)
    except ImportError as err:
        assert "embedding_backend='torch'" in str(err), err
    else:
        raise AssertionError("the torchrec backend built without torchrec")
"""


def test_torch_backend_runs_without_torchrec(run_without_torchrec):
    run_without_torchrec(SCRIPT, timeout=120)
