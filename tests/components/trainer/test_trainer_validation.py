"""Validation and early stopping: the valid split is the end of the train period, a run whose valid NE gets worse
stops and ends with (evaluates, exports) the weights of its best validated step, and `--resume` keeps that."""

import logging
import math

import numpy as np
import pytest
import torch
from gemrec.cli import CLIError
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.trainer.checkpoint import CheckpointManager
from gemrec.components.trainer.config import load_recipe
from gemrec.components.trainer.evaluate import EarlyStopping
from gemrec.components.trainer.run import dataset_source
from gemrec.config import ConfigError

EVERY, PATIENCE = 5, 2


def test_early_stopping_counts_validations_and_round_trips():
    early = EarlyStopping("ne_like", higher_is_better=False, every=EVERY, patience=PATIENCE)
    assert [early.due(s, last=False) for s in (4, 5, 10)] == [False, True, True] and early.due(7, last=True)
    assert early.update(5, 0.9) and early.update(10, 0.8)
    assert not early.update(15, math.nan) and not early.stop  # a non-finite value is never the best
    assert not early.update(20, 0.85) and early.stop and (early.best, early.best_step) == (0.8, 10)
    restored = EarlyStopping("ne_like", False, EVERY, PATIENCE)
    restored.load_state_dict(early.state_dict())
    assert restored == early
    auc = EarlyStopping("auc_like", higher_is_better=True, every=1, patience=0)
    assert auc.update(1, 0.6) and auc.update(2, 0.7) and not auc.update(3, 0.65) and not auc.stop  # 0: never stops
    assert not EarlyStopping("ne_like", False, every=0, patience=0).due(10, last=True)


def test_validation_settings_are_checked(movielens_dataset, tmp_path, train_tiny):
    with pytest.raises(ConfigError, match=r"train.patience = 3: needs train.eval_every > 0"):
        load_recipe("tiny", ["train.eval_every=0", "train.patience=3"])
    with pytest.raises(ConfigError, match=r"train.valid_metric = 'mse_like': must be one of ne, auc, log_loss"):
        load_recipe("tiny", ["train.valid_metric='mse_like'"])
    with pytest.raises(CLIError, match=r"train.valid_metric = 'auc_click' names label 'click'; .* \['like', 'love'\]"):
        train_tiny(movielens_dataset, tmp_path, None, "train.valid_metric='auc_click'")


def test_valid_batches_lie_between_train_and_eval(movielens_dataset):
    """What the trainer validates on is the end of the train period: after every train example, before every
    eval one, and no (user, time) pair of it is in eval."""
    config = load_recipe("tiny", ["data.valid_max_examples=0", "data.eval_max_examples=0"])
    split = Dataset.open(movielens_dataset).manifest["split"]
    _, eval_batches, valid_batches, _, _ = dataset_source(config, movielens_dataset, rank=0, world_size=1)
    seen = {}
    for name, batches in (("valid", valid_batches), ("eval", eval_batches)):
        rows = [(b.timestamps.numpy(), b.sparse_features["user_id"].values().numpy()) for b in batches()]
        seen[name] = (np.concatenate([t for t, _ in rows]), np.concatenate([u for _, u in rows]))
    valid_times, eval_times = seen["valid"][0], seen["eval"][0]
    assert len(valid_times) == Dataset.open(movielens_dataset).num_examples("valid") > 0
    assert split["valid_cutoff"] <= valid_times.min() and valid_times.max() < split["cutoff"] <= eval_times.min()
    assert not set(zip(*seen["valid"])) & set(zip(*seen["eval"]))


def _checkpoint_state(path, tmp_path) -> dict:
    """The whole state of a DCP checkpoint (model, average, optim, ...)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(target))
    return torch.load(target, weights_only=False)


def _exported_state(summary: dict, uri: str, tmp_path) -> dict[str, torch.Tensor]:
    """The state dict the run exported to MLflow."""
    import mlflow

    path = mlflow.artifacts.download_artifacts(
        run_id=summary["mlflow"]["run_id"],
        artifact_path="checkpoint/state_dict.pt",
        tracking_uri=uri,
        dst_path=str(tmp_path / "exported"),
    )
    return torch.load(path)


def _model_tensors(path, tmp_path) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint."""
    return _checkpoint_state(path, tmp_path)["model"]


