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
