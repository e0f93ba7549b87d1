"""`gemrec bench import`: results written without MLflow (the GPU box) logged into MLflow afterwards."""

import json

import pytest
from gemrec.cli import main
from gemrec.components.data_service.s3rec import prepare_s3rec
from gemrec.components.trainer.gpu_bench import run as gpu_bench

TINY_SEQREC = ["seqrec.epochs=2", "seqrec.valid_users=0", "model.d_model=16", "model.embedding_dim=16"]


@pytest.fixture(scope="module")
def results(s3rec_toy, tmp_path_factory):
    """A seqrec result and a gpu_bench.json, both written with tracking off, as on the GPU machine."""
    root = tmp_path_factory.mktemp("import")
    raw, _ = s3rec_toy(users=40, seed=3)
    dataset = prepare_s3rec(root / "data", raw, "Toy", progress=False)
    seqrec = root / "seqrec.json"
    argv = ["bench", "seqrec", "--dataset", str(dataset), "--protocol", "full", "--arms", "sasrec"]
    argv += ["--no-tracking", "--metrics-out", str(seqrec), "--device", "cpu"]
    assert main(argv + [a for item in TINY_SEQREC for a in ("--set", item)]) == 0
    small = ["bench.steps=2", "bench.warmup_steps=1", "data.batch_size=8", "bench.num_users=50", "bench.num_items=50"]
    gpu_bench(
        ["--recipe", "tiny", "--device", "cpu", "--out", str(root / "bench")] + [a for s in small for a in ("--set", s)]
    )
    return seqrec, root / "bench" / "gpu_bench.json"


def test_import_logs_metrics_and_plots_of_both_kinds(results, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    seqrec, bench = results
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    code = main(["bench", "import", str(seqrec), str(bench), "--tracking-uri", uri, "--experiment", "imported"])
    out = capsys.readouterr().out
    assert code == 0 and "seqrec result -> MLflow run" in out and "train result -> MLflow run" in out
    client = MlflowClient(uri)
    runs = {
        r.data.tags["kind"]: r for r in client.search_runs([client.get_experiment_by_name("imported").experiment_id])
    }
    seqrec_run, bench_run = runs["seqrec"], runs["train"]
    saved = json.loads(seqrec.read_text())
    assert seqrec_run.data.metrics["sasrec/test_ndcg_at_10"] == pytest.approx(
        saved["arms"]["sasrec"]["test"]["ndcg@10"]
    )
    history = client.get_metric_history(seqrec_run.info.run_id, "sasrec/valid_hr_at_10")
    assert len(history) == len(saved["arms"]["sasrec"]["history"])
    assert seqrec_run.data.tags["git_commit"] == saved["git_commit"]
    assert "plots/seqrec_metrics.png" in {a.path for a in client.list_artifacts(seqrec_run.info.run_id, "plots")}
    bench_saved = json.loads(bench.read_text())
    assert bench_run.data.metrics["mfu_e2e"] == pytest.approx(bench_saved["mfu_e2e"])
    assert len(client.get_metric_history(bench_run.info.run_id, "train_loss")) == len(bench_saved["losses"])
    assert "plots/layer_mfu.png" in {a.path for a in client.list_artifacts(bench_run.info.run_id, "plots")}


def test_import_refuses_bad_files_before_logging_anything(results, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    seqrec, _ = results
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"ne": 0.7}))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for path, message in [
        (other, "not a result of gemrec bench seqrec"),
        (broken, "not a JSON results file"),
        (tmp_path / "missing.json", "no such file"),
    ]:
        code = main(["bench", "import", str(seqrec), str(path), "--tracking-uri", uri, "--experiment", "bad"])
        err = capsys.readouterr().err
        assert code == 2 and str(path) in err and message in err, err
    assert MlflowClient(uri).get_experiment_by_name("bad") is None
