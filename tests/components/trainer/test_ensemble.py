"""`train.ensemble`: members are ordinary runs of seeds seed, seed + 1 trained at once in processes of their own; the
ensemble predicts the mean of their logits plus an offset fitted on valid, is evaluated, logged and exported as one
model; a failing member is named; bad settings are refused."""

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gemrec.cli import CLIError
from gemrec.components.trainer import metrics as qm
from gemrec.components.trainer.config import load_recipe
from gemrec.components.trainer.data import to_model_input
from gemrec.components.trainer.ensemble import mean_logits
from gemrec.components.trainer.run import dataset_source
from gemrec.config import ConfigError
from gemrec.model import Ensemble, FeatureSchema, ModelOutput, build_model


class Constant(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.register_buffer("logits", torch.tensor(logits))

    def forward(self, inp):
        return ModelOutput(logits=self.logits.expand(inp, -1), aux_loss=self.logits.sum())


def test_ensemble_module_averages_logits_and_adds_its_offset():
    model = Ensemble([Constant([1.0, -2.0]), Constant([3.0, 0.0])], num_tasks=2)
    model.logit_offset += torch.tensor([0.5, -0.5])
    out = model(3)
    assert torch.equal(out.logits, torch.tensor([[2.5, -1.5]] * 3))
    assert float(out.aux_loss) == pytest.approx((-1.0 + 3.0) / 2)
    with pytest.raises(ValueError, match="at least one member"):
        Ensemble([], num_tasks=2)


def test_members_must_have_predicted_the_same_examples():
    labels, logits = np.array([[1.0], [0.0]]), np.array([[0.5], [-1.0]])
    assert np.array_equal(mean_logits([(labels, logits), (labels, 3 * logits)], "eval")[1], 2 * logits)
    with pytest.raises(CLIError, match="ensemble member 1 predicted other valid examples than member 0"):
        mean_logits([(labels, logits), (labels[:1], logits[:1])], "valid")


def test_ensemble_settings_are_checked(monkeypatch, movielens_dataset, tmp_path, train_tiny):
    with pytest.raises(ConfigError, match=r"train.ensemble = 0: must be >= 1"):
        load_recipe("tiny", ["train.ensemble=0"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CLIError, match=r"train.ensemble = 2 runs its members as processes of one trainer"):
        train_tiny(movielens_dataset, tmp_path, None, "train.ensemble=2")


def _predict(models, batches):
    labels, logits = [], []
    with torch.no_grad():
        for batch in batches():
            inp = to_model_input(batch)
            logits.append(torch.stack([m(inp).logits for m in models]).mean(0).numpy())
            labels.append(batch.labels.numpy())
    return np.concatenate(labels), np.concatenate(logits)


def test_ensemble_of_two_members(movielens_dataset, tmp_path, train_tiny):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run_dir = tmp_path / "ensemble"
    summary = train_tiny(movielens_dataset, run_dir, uri, "train.ensemble=2", log_model=True)
    single = train_tiny(movielens_dataset, tmp_path / "single", None)
    ensemble = summary["ensemble"]
    assert ensemble["members"] == 2 and ensemble["seeds"] == [0, 1] and ensemble["threads_per_member"] == 1
    assert summary["world_size"] == 2  # E2E MFU against both members' shares of the machine
    assert ensemble["member_ne"][0] == single["ne"]  # member 0 is the ordinary run of seed 0
    assert ensemble["member_ne"][0] != ensemble["member_ne"][1]

    # The ensemble's eval NE, recomputed from the members' hand-over weights: mean logits + offsets fitted on valid.
    config = load_recipe("tiny", ["data.eval_max_examples=256"])
    _, eval_batches, valid_batches, manifest, _ = dataset_source(config, movielens_dataset, 0, 1)
    schema = FeatureSchema.from_manifest(manifest)
    members = [torch.load(run_dir / f"member{i}" / "member.pt", weights_only=False)["model"] for i in range(2)]
    assert all(type(m) is type(build_model(config.model, schema)) for m in members)
    offsets = qm.logit_offsets(*_predict(members, valid_batches))
    eval_labels, eval_logits = _predict(members, eval_batches)
    expected = qm.task_metrics(eval_labels, eval_logits + offsets, list(schema.labels))
    for name in schema.labels:
        assert summary["ne"][name] == pytest.approx(expected[name]["ne"], abs=1e-5)
        assert ensemble["logit_offsets"][name] == pytest.approx(float(offsets[list(schema.labels).index(name)]))
    assert summary["valid"]["metric"] == "ne_like" and summary["valid"]["best_step"] == 20

    # One MLflow run: the ensemble's numbers, every member's curves and final NE, the exported Ensemble.
    run = mlflow.MlflowClient(uri).get_run(summary["mlflow"]["run_id"])
    assert run.data.tags["ensemble"] == "2" and run.data.params["train.ensemble"] == "2"
    assert run.data.metrics["eval/ne_like"] == pytest.approx(summary["ne"]["like"])
    for i in range(2):
        assert run.data.metrics[f"member{i}/eval/ne_like"] == pytest.approx(ensemble["member_ne"][i]["like"])
        assert f"member{i}/train/loss" in run.data.metrics
    path = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="checkpoint/state_dict.pt", tracking_uri=uri, dst_path=str(tmp_path)
    )
    state = torch.load(path)
    assert {"members.0.heads.logit_offset", "members.1.heads.logit_offset", "logit_offset"} <= set(state)
    assert state["logit_offset"].tolist() == pytest.approx(offsets.tolist(), abs=1e-6)


def test_a_failing_member_is_named(movielens_dataset, tmp_path, train_tiny):
    run_dir = tmp_path / "ensemble"
    run_dir.mkdir()
    (run_dir / "member1").write_text("a file where member 1's run folder goes")
    with pytest.raises(CLIError, match=r"ensemble member 1 \(train.seed = 1\) failed: .*member1"):
        train_tiny(movielens_dataset, run_dir, None, "train.ensemble=2")


def test_ensemble_from_the_data_service_resumes(movielens_dataset, tmp_path):
    from gemrec.components.common.grpc_server import Server, ServerOptions
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.data_service.service import DataLoaderCore, register
    from gemrec.components.trainer.run import run_training

    server = Server(ServerOptions(port=0), register(DataLoaderCore(Dataset.open(movielens_dataset))))
    config = load_recipe(
        "tiny", ["train.steps=6", "checkpoint.every=3", "data.eval_max_examples=256", "train.ensemble=2"]
    )

    def train(resume: bool) -> dict:
        return run_training(
            config,
            dataset=None,
            data_addr=f"127.0.0.1:{server.port}",
            run_dir=tmp_path / "run",
            tracking_uri=None,
            experiment="remote",
            metrics_out=tmp_path / "summary.json",
            resume=resume,
            progress=False,
            tracking=False,
        )

    try:
        summary = train(resume=False)
        assert summary["steps"] == 6 and summary["data"]["source"] == "remote"
        assert summary["ensemble"]["members"] == 2 and summary["eval_examples"] >= 256
        resumed = train(resume=True)  # every member resumes from its own step-6 checkpoint: nothing left to train
        assert resumed["ne"] == summary["ne"] and resumed["ensemble"]["member_ne"] == summary["ensemble"]["member_ne"]
    finally:
        server.stop(0)


def _children(pid: int, marker: str) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and marker in cmdline:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc")
def test_members_stop_when_the_coordinator_is_killed(movielens_dataset, tmp_path):
    command = [sys.executable, "-m", "gemrec", "train", "--dataset", str(movielens_dataset), "--recipe", "tiny"]
    command += ["--set", "train.ensemble=2", "--set", "train.steps=1000000", "--set", "train.local_mfu=false"]
    log = tmp_path / "train.log"
    with log.open("w") as stderr:
        coordinator = subprocess.Popen([*command, "--no-tracking", "--run-dir", str(tmp_path / "run")], stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while len(members := _children(coordinator.pid, "spawn_main")) < 2 or not all(
            f" INFO member {i} gemrec.components.trainer." in log.read_text() for i in (0, 1)
        ):  # both training, their lines labelled
            assert coordinator.poll() is None and time.monotonic() < deadline, "the members never started"
            time.sleep(0.2)
    finally:
        coordinator.kill()
        coordinator.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in members):
        assert time.monotonic() < deadline, f"members {members} still run after their coordinator was killed"
        time.sleep(0.2)
    assert "member 1 gemrec.components.trainer.ensemble: the ensemble's coordinator" in log.read_text()
