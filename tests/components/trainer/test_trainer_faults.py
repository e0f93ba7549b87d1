"""Training faults on the `tiny` recipe: a diverging update never leaves a poisoned checkpoint to resume from,
and an unwritable checkpoint directory is refused at the start, in one line."""

import logging
import math
import shutil

import pytest
import torch
from gemrec.cli import CLIError
from gemrec.cli import main as gemrec_main
from gemrec.components.trainer.checkpoint import CheckpointManager

DIVERGE = ["optim.dense_lr=1e30", "checkpoint.every=1"]  # the update after step 6 explodes the weights


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlruns.db'}"


@pytest.fixture(scope="module")
def six_steps(movielens_dataset, tmp_path_factory, tracking_uri, train_tiny):
    """A healthy run of 6 steps with checkpoints at 2, 4, 6."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    train_tiny(movielens_dataset, run_dir, tracking_uri, "train.steps=6", "checkpoint.every=2")
    return run_dir


@pytest.mark.parametrize(
    ("extra", "stopped_by"),
    [
        ([], "parameter norm grew"),  # caught before the checkpoint of step 7 is written
        (["checkpoint.max_param_growth=1e300"], "the step after checkpoint"),  # written, then not marked healthy
    ],
    ids=["norm-check", "healthy-marker"],
)
def test_resume_after_divergence_starts_from_the_last_healthy_checkpoint(
    movielens_dataset, six_steps, tmp_path, tracking_uri, caplog, extra, stopped_by, train_tiny
):
    run_dir = tmp_path / "run"
    shutil.copytree(six_steps, run_dir)
    healthy = run_dir / "checkpoints" / "step_00000006"
    with pytest.raises(CLIError) as err:
        train_tiny(movielens_dataset, run_dir, tracking_uri, "train.steps=10", *DIVERGE, *extra, resume=True)
    message = str(err.value)
    assert stopped_by in message and f"the last healthy checkpoint is {healthy}" in message, message
    assert "\n" not in message
    assert CheckpointManager(run_dir / "checkpoints", keep=2).resume_point() == healthy

    with caplog.at_level(logging.INFO, logger="gemrec"):
        summary = train_tiny(
            movielens_dataset, run_dir, tracking_uri, "train.steps=10", "checkpoint.every=2", resume=True
        )
    assert f"resumed from {healthy} at step 6" in caplog.text and "last healthy checkpoint" in caplog.text
    assert summary["steps"] == 10 and all(math.isfinite(v) for v in summary["ne"].values())
    manager = CheckpointManager(run_dir / "checkpoints", keep=2)
    assert (
        manager.diverged() is None
        and manager.healthy() == manager.latest() == run_dir / "checkpoints" / "step_00000010"
    )


def test_pruning_keeps_the_healthy_checkpoint_and_resume_follows_a_divergence(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep=1)
    first = manager.save(1, {"w": torch.ones(2)})
    manager.mark_healthy(first)
    manager.save(2, {"w": torch.full((2,), 2.0)})
    third = manager.save(3, {"w": torch.full((2,), 3.0)})
    assert sorted(p.name for p in manager.dir.glob("step_*")) == ["step_00000001", "step_00000003"]
    assert manager.resume_point() == third
    manager.mark_diverged(4, "loss is nan at step 4")
    assert manager.resume_point() == first
    state = {"w": torch.zeros(2)}
    manager.load(state, manager.resume_point())
    assert state["w"].tolist() == [1.0, 1.0]
    manager.mark_healthy(third)  # a later healthy checkpoint ends the divergence
    assert manager.diverged() is None and manager.resume_point() == third


@pytest.mark.parametrize("where", ["/sys/gemrec-unwritable/run", "{file}/run"], ids=["read-only", "under-a-file"])
def test_unwritable_checkpoint_dir_exits_2_before_training(movielens_dataset, tmp_path, capsys, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run_dir = where.format(file=blocker)
    code = gemrec_main(
        ["train", "--dataset", str(movielens_dataset), "--recipe", "tiny", "--run-dir", run_dir, "--no-progress"]
    )
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("gemrec train: error:")]
    assert len(lines) == 1 and "checkpoint directory" in lines[0] and "not writable" in lines[0], err
    assert "Traceback" not in err and "training tiny" not in err
