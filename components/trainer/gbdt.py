"""The `gbdt` arm: gradient-boosted trees on the dataset's dense features, the baseline a practitioner builds first.

Inputs are every dense feature of the dataset: the request-time features (hour, weekday), the point-in-time
aggregates of earlier events (`components/data_service/aggregates.py`: the user's past and recent means of
each action, count, seconds since the last event; the item's past count and means) and the side tables'
dense columns. One scikit-learn `HistGradientBoostingClassifier` per label, stopped early on the valid split
(the end of the train period) when the dataset has one; predictions are log-odds, scored with the same
NE/AUC/calibration as the neural arms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

COLLATE_CHUNK = 65_536


@dataclass(frozen=True)
class GBDTParams:
    max_iter: int = 300  # boosting rounds at most (fewer when the valid split stops it)
    learning_rate: float = 0.1
    max_leaf_nodes: int = 31
    min_samples_leaf: int = 20
    l2_regularization: float = 0.0
    patience: int = 20  # rounds without a better valid log loss before stopping
    seed: int = 0


def dense_matrix(dataset, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(dense features (n, num_dense), labels (n, num_labels)) of every example of `split`."""
    n = dataset.num_examples(split)
    features, labels = [], []
    for start in range(0, n, COLLATE_CHUNK):
        batch = dataset.collate(split, np.arange(start, min(n, start + COLLATE_CHUNK)), max_seq_len=0)
        features.append(batch.dense_features.numpy())
        labels.append(batch.labels.numpy())
    if not features:
        return np.zeros((0, len(dataset.dense_features)), np.float32), np.zeros((0, len(dataset.label_names)))
    return np.concatenate(features), np.concatenate(labels)


def fit_predict(dataset, params: GBDTParams, predict_splits: tuple[str, ...] = ("eval",)) -> dict:
    """Fits one classifier per label on `train` (early stopping on `valid` when present) and returns
    {"logits": {split: (n, num_labels)}, "labels": {split: ...}, "iterations": {label: n}, "seconds": fit time}."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    if not dataset.dense_features:
        raise ValueError("the gbdt arm needs dense features; this dataset has none")
    x_train, y_train = dense_matrix(dataset, "train")
    has_valid = "valid" in dataset.splits and dataset.num_examples("valid") > 0
    x_valid, y_valid = dense_matrix(dataset, "valid") if has_valid else (None, None)
    wanted = {split: dense_matrix(dataset, split) for split in predict_splits}
    logits = {split: np.zeros(y.shape, np.float32) for split, (_, y) in wanted.items()}
    iterations = {}
    start = time.perf_counter()
    for j, label in enumerate(dataset.label_names):
        model = HistGradientBoostingClassifier(
            max_iter=params.max_iter,
            learning_rate=params.learning_rate,
            max_leaf_nodes=params.max_leaf_nodes,
            min_samples_leaf=params.min_samples_leaf,
            l2_regularization=params.l2_regularization,
            early_stopping=has_valid,
            n_iter_no_change=params.patience,
            random_state=params.seed,
        )
        if len(np.unique(y_train[:, j])) < 2:
            raise ValueError(f"label {label!r} has one class only in the train split: nothing to learn")
        if x_valid is not None and y_valid is not None:
            model.fit(x_train, y_train[:, j], X_val=x_valid, y_val=y_valid[:, j])
        else:
            model.fit(x_train, y_train[:, j])
        iterations[label] = int(model.n_iter_)
        for split, (x, _) in wanted.items():
            logits[split][:, j] = model.decision_function(x) if len(x) else 0.0
    return {
        "logits": logits,
        "labels": {split: y for split, (_, y) in wanted.items()},
        "iterations": iterations,
        "seconds": time.perf_counter() - start,
        "train_examples": len(x_train),
    }


def run_gbdt(config, dataset_dir, tracking_uri: str, experiment: str, metrics_out=None, tracking: bool = True) -> dict:
    """`gemrec train --model gbdt`: fit, evaluate on `eval`, log to MLflow like the neural arms; the summary."""
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.trainer import metrics as qm
    from gemrec.components.trainer.tracking import Tracker, write_summary
    from gemrec.provenance import git_commit

    ds = Dataset.open(dataset_dir)
    model = config.model
    params = GBDTParams(
        max_iter=model.gbdt_max_iter,
        learning_rate=model.gbdt_learning_rate,
        max_leaf_nodes=model.gbdt_max_leaf_nodes,
        seed=config.train.seed,
    )
    tracker = Tracker(tracking, tracking_uri, experiment, run_name=f"{config.recipe}-gbdt")
    try:
        fitted = fit_predict(ds, params)
        labels, logits = fitted["labels"]["eval"], fitted["logits"]["eval"]
        tasks = list(ds.label_names)
        result = qm.task_metrics(labels, logits, tasks)
        train_labels = dense_matrix(ds, "train")[1]
        for j, name in enumerate(tasks):
            rate = float(train_labels[:, j].mean())
            result[name]["ne_train_base_rate_predictor"] = qm.normalized_entropy(
                labels[:, j], np.full(len(labels), rate)
            )
        summary = {
            "recipe": config.recipe,
            "arch": "gbdt",
            "steps": max(fitted["iterations"].values()),
            "iterations": fitted["iterations"],
            "world_size": 1,
            "tasks": tasks,
            "ne": {n: v["ne"] for n, v in result.items()},
            "auc": {n: v["auc"] for n, v in result.items()},
            "calibration": {n: v["calibration"] for n, v in result.items()},
            "base_rate": {n: v["base_rate"] for n, v in result.items()},
            "ne_train_base_rate": {n: v["ne_train_base_rate_predictor"] for n, v in result.items()},
            "eval_examples": int(len(labels)),
            "qps": fitted["train_examples"] * len(tasks) / max(fitted["seconds"], 1e-9),  # examples x labels fitted / s
            "train_seconds": fitted["seconds"],
            "mlflow": {"tracking_uri": tracking_uri, "experiment": experiment, "run_id": tracker.run_id},
            "dataset": {"name": ds.manifest.get("name"), "checksum": ds.manifest.get("dataset_checksum")},
            "git_commit": git_commit(),
        }
        tracker.log_params({f"model.gbdt_{k}": v for k, v in vars(params).items()} | {"model.arch": "gbdt"})
        tracker.set_tags({"git_commit": summary["git_commit"], "dataset": summary["dataset"]["name"], "arch": "gbdt"})
        tracker.log_eval(summary["steps"], {"tasks": result, "examples": len(labels)})
        tracker.log_metrics({f"final/ne_{n}": v for n, v in summary["ne"].items()}, step=summary["steps"])
        tracker.log_dict(summary, "metrics/summary.json")
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish()
    if metrics_out:
        write_summary(metrics_out, summary)
    return summary
