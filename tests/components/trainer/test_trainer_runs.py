"""Real training runs of the `tiny` recipe on prepared MovieLens: MLflow, metrics JSON, SIGKILL + resume,
the NaN guard, torchrun with two ranks, CLI errors."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gemrec.cli import CLIError
from gemrec.cli import main as gemrec_main
from gemrec.components.common.ports import free_port
from gemrec.components.trainer.checkpoint import CheckpointManager
from gemrec.components.trainer.config import load_recipe
from gemrec.components.trainer.run import run_training

# The installed console script (not `python -m gemrec.cli`, which would load cli.py twice).
GEMREC = str(Path(sys.executable).parent / "gemrec")
STEPS = 40  # tiny recipe, checkpoint every 5 steps


def _env(tracking_uri: str) -> dict:
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri, "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    return env


def _train_cmd(dataset: Path, run_dir: Path, metrics: Path, *extra: str) -> list[str]:
    return [
        GEMREC,
        "train",
        "--dataset",
        str(dataset),
        "--recipe",
        "tiny",
        "--run-dir",
        str(run_dir),
        "--metrics-out",
        str(metrics),
        "--no-progress",
        "--no-log-model",
        "--set",
        f"train.steps={STEPS}",
        *extra,
    ]


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlruns.db'}"


def test_train_logs_everything_to_mlflow_and_metrics_json(movielens_dataset, tmp_path, caplog):
    import mlflow

    caplog.set_level("INFO", logger="gemrec")
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    metrics_out = tmp_path / "metrics.json"
    config = load_recipe("tiny")
    summary = run_training(
        config,
        dataset=movielens_dataset,
        data_addr=None,
        run_dir=tmp_path / "run",
        tracking_uri=uri,
        experiment="trainer-test",
        metrics_out=metrics_out,
        resume=False,
        progress=False,
    )
    written = json.loads(metrics_out.read_text())
    assert written["tasks"] == ["like", "love"]
    for task in written["tasks"]:
        assert 0.3 < written["ne"][task] < 1.5 and 0.0 <= written["auc"][task] <= 1.0
    assert written["qps"] > 0 and written["tokens_per_s"] > 0
    # Local MFU is relative to a matmul ceiling measured at start: positive, not bounded on a busy machine.
    assert 0 < written["mfu"]["e2e"] < 1 and written["mfu"]["local"] > 0
    assert written["mfu"]["scaling_ratio"] == pytest.approx(written["mfu"]["e2e"] / written["mfu"]["local"])
    assert set(written["mfu"]["layers"]) >= {"seq_tower.0", "pma", "interaction.0", "heads"}
    assert written["steps"] == config.train.steps == summary["steps"]

    client = mlflow.MlflowClient(uri)
    run = client.get_run(written["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.dense_lr"] == str(config.optim.dense_lr)
    assert run.data.params["model.arch"] == "gem" and run.data.params["train.steps"] == str(config.train.steps)
    assert run.data.tags["dataset_checksum"] == written["dataset"]["checksum"]
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", run.data.tags["git_commit"]) and run.data.tags["device"]
    for key in (
        "train/loss",
        "train/ne_like",
        "train/qps",
        "train/mfu",
        "eval/ne_like",
        "eval/auc_love",
        "eval/calibration_like",
        "final/mfu_local",
        "final/scaling_ratio",
    ):
        assert key in run.data.metrics, key
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(10, config.train.steps + 1, 10))
    # without a progress bar each window is one log line
    assert [int(s) for s in re.findall(r"step (\d+): loss [\d.]+, \d+ QPS, MFU", caplog.text)] == list(
        range(10, config.train.steps + 1, 10)
    )
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert artifacts == {"plots/loss_ne_curves.png", "plots/layer_mfu.png", "plots/seq_length_hist.png"}
    assert client.list_artifacts(run.info.run_id, "config")[0].path == "config/config.json"
    model_dir = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="model", tracking_uri=uri, dst_path=str(tmp_path / "model")
    )
    assert (Path(model_dir) / "MLmodel").exists()


def test_sigkill_then_resume_matches_uninterrupted_run(movielens_dataset, tmp_path, tracking_uri):
    env = _env(tracking_uri)
    full = subprocess.run(
        _train_cmd(movielens_dataset, tmp_path / "full", tmp_path / "full.json"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert full.returncode == 0, full.stderr[-3000:]

    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(movielens_dataset, run_dir, tmp_path / "killed.json"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    manager = CheckpointManager(run_dir / "checkpoints", keep=2)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        latest = manager.latest()
        if latest is not None and latest.name >= "step_00000010":
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    killed_at = manager.latest()
    assert killed_at is not None and killed_at.name < f"step_{STEPS:08d}", "the run finished before the kill"
    assert not (tmp_path / "killed.json").exists()

    resumed = subprocess.run(
        _train_cmd(movielens_dataset, run_dir, tmp_path / "killed.json", "--resume"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {killed_at}" in resumed.stderr
    a = json.loads((tmp_path / "full.json").read_text())
    b = json.loads((tmp_path / "killed.json").read_text())
    assert b["steps"] == a["steps"] == STEPS
    assert b["ne"] == a["ne"] and b["auc"] == a["auc"]  # bit-identical in deterministic mode

    # The NaN guard: continue the finished run with an absurd learning rate. Training must stop naming the
    # first bad step, and the last good checkpoint must stay complete and untouched.
    full_dir = tmp_path / "full" / "checkpoints"
    good = CheckpointManager(full_dir, keep=2).latest()
    assert good.name == f"step_{STEPS:08d}"
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    nan = subprocess.run(
        _train_cmd(
            movielens_dataset,
            tmp_path / "full",
            tmp_path / "nan.json",
            "--resume",
            "--set",
            f"train.steps={STEPS + 20}",
            "--set",
            "optim.dense_lr=1e30",
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert nan.returncode == 2, nan.stderr[-3000:]
    match = re.search(r"loss is (nan|inf|-inf) at step (\d+)", nan.stderr)
    assert match, nan.stderr[-3000:]
    assert STEPS < int(match.group(2)) <= STEPS + 5
    assert f"last healthy checkpoint is {good}" in nan.stderr
    assert CheckpointManager(full_dir, keep=2).latest() == good
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert not (tmp_path / "nan.json").exists()


def test_torchrun_two_ranks_logs_once(movielens_dataset, tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        GEMREC,
        "train",
        "--dataset",
        str(movielens_dataset),
        "--recipe",
        "tiny",
        "--run-dir",
        str(tmp_path / "run"),
        "--metrics-out",
        str(tmp_path / "metrics.json"),
        "--no-progress",
        "--experiment",
        "ddp",
        "--set",
        "train.steps=12",
        *("--set", "train.eval_every=2", "--set", "train.patience=1"),  # validation decided by rank 0 for both
        *("--set", "optim.dense_lr=0.05", "--set", "optim.decay='constant'"),  # a rate that soon makes it worse
    ]
    env = _env(uri)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    errors = [line for line in done.stderr.splitlines() if "rank1" in line or "Error" in line]
    assert done.returncode == 0, "\n".join(errors)[-6000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    best, steps = metrics["valid"]["best_step"], metrics["steps"]
    assert metrics["world_size"] == 2 and metrics["valid"]["stopped_early"] and steps == best + 2 < 12
    runs = mlflow.MlflowClient(uri).search_runs([mlflow.MlflowClient(uri).get_experiment_by_name("ddp").experiment_id])
    assert len(runs) == 1 and runs[0].data.params["world_size"] == "2"
    names = {p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")}
    assert {f"step_{best:08d}", f"step_{steps:08d}"} <= names and len(names) <= 3  # the best, and keep = 2
    assert done.stderr.count("training tiny (gem") == 1  # rank 0 speaks for the run
    # The model is gathered from the sharded one (a collective) and logged once, by rank 0.
    client = mlflow.MlflowClient(uri)
    models = client.search_logged_models([runs[0].info.experiment_id])
    assert [(m.name, m.source_run_id, str(m.status)) for m in models] == [("model", runs[0].info.run_id, "READY")]


def test_cli_errors_name_the_problem(tmp_path, capsys, movielens_dataset):
    assert gemrec_main(["train", "--dataset", str(tmp_path / "missing"), "--recipe", "tiny"]) == 2
    assert "missing: no such directory" in capsys.readouterr().err
    assert gemrec_main(["train", "--dataset", str(movielens_dataset), "--recipe", "nope"]) == 2
    assert "unknown recipe 'nope'" in capsys.readouterr().err
    assert (
        gemrec_main(["train", "--dataset", str(movielens_dataset), "--recipe", "tiny", "--set", "data.batch_size=0"])
        == 2
    )
    assert "gemrec train: error: data.batch_size = 0: must be > 0" in capsys.readouterr().err
    assert gemrec_main(["train", "--dataset", str(tmp_path), "--recipe", "tiny"]) == 2
    assert "not a complete dataset" in capsys.readouterr().err


def test_train_from_the_data_service(movielens_dataset, tmp_path, tracking_uri):
    from gemrec.components.common.grpc_server import Server, ServerOptions
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.data_service.service import DataLoaderCore, register

    server = Server(ServerOptions(port=0), register(DataLoaderCore(Dataset.open(movielens_dataset))))
    try:
        config = load_recipe("tiny", ["train.steps=6", "checkpoint.every=3", "data.eval_max_examples=256"])
        summary = run_training(
            config,
            dataset=None,
            data_addr=f"127.0.0.1:{server.port}",
            run_dir=tmp_path / "run",
            tracking_uri=tracking_uri,
            experiment="remote",
            metrics_out=None,
            resume=False,
            progress=False,
            log_model=False,
        )
        assert summary["steps"] == 6 and summary["eval_examples"] >= 256
        assert set(summary["ne"]) == {"like", "love"}
        # The valid split through the service: validated at the last step (tiny: every 10), its weights kept.
        assert summary["valid"]["best_step"] == 6 and math.isfinite(summary["valid"]["best"])
        data = summary["data"]  # the data path's numbers: waits, read-ahead, the service's CPU per batch
        assert data["source"] == "remote" and data["service_cpu_ms_per_batch"] > 0
        assert 0 <= data["wait_ms_p50"] <= data["wait_ms_p99"] and 0 <= data["wait_share"] < 1
        assert data["batches_in_flight"] >= 0
        # Resume from the step-3 checkpoint: the stream continues from the saved cursor.
        manager = CheckpointManager(tmp_path / "run" / "checkpoints", keep=2)
        assert manager.latest().name == "step_00000006"
        config = load_recipe("tiny", ["train.steps=9", "checkpoint.every=3", "data.eval_max_examples=256"])
        resumed = run_training(
            config,
            dataset=None,
            data_addr=f"127.0.0.1:{server.port}",
            run_dir=tmp_path / "run",
            tracking_uri=tracking_uri,
            experiment="remote",
            metrics_out=None,
            resume=True,
            progress=False,
            log_model=False,
        )
        assert resumed["steps"] == 9
    finally:
        server.stop(0)
    with pytest.raises(CLIError, match="did not answer"):
        run_training(
            load_recipe("tiny"),
            dataset=None,
            data_addr=f"127.0.0.1:{server.port}",
            run_dir=tmp_path / "x",
            tracking_uri=tracking_uri,
            experiment="remote",
            metrics_out=None,
            resume=False,
            progress=False,
        )


def test_trainer_without_mlflow_fails_clearly_when_the_data_service_stops(movielens_dataset, tmp_path):
    """`gemrec serve data` as a process, SIGSTOPped once training has checkpointed: the trainer logs its reconnects
    while it waits, then stops with a clear error after data.wait_timeout_s (no silent hang). No MLflow
    (--no-tracking)."""
    port = free_port()
    server = subprocess.Popen(
        [GEMREC, "serve", "data", "--dataset", str(movielens_dataset), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    from gemrec.components.common.grpc_channel import open_channel, wait_healthy

    with open_channel(f"127.0.0.1:{port}") as channel:
        wait_healthy(channel, timeout_s=90)
    run_dir = tmp_path / "run"
    manager = CheckpointManager(run_dir / "checkpoints", keep=2)

    def stop_after_first_checkpoint():
        while manager.latest() is None and server.poll() is None:
            time.sleep(0.05)
        server.send_signal(signal.SIGSTOP)

    stopper = threading.Thread(target=stop_after_first_checkpoint)
    stopper.start()
    try:
        cmd = [GEMREC, "train", "--data-addr", f"127.0.0.1:{port}", "--recipe", "tiny", "--run-dir", str(run_dir)]
        settings = ["train.steps=100000", "checkpoint.every=2", "data.wait_timeout_s=4", "data.stall_s=1"]
        result = subprocess.run(
            [*cmd, "--no-tracking", "--no-progress", *[x for s in settings for x in ("--set", s)]],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        stopper.join()
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait(timeout=30)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"data stream from 127.0.0.1:{port}: no batch for 1 s; reconnect" in result.stderr  # visible meanwhile
    assert re.search(
        rf"error: --data-addr 127.0.0.1:{port}: no batch from the data service .* for [45] s", result.stderr
    )
