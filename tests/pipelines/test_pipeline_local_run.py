"""`gemrec pipeline run`: the whole system on this machine (kfp.local, real services, torchrun, MLflow)."""

import json
import re
import shutil
import socket
import subprocess

import pytest
from gemrec.cli import main
from gemrec.pipelines import steps, tracking

STEPS = ("ingest", "validate", "materialize", "train", "baselines", "evaluate", "register")


@pytest.fixture(scope="module")
def run(pipeline_run):
    result = pipeline_run["result"]
    assert result.returncode == 0, f"pipeline failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return pipeline_run


@pytest.mark.slow  # the whole pipeline runs once per session
def test_run_prints_progress_and_the_summary_table(run):
    out = run["result"].stdout
    for step in STEPS:
        assert f"[gemrec] step {step}: started" in out and f"[gemrec] step {step}: done" in out, step
    starts = [out.index(f"[gemrec] step {step}: started") for step in STEPS]
    assert starts == sorted(starts)  # one at a time, in this order (the baselines after GEM's train)
    assert "[gemrec] starting feature service on 127.0.0.1:" in out
    assert "[gemrec] training with torchrun --nproc_per_node 1" in out
    summary = run["summary"]
    for label in (
        "NE (eval, like)",
        "AUC (eval, like)",
        "QPS (train examples/s)",
        "MFU (end to end)",
        "MLflow run id",
        "MLflow UI",
        "gemrec-tiny v1 (new champion)",
    ):
        assert label in out, label
    for arm, ne in summary["baselines"].items():  # the baselines' eval NE beside GEM's, as the evaluate step logged it
        row = rf"NE \(eval, like\), {arm.replace('_', ' ')}\s*│\s*{ne:.4f}"
        assert re.search(row, out), row
    assert set(summary["baselines"]) == {"dlrm", "gbdt", "base_rate"}
    assert summary["run_id"] in out
    assert f"http://127.0.0.1:{run['ui_port']}" in out
    assert "Got executor_input" not in out  # the executor's JSON dump stays in pipeline.log
    assert "Got executor_input" in (run["run_dir"] / "pipeline.log").read_text()


@pytest.mark.slow  # the whole pipeline runs once per session
def test_outputs_are_marked_succeeded_and_no_process_is_left(run, orphans):
    run_dir = run["run_dir"]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "succeeded" and status["run_id"] == run["summary"]["run_id"]
    assert not (run_dir / "FAILED").exists()
    for log in ("feature-service.log", "data-service.log", "trainer.log"):
        assert (run_dir / "logs" / log).stat().st_size > 0, log
    assert orphans(str(run["work"])) == []


@pytest.mark.slow  # the whole pipeline runs once per session
def test_kfp_metrics_of_the_train_step(run):
    (train_output,) = run["run_dir"].glob("kfp/*/train/executor_output.json")
    artifacts = json.loads(train_output.read_text())["artifacts"]
    metrics = artifacts["metrics"]["artifacts"][0]["metadata"]
    for key in ("ne", "auc", "qps", "mfu"):
        assert isinstance(metrics[key], float), key
    assert 0.0 < metrics["ne"] < 1.5 and 0.0 < metrics["auc"] < 1.0 and metrics["qps"] > 0
    assert metrics["ne"] == pytest.approx(run["summary"]["metrics"]["ne"])
    model = artifacts["model"]["artifacts"][0]["metadata"]
    assert model["mlflow_run_id"] == run["summary"]["run_id"]


