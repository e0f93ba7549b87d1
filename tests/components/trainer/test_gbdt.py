"""The gbdt arm end to end: `gemrec train --model gbdt` on a small dataset, stopped on the valid split, scored
on eval like the neural arms, logged to MLflow; and `gemrec bench quality` with every arm."""

import json

from gemrec.cli import main as gemrec_main


def test_gbdt_trains_on_the_dense_features_and_beats_the_base_rate(synth_dataset, tmp_path):
    out = tmp_path / "gbdt.json"
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    args = ["train", "--dataset", str(synth_dataset), "--recipe", "tiny", "--model", "gbdt"]
    assert gemrec_main([*args, "--tracking-uri", uri, "--metrics-out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["arch"] == "gbdt" and summary["tasks"] == ["click", "convert"]
    assert 1 <= summary["iterations"]["click"] <= 30  # the recipe's gbdt_max_iter
    assert summary["ne"]["click"] < 1.0 and summary["auc"]["click"] > 0.5
    assert summary["ne"]["click"] < summary["ne_train_base_rate"]["click"]

    import mlflow

    mlflow.set_tracking_uri(uri)
    run = mlflow.get_run(summary["mlflow"]["run_id"])
    assert run.data.tags["arch"] == "gbdt" and run.data.metrics["final/ne_click"] == summary["ne"]["click"]


def test_gbdt_refuses_the_data_service(capsys):
    assert gemrec_main(["train", "--data-addr", "127.0.0.1:1", "--recipe", "tiny", "--model", "gbdt"]) == 2
    assert "--model gbdt reads a dataset directory" in capsys.readouterr().err


def test_bench_quality_runs_every_arm_and_logs_the_comparison(synth_dataset, tmp_path):
    out = tmp_path / "quality.json"
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    args = ["bench", "quality", "--dataset", str(synth_dataset), "--recipe", "tiny", "--tracking-uri", uri]
    assert gemrec_main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert sorted(report["arms"]) == ["dlrm", "gbdt", "gem"]
    assert all(line in report["table"] for line in ("| gem |", "| dlrm |", "| gbdt |", "| base rate (train) |"))

    import mlflow

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="attributes.run_name = 'quality-tiny'")
    assert len(runs) == 1
    artifacts = [a.path for a in mlflow.MlflowClient().list_artifacts(runs.run_id[0], "plots")]
    assert artifacts == ["plots/quality_comparison.png"]
