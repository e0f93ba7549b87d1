"""Evaluation of a split (NE, AUC and calibration per task, over all ranks, timed: the train loop leaves it out of
its throughput), and early stopping on the `valid` split: when to validate, whether a validation improved on the
best, when to stop (`EarlyStopping`). The best weights themselves are a checkpoint (`CheckpointManager.best`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gemrec.components.trainer import metrics as qm
from gemrec.components.trainer.config import LoopConfig, split_valid_metric
from gemrec.components.trainer.distributed import DistContext
from gemrec.config import ConfigError
from torch import nn


class Evaluator:
    def __init__(
        self,
        source: Callable[[], Iterable[Any]],
        task_names: Sequence[str],
        to_input: Callable[[Any], Any],
        autocast: Callable[[], AbstractContextManager[object]],
        ctx: DistContext,
        split: str = "eval",
    ):
        """`source()` yields this rank's `Batch`es of `split` (every rank the same number); `to_input(batch)` gives
        the model input on the device."""
        self.source = source
        self.task_names = list(task_names)
        self.to_input = to_input
        self.autocast = autocast
        self.ctx = ctx
        self.split = split
        self.seconds = 0.0  # wall time of the last evaluation
        self.predictions: tuple[np.ndarray, np.ndarray] | None = None  # of the last `predict`, on rank 0

    @torch.no_grad()
    def predict(self, model: nn.Module) -> tuple[np.ndarray, np.ndarray] | None:
        """(labels, logits), each (N, num_tasks), of the whole split on rank 0 (None elsewhere; a collective); rank
        0 also keeps them as `predictions` until the next call."""
        model.eval()
        logits, labels = [], []
        try:
            for batch in self.source():
                batch_labels = batch.labels
                inp = self.to_input(batch)
                with self.autocast():
                    out = model(inp)
                logits.append(out.logits.float().cpu().numpy())
                labels.append(batch_labels.numpy())
        finally:
            model.train()
        num_tasks = len(self.task_names)
        local = (
            np.concatenate(labels) if labels else np.zeros((0, num_tasks), np.float32),
            np.concatenate(logits) if logits else np.zeros((0, num_tasks), np.float32),
        )
        gathered = self.ctx.gather_objects(local)
        self.predictions = (
            None
            if gathered is None
            else (np.concatenate([g[0] for g in gathered]), np.concatenate([g[1] for g in gathered]))
        )
        return self.predictions

    def evaluate(self, model: nn.Module, train_rates: Callable[[], dict[str, float]]) -> dict | None:
        """NE, AUC and calibration per task; the result on rank 0, None elsewhere. `train_rates()` (a collective,
        called on every rank) gives the training split's positive rate per label, for the NE of predicting it."""
        start = time.perf_counter()
        predictions = self.predict(model)
        rates = train_rates()
        if predictions is None:
            self.seconds = time.perf_counter() - start
            return None
        result = split_metrics(*predictions, self.task_names, rates)
        self.seconds = time.perf_counter() - start
        return result


def split_metrics(labels: np.ndarray, logits: np.ndarray, task_names: Sequence[str], rates: dict[str, float]) -> dict:
    """An evaluation's result from a split's (N, num_tasks) labels and logits: NE, AUC and calibration per task, and
    the NE of always predicting the training split's positive rate (`rates`, per label) for reference."""
    names = list(task_names)
    result = qm.task_metrics(labels, logits, names)
    for name in names:
        rate = rates.get(name)
        if rate is not None:
            y = labels[:, names.index(name)]
            result[name]["ne_train_base_rate_predictor"] = qm.normalized_entropy(y, np.full(len(y), rate))
    return {"tasks": result, "examples": int(len(labels))}


@dataclass
class EarlyStopping:
    """Validation every `every` steps and at the last one; the best value of `metric` and its step; training stops
    after `patience` validations in a row without a better value (0 = never). Identical on every rank (each counts
    rank 0's value); its state goes into every checkpoint."""

    metric: str  # "ne_like" (`train.valid_metric`), "ndcg@10", ...
    higher_is_better: bool
    every: int  # steps between validations; 0 = no validation
    patience: int
    best: float = math.nan
    best_step: int = 0
    stale: int = 0
    validations: int = 0

    @classmethod
    def for_run(cls, train: LoopConfig, labels: Sequence[str], has_valid: bool) -> EarlyStopping:
        """From `[train]` (`eval_every`, `patience`, `valid_metric`) for a dataset with `labels`; inactive when the
        dataset has no valid split. A label the dataset does not have is refused."""
        kind, label = split_valid_metric(train.valid_metric)
        label = label or labels[0]
        if label not in labels:
            raise ConfigError(
                f"train.valid_metric = {train.valid_metric!r} names label {label!r}; the dataset's labels are "
                f"{list(labels)}"
            )
        return cls(f"{kind}_{label}", kind == "auc", train.eval_every if has_valid else 0, train.patience)

    @property
    def active(self) -> bool:
        return self.every > 0

    @property
    def stop(self) -> bool:
        return self.patience > 0 and self.stale >= self.patience

    def due(self, step: int, last: bool) -> bool:
        return self.active and (step % self.every == 0 or last)

    def value(self, result: dict) -> float:
        """The followed `<metric>_<label>` of an `Evaluator.evaluate` result (NaN when undefined, e.g. one class)."""
        kind, label = split_valid_metric(self.metric)
        value = result["tasks"][label][kind]
        return math.nan if value is None else float(value)

    def update(self, step: int, value: float) -> bool:
        """Count a validation at `step`; True when `value` is the best so far (a non-finite value never is)."""
        self.validations += 1
        better = math.isfinite(value) and (
            math.isnan(self.best) or (value > self.best if self.higher_is_better else value < self.best)
        )
        if better:
            self.best, self.best_step, self.stale = value, step, 0
        else:
            self.stale += 1
        return better

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "stale": self.stale, "validations": self.validations}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step = float(state["best"]), int(state["best_step"])
        self.stale, self.validations = int(state["stale"]), int(state["validations"])