@pytest.mark.slow  # the whole pipeline runs once per session
def test_mlflow_run_is_named_tagged_and_registered_as_champion(run):
    client = tracking.client(run["store"])
    summary = run["summary"]
    mlflow_run = client.get_run(summary["run_id"])
    commit = mlflow_run.data.tags["git_commit"]
    assert re.fullmatch(r"[0-9a-f]{40}", commit), commit
    assert mlflow_run.info.run_name == f"tiny@{commit[:8]}"
    assert client.get_experiment(mlflow_run.info.experiment_id).name == "gemrec-train"
    tags = mlflow_run.data.tags
    (dataset_dir,) = run["run_dir"].glob("kfp/*/ingest/dataset")
    manifest = json.loads((dataset_dir / "manifest.json").read_text())
    assert tags["dataset_checksum"] == manifest["dataset_checksum"]
    assert tags["device"]
    assert tags["gemrec.champion_decision"] == "promoted" and "no champion yet" in tags["gemrec.champion_reason"]
    for key in ("ne", "qps", "mfu"):
        assert key in mlflow_run.data.metrics, key
    champion = tracking.champion(run["store"], "gemrec-tiny")
    assert champion.run_id == summary["run_id"] and champion.ne == pytest.approx(summary["metrics"]["ne"], rel=1e-5)
    model = client.get_registered_model("gemrec-tiny")
    assert "Champion: version 1" in model.description and "NE" in model.description