OFFSET = "heads.logit_offset"


def _valid_metrics(state: dict[str, torch.Tensor], dataset, overrides: list[str]) -> dict[str, dict[str, float]]:
    """`metrics.task_metrics` per label on the valid examples the tiny recipe validates on, of a model state."""
    from gemrec.components.trainer import metrics as qm
    from gemrec.components.trainer.data import to_model_input
    from gemrec.model import FeatureSchema, build_model

    config = load_recipe("tiny", ["data.eval_max_examples=256", *overrides])
    _, _, valid_batches, manifest, _ = dataset_source(config, dataset, rank=0, world_size=1)
    model = build_model(config.model, FeatureSchema.from_manifest(manifest))
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        rows = [(model(to_model_input(b)).logits.numpy(), b.labels.numpy()) for b in valid_batches()]
    return qm.task_metrics(np.concatenate([r[1] for r in rows]), np.concatenate([r[0] for r in rows]), ["like", "love"])


def _valid_calibration(state: dict[str, torch.Tensor], dataset, overrides: list[str]) -> list[float]:
    """Mean prediction / rate per label on the valid examples the tiny recipe validates on, of a model state."""
    metrics = _valid_metrics(state, dataset, overrides)
    return [metrics[name]["calibration"] for name in ("like", "love")]


def test_a_run_that_gets_worse_stops_and_ends_with_its_best_weights(movielens_dataset, tmp_path, caplog, train_tiny):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run_dir = tmp_path / "run"
    common = [f"train.eval_every={EVERY}", "checkpoint.keep=1"]
    # 20 steps of the tiny recipe, validated every 5, then a learning rate that wrecks the model: valid NE worsens.
    train_tiny(movielens_dataset, run_dir, uri, *common, "train.steps=20")
    with caplog.at_level(logging.INFO, logger="gemrec"):
        summary = train_tiny(
            movielens_dataset,
            run_dir,
            uri,
            *common,
            "train.steps=60",
            f"train.patience={PATIENCE}",
            "optim.dense_lr=0.05",
            "optim.decay='constant'",
            resume=True,
            log_model=True,
        )
    valid = summary["valid"]
    client = mlflow.MlflowClient(uri)
    history = {m.step: m.value for m in client.get_metric_history(summary["mlflow"]["run_id"], "valid/ne_like")}
    best_step = min(history, key=history.get)
    assert sorted(history) == list(range(EVERY, summary["steps"] + 1, EVERY))
    assert valid["metric"] == "ne_like" and valid["stopped_early"] and best_step <= 20
    assert (valid["best_step"], valid["best"]) == (best_step, pytest.approx(history[best_step]))
    assert summary["steps"] == best_step + PATIENCE * EVERY < 60  # stopped `patience` validations after the best
    assert f"restored the best weights of step {best_step}" in caplog.text
    evals = client.get_metric_history(summary["mlflow"]["run_id"], "eval/ne_like")  # the 20-step run's, then this
    final = max(evals, key=lambda m: m.timestamp)
    assert final.step == best_step and final.value == pytest.approx(summary["ne"]["like"])  # the best weights' eval

    manager = CheckpointManager(run_dir / "checkpoints", keep=1)
    best = manager.step_dir(best_step)
    assert manager.best() == best == tmp_path / "run" / "checkpoints" / f"step_{best_step:08d}"  # kept by pruning
    assert summary["checkpoint"] == str(best) and manager.latest().name == f"step_{summary['steps']:08d}"
    exported = _exported_state(summary, uri, tmp_path)
    best_weights, last_weights = _model_tensors(best, tmp_path), _model_tensors(manager.latest(), tmp_path)
    weights = [k for k in exported if k != OFFSET]
    assert all(torch.equal(exported[k], best_weights[k]) for k in weights)
    assert any(not torch.equal(exported[k], last_weights[k]) for k in weights)
    # The logit offsets were fitted after training (0 in the checkpoints) and the export carries them: with them
    # the best weights' mean prediction on the valid split is the valid rate of every label.
    offsets = valid["logit_offsets"]
    assert not best_weights[OFFSET].any() and exported[OFFSET].tolist() == pytest.approx(list(offsets.values()))
    assert all(abs(v) > 1e-3 for v in offsets.values())
    logged = max(
        client.get_metric_history(summary["mlflow"]["run_id"], "valid/logit_offset_love"), key=lambda m: m.timestamp
    )
    assert (logged.step, logged.value) == (best_step, pytest.approx(offsets["love"]))  # this run's, at the best step
    assert _valid_calibration(exported, movielens_dataset, common) == pytest.approx([1.0, 1.0], abs=1e-4)
    exported[OFFSET].zero_()
    assert _valid_calibration(exported, movielens_dataset, common) != pytest.approx([1.0, 1.0], abs=1e-2)

    # --resume of the finished run trains nothing and ends with the same best weights and eval numbers.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gemrec"):
        again = train_tiny(
            movielens_dataset, run_dir, None, *common, "train.steps=60", f"train.patience={PATIENCE}", resume=True
        )
    assert f"early stopping ended this run at step {summary['steps']}" in caplog.text
    assert again["steps"] == summary["steps"] and again["ne"] == summary["ne"] and again["valid"] == valid


