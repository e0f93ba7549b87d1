"""`gemrec bench seqrec` end to end on a tiny made-up S3-Rec-format dataset, both protocols, with MLflow."""

import json

import pytest
from gemrec.cli import main
from gemrec.components.data_service.s3rec import prepare_s3rec

TINY = [
    "seqrec.epochs=6",
    "seqrec.patience=6",
    "seqrec.ranker_eval_every=1.0",
    "seqrec.ranker_patience=6",
    "seqrec.batch_size=32",
    "seqrec.eval_batch_size=64",
    "seqrec.ranker_negatives=3",
    "model.d_model=32",
    "model.embedding_dim=32",
    "model.head_hidden=32",
    "sasrec.d_model=32",
    "optim.dense_lr=0.005",
]


@pytest.fixture(scope="module")
def toy_dataset(s3rec_toy, tmp_path_factory):
    raw, _ = s3rec_toy(users=120, seed=5)
    return prepare_s3rec(tmp_path_factory.mktemp("bench") / "data", raw, "Toy", progress=False)


@pytest.mark.parametrize("protocol", ["full", "sampled99"])
def test_bench_seqrec_end_to_end(toy_dataset, tmp_path, capsys, protocol):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "metrics.json"
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    argv = ["bench", "seqrec", "--dataset", str(toy_dataset), "--protocol", protocol, "--metrics-out", str(out)]
    argv += ["--tracking-uri", uri, "--experiment", "seqrec-test"]
    code = main(argv + [a for item in TINY for a in ("--set", item)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    results = json.loads(out.read_text())
    assert results["protocol"] == protocol and results["arm"] == "gem"
    assert isinstance(results["hr@10"], float) and isinstance(results["ndcg@10"], float)
    assert set(results["arms"]) == {"gem", "sasrec"}
    for arm in results["arms"].values():
        test = arm["test"]
        assert test["users"] == 120 and 0.0 <= test["ndcg@10"] <= test["hr@10"] <= test["hr@20"] <= 1.0
        assert arm["history"] and arm["best_epoch"] > 0
    # Item i is always followed by item i + 1: after a few epochs GEM finds the next item far above chance
    # (10 of 100 candidates, or 10 of ~140 unseen items).
    assert results["hr@10"] > 0.5, results["arms"]["gem"]["history"]
    assert "| gem (ours) |" in printed.out and "| sasrec (ours) |" in printed.out
    client = MlflowClient(uri)
    run = client.get_run(results["mlflow"]["run_id"])
    assert run.data.params["protocol"] == protocol and "gem/test_ndcg_at_10" in run.data.metrics
    assert "sasrec/valid_hr_at_10" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert "plots/seqrec_metrics.png" in artifacts


def test_bench_seqrec_refuses_bad_input(toy_dataset, tmp_path, capsys):
    code = main(["bench", "seqrec", "--dataset", str(toy_dataset), "--protocol", "full", "--arms", "gem,bert4rec"])
    assert code == 2 and "--arms takes distinct names among gem, sasrec" in capsys.readouterr().err
    code = main(["bench", "seqrec", "--dataset", str(tmp_path / "nope"), "--protocol", "full"])
    assert code == 2 and "no such directory" in capsys.readouterr().err
    code = main(
        ["bench", "seqrec", "--dataset", str(toy_dataset), "--protocol", "full", "--set", "seqrec.gem_loss=hinge"]
    )
    assert code == 2 and "seqrec.gem_loss" in capsys.readouterr().err


def test_ranker_next_item_loss_is_added_to_the_pointwise_loss(toy_dataset):
    import numpy as np
    import torch
    import torch.nn.functional as F
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.seqrec import build_arm
    from gemrec.components.trainer.seqrec_data import SeqRecData
    from gemrec.model.gem import loss

    for ranker_loss in ("bce", "softmax"):
        config = load_recipe(
            "s3rec", [*TINY, "seqrec.ranker_next_item_weight=0.5", f"seqrec.ranker_loss={ranker_loss}"]
        )
        data = SeqRecData(Dataset.open(toy_dataset), config.seqrec.max_seq_len)
        arm = build_arm("gem", "sampled99", config, data, torch.device("cpu"))
        arm.model.eval()  # no dropout: every term below from the same function
        batch = next(arm.batches(np.random.default_rng(0)))
        inp, labels, objective = arm.step_args(batch, np.random.default_rng(1))
        history, targets = batch[2]
        assert labels is None and len(targets) == len(history.seq_item_ids) > 0
        with torch.no_grad():
            out = arm.model(inp)
            if ranker_loss == "bce":
                pointwise = loss(out, batch[1])
            else:
                pointwise = F.cross_entropy(out.logits.view(-1, 4), torch.zeros(len(out.logits) // 4, dtype=torch.long))
            catalog = arm.model.item_vectors(*data.catalog())
            next_item = F.cross_entropy(arm.model.sequence_vectors(history) @ catalog.t(), targets)
            assert torch.allclose(objective(arm.model, inp), pointwise + 0.5 * next_item)
    off_config = load_recipe("s3rec", [*TINY, "seqrec.ranker_next_item_weight=0"])
    off = build_arm("gem", "sampled99", off_config, data, torch.device("cpu"))
    assert next(off.batches(np.random.default_rng(0)))[2] is None


def test_bench_seqrec_ranker_with_next_item_loss_learns(toy_dataset, tmp_path):
    out = tmp_path / "metrics.json"
    argv = ["bench", "seqrec", "--dataset", str(toy_dataset), "--protocol", "sampled99", "--arms", "gem"]
    argv += ["--no-tracking", "--metrics-out", str(out)]
    settings = [*TINY, "seqrec.ranker_next_item_weight=1.0"]
    assert main(argv + [a for item in settings for a in ("--set", item)]) == 0
    results = json.loads(out.read_text())
    assert results["hr@10"] > 0.5, results["arms"]["gem"]["history"]


def test_ranker_scores_mix_in_the_retrieval_head(toy_dataset):
    import numpy as np
    import torch
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.seqrec import build_arm
    from gemrec.components.trainer.seqrec_data import SeqRecData

    config = load_recipe("s3rec", [*TINY, "seqrec.ranker_retrieval_weights=[0, 0.5, 2]"])
    data = SeqRecData(Dataset.open(toy_dataset), config.seqrec.max_seq_len)
    arm = build_arm("gem", "sampled99", config, data, torch.device("cpu"))
    arm.model.eval()
    targets = data.splits["test"].take(np.arange(8))
    candidates = np.random.default_rng(0).integers(data.num_items, size=(8, 5))
    mixed = arm.mixed_scores(targets, candidates, (0.0, 0.5, 2.0))
    with torch.no_grad():
        logits = arm.model(arm._input(targets, candidates)).logits[:, 0].view(8, 5)
        inp = data.model_input(targets.history)
        last = arm.model.sequence_vectors(inp)[inp.seq_offsets[1:] - 1]
        retrieval = (arm.model.item_vectors(*data.catalog())[torch.from_numpy(candidates)] * last[:, None]).sum(-1)
    assert torch.allclose(mixed[0], logits)
    assert torch.allclose(mixed[2], logits + 2.0 * retrieval, atol=1e-5)
    assert not torch.allclose(mixed[1], mixed[0])
    arm.mix = 0.5
    assert torch.equal(arm.scores(targets, candidates), mixed[1])
    with pytest.raises(Exception, match="seqrec.ranker_retrieval_weights"):
        load_recipe("s3rec", ["seqrec.ranker_retrieval_weights=[0.5, -1]"])


def test_bench_seqrec_ranker_chooses_its_retrieval_weight_on_validation_with_averaged_weights(toy_dataset, tmp_path):
    out = tmp_path / "metrics.json"
    argv = ["bench", "seqrec", "--dataset", str(toy_dataset), "--protocol", "sampled99", "--arms", "gem"]
    argv += ["--no-tracking", "--metrics-out", str(out)]
    settings = [
        *TINY,
        "seqrec.epochs=2",
        "seqrec.ranker_next_item_weight=1.0",
        "seqrec.ranker_retrieval_weights=[0, 1]",
        "seqrec.ranker_weight_average=0.9",
    ]
    assert main(argv + [a for item in settings for a in ("--set", item)]) == 0
    gem = json.loads(out.read_text())["arms"]["gem"]
    best = gem["valid_best"]
    assert gem["retrieval_weight"] == best["retrieval_weight"] in (0.0, 1.0)
    assert all(h["retrieval_weight"] in (0.0, 1.0) for h in gem["history"])