@pytest.mark.slow  # the whole pipeline runs once per session
def test_gem_run_holds_the_baselines_trained_in_the_same_pipeline_run(run):
    """The evaluate step logs DLRM and GBDT (trained by the baselines step on the same dataset) into GEM's run;
    the champion decision stays on GEM's NE."""
    client = tracking.client(run["store"])
    summary = run["summary"]
    mlflow_run = client.get_run(summary["run_id"])
    metrics = mlflow_run.data.metrics
    (baselines_output,) = run["run_dir"].glob("kfp/*/baselines/executor_output.json")
    kfp_metrics = json.loads(baselines_output.read_text())["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    for arm in ("dlrm", "gbdt"):
        for label in ("like", "love"):
            for key in ("ne", "auc", "calibration"):
                assert metrics[f"baseline/{arm}/{key}_{label}"] == pytest.approx(kfp_metrics[f"{arm}_{key}_{label}"])
        assert 0.0 < metrics[f"baseline/{arm}/ne_like"] < 1.5
        assert summary["baselines"][arm] == pytest.approx(metrics[f"baseline/{arm}/ne_like"])
    assert metrics["baseline/base_rate/ne_like"] > 0.99  # predicting the training rate on the eval period
    assert mlflow_run.data.tags["gemrec.baselines"].startswith("eval NE like: gem ")
    assert "plots/baselines.png" in {a.path for a in client.list_artifacts(summary["run_id"], "plots")}
    # The train step's own trainer validated on the valid split (tiny: eval_every) and logged it.
    assert "valid/ne_like" in metrics and "final/best_step" in metrics
    assert tracking.champion(run["store"], "gemrec-tiny").ne == pytest.approx(summary["metrics"]["ne"], rel=1e-5)


@pytest.mark.slow  # the whole pipeline runs once per session
def test_validate_names_every_problem(run, tmp_path):
    (dataset_dir,) = run["run_dir"].glob("kfp/*/ingest/dataset")
    broken = tmp_path / "broken"
    shutil.copytree(dataset_dir, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["splits"]["eval"]["num_examples"] += 5
    manifest["label_rates"]["train"]["like"] = 0.0
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(steps.StepError) as err:
        steps.validate(str(broken))
    assert "eval.parquet has" in str(err.value) and "but the manifest says" in str(err.value)
    assert "label 'like' has base rate 0.0 in train" in str(err.value)
    (broken / "events.parquet").unlink()
    with pytest.raises(steps.StepError, match="dataset schema: .*missing events.parquet"):
        steps.validate(str(broken))


@pytest.mark.slow  # the whole pipeline runs once per session
def test_failed_train_step_stops_services_and_marks_outputs(run, tmp_path, gemrec_script, orphans):
    """A trainer that fails after the services started: clear message, exit 2, nothing left running."""
    (dataset_dir,) = run["run_dir"].glob("kfp/*/ingest/dataset")
    recipe = tmp_path / "broken.toml"
    recipe.write_text("[train]\ntask_weights = {nope = 2.0}\n")  # a label only the trainer can check
    result = subprocess.run(
        [
            gemrec_script,
            "pipeline",
            "run",
            "--recipe",
            str(recipe),
            "--data",
            str(dataset_dir),
            "--runs",
            str(tmp_path / "runs"),
            "--tracking-uri",
            f"sqlite:///{tmp_path}/mlruns.db",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gemrec pipeline: error: step train failed: the trainer exited with code"), last
    assert "train.task_weights names unknown label(s) ['nope']" in last and "marked failed" in last
    (run_dir,) = (tmp_path / "runs").iterdir()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == "train"
    assert (run_dir / "FAILED").exists() and not (run_dir / "summary.json").exists()
    assert "data service" in (run_dir / "pipeline.log").read_text()
    assert orphans(str(tmp_path)) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--recipe", "no-such-recipe"], "unknown recipe 'no-such-recipe': built-in recipes are"),
        (
            ["--recipe", "tiny", "--data", "/nonexistent/ml-latest-small"],
            "data path /nonexistent/ml-latest-small does not exist",
        ),
        (["--recipe", "tiny", "--nproc", "0"], "--nproc must be at least 1"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(args, message, movielens_raw, tmp_path, capsys):
    if "--data" not in args:
        args = [*args, "--data", str(movielens_raw)]
    code = main(["pipeline", "run", *args, "--runs", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "runs").exists()


def test_a_port_in_use_is_refused(movielens_raw, tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        code = main(
            [
                "pipeline",
                "run",
                "--recipe",
                "tiny",
                "--data",
                str(movielens_raw),
                "--feature-port",
                str(port),
                "--runs",
                str(tmp_path / "runs"),
            ]
        )
    err = capsys.readouterr().err
    assert code == 2 and f"port {port} on 127.0.0.1 is already in use (wanted by the feature service)" in err


@pytest.mark.slow  # the whole pipeline runs once per session
def test_materialize_into_a_real_redis(run, tmp_path):
    """The materialize step with the Redis store writes what the feature service reads."""
    import time

    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.skip("redis-server not installed (make system-deps installs it)")
    import redis

    (dataset_dir,) = run["run_dir"].glob("kfp/*/ingest/dataset")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [
            redis_server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        info = steps.materialize(str(dataset_dir), "redis", f"redis://127.0.0.1:{port}/0")
        assert info["store"] == "redis" and info["fields"] > 0
        assert client.exists(f"{info['prefix']}:schema")
        assert info["entities"]["item"]["ids"] == json.loads((dataset_dir / "manifest.json").read_text())["num_items"]
    finally:
        server.terminate()
        server.wait(timeout=10)
    with pytest.raises(steps.StepError, match="cannot materialize features into Redis at redis://127.0.0.1:"):
        steps.materialize(str(dataset_dir), "redis", f"redis://127.0.0.1:{port}/0")


def test_ingest_names_what_is_wrong_with_the_data(tmp_path):
    with pytest.raises(steps.StepError, match="data path .*/missing does not exist"):
        steps.ingest(str(tmp_path / "missing"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(steps.StepError, match="neither a prepared dataset .* nor raw MovieLens"):
        steps.ingest(str(tmp_path / "empty"), str(tmp_path / "out"))


def test_publish_swaps_the_served_dataset_whole(tmp_path):
    (tmp_path / "served").mkdir()
    for version in ("v1", "v2"):
        source = tmp_path / version
        source.mkdir()
        (source / "manifest.json").write_text(json.dumps({"version": version}))
        steps.publish(source, tmp_path / "served" / "movielens")
        assert json.loads((tmp_path / "served" / "movielens" / "manifest.json").read_text()) == {"version": version}
    assert sorted(p.name for p in (tmp_path / "served").iterdir()) == ["movielens"]


@pytest.mark.slow  # the whole pipeline runs once per session
def test_cluster_mode_reads_the_same_numbers_back_from_the_mlflow_run(run):
    """The TrainJob path has no metrics file: its numbers come from the run's `final/*` metrics."""
    summary = run["summary"]
    logged = tracking.client(run["store"]).get_run(summary["run_id"]).data.metrics
    numbers = steps.headline(tracking.metrics_from_run(logged), ["like", "love"])
    for key in ("ne", "auc", "qps", "mfu", "ne_love"):
        assert numbers[key] == pytest.approx(summary["metrics"][key], rel=1e-6), key