def test_calibrate_false_leaves_the_task_heads_alone(movielens_dataset, tmp_path, train_tiny):
    runs = {
        flag: train_tiny(movielens_dataset, tmp_path / flag, None, "train.steps=10", "train.eval_every=5", flag)
        for flag in ("train.calibrate=true", "train.calibrate=false")
    }
    offsets = runs["train.calibrate=true"]["valid"]["logit_offsets"]
    assert set(offsets) == {"like", "love"} and runs["train.calibrate=false"]["valid"]["logit_offsets"] is None
    assert runs["train.calibrate=true"]["ne"] != runs["train.calibrate=false"]["ne"]


def test_weight_average_is_what_is_validated_kept_evaluated_and_exported(movielens_dataset, tmp_path, train_tiny):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    run_dir = tmp_path / "run"
    ple = "model.dense_encoding='ple'"  # as the movielens recipe: buffers with infinite bin edges beside the weights
    common = ["train.steps=20", f"train.eval_every={EVERY}", "optim.weight_average=0.9", ple]
    summary = train_tiny(movielens_dataset, run_dir, uri, *common, log_model=True)
    best_step = summary["valid"]["best_step"]
    saved = _checkpoint_state(CheckpointManager(run_dir / "checkpoints", keep=2).best(), tmp_path)
    live, average = saved["model"], saved["average"]["weights"]
    assert saved["average"]["updates"] == best_step and set(average) <= set(live)
    assert all(torch.isfinite(t).all() for t in average.values())
    exported = _exported_state(summary, uri, tmp_path)
    weights = [k for k in average if k != OFFSET]
    assert all(torch.equal(exported[k], average[k]) for k in weights)  # the average is evaluated and exported
    assert sum(not torch.allclose(average[k], live[k]) for k in weights) > len(weights) // 2  # not the live weights
    # What validation logged at the best step is the average's valid log loss (the offsets came after it).
    client = mlflow.MlflowClient(uri)
    logged = {m.step: m.value for m in client.get_metric_history(summary["mlflow"]["run_id"], "valid/log_loss_like")}
    exported[OFFSET].zero_()
    metrics = _valid_metrics(exported, movielens_dataset, [ple])
    assert logged[best_step] == pytest.approx(metrics["like"]["log_loss"], rel=1e-5)
    live_metrics = _valid_metrics({**exported, **{k: live[k] for k in weights}}, movielens_dataset, [ple])
    assert live_metrics["like"]["log_loss"] != pytest.approx(logged[best_step], rel=1e-5)


def test_resume_carries_the_weight_average_on(movielens_dataset, tmp_path, train_tiny):
    """A run stopped after 10 steps and resumed to 20 ends as the uninterrupted one: the checkpoint carries the
    average and its ramp (a constant schedule: the same learning rates either way)."""
    common = [f"train.eval_every={EVERY}", "optim.weight_average=0.9", "optim.decay='constant'"]
    whole = train_tiny(movielens_dataset, tmp_path / "whole", None, *common, "train.steps=20")
    train_tiny(movielens_dataset, tmp_path / "split", None, *common, "train.steps=10")
    resumed = train_tiny(movielens_dataset, tmp_path / "split", None, *common, "train.steps=20", resume=True)
    assert resumed["valid"]["best_step"] == whole["valid"]["best_step"] > 10
    assert resumed["ne"] == pytest.approx(whole["ne"], rel=1e-6)
