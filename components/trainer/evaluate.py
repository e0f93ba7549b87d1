"""Evaluation during and after training: NE, AUC and calibration per task on the eval split, over all ranks, timed
(the train loop leaves eval time out of its throughput)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from gemrec.components.trainer import metrics as qm
from gemrec.components.trainer.distributed import DistContext
from torch import nn


class Evaluator:
    def __init__(
        self,
        source: Callable[[], Iterable[Any]],
        task_names: Sequence[str],
        to_input: Callable[[Any], Any],
        autocast: Callable[[], AbstractContextManager[object]],
        ctx: DistContext,
        every: int = 0,
    ):
        """`source()` yields this rank's eval `Batch`es (every rank the same number); `to_input(batch)` gives the
        model input on the device; `every`: steps between evaluations during training (0 = only at the end)."""
        self.source = source
        self.task_names = list(task_names)
        self.to_input = to_input
        self.autocast = autocast
        self.ctx = ctx
        self.every = every
        self.seconds = 0.0  # wall time of the last evaluation

    def due(self, step: int, last: bool) -> bool:
        """An evaluation during training (the final one is run by the loop after the last step)."""
        return bool(self.every) and step % self.every == 0 and not last

    @torch.no_grad()
    def evaluate(self, model: nn.Module, train_rates: Callable[[], dict[str, float]]) -> dict | None:
        """NE, AUC and calibration per task; the result on rank 0, None elsewhere. `train_rates()` (a collective,
        called on every rank) gives the training split's positive rate per label, for the NE of predicting it."""
        start = time.perf_counter()
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
        rates = train_rates()
        gathered = self.ctx.gather_objects(local)
        if gathered is None:
            self.seconds = time.perf_counter() - start
            return None
        all_labels = np.concatenate([g[0] for g in gathered])
        all_logits = np.concatenate([g[1] for g in gathered])
        result = qm.task_metrics(all_labels, all_logits, self.task_names)
        for name in self.task_names:
            rate = rates.get(name)
            if rate is not None:  # NE of the constant prediction "training base rate", for reference
                y = all_labels[:, self.task_names.index(name)]
                result[name]["ne_train_base_rate_predictor"] = qm.normalized_entropy(y, np.full(len(y), rate))
        self.seconds = time.perf_counter() - start
        return {"tasks": result, "examples": int(len(all_labels))}
