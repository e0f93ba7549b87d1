"""Quality metrics on binary labels: normalized entropy (NE), ROC AUC, calibration.

NE = mean log loss of the predictions / entropy of the base rate. By default the base rate is the
positive rate of the labels being evaluated (the eval split), so a constant prediction of the observed
eval rate scores exactly 1.0 and lower is better.
"""

from __future__ import annotations

import math

import numpy as np

EPS = 1e-7


def log_loss(labels: np.ndarray, preds: np.ndarray) -> float:
    labels = np.asarray(labels, dtype=np.float64)
    p = np.clip(np.asarray(preds, dtype=np.float64), EPS, 1 - EPS)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log1p(-p)))


def binary_entropy(rate: float) -> float:
    if rate <= 0.0 or rate >= 1.0:
        return 0.0
    return -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


def normalized_entropy(labels: np.ndarray, preds: np.ndarray, base_rate: float | None = None) -> float:
    """NaN when there are no labels or the base rate is 0 or 1 (entropy 0: NE undefined)."""
    labels = np.asarray(labels, dtype=np.float64)
    if labels.size == 0:
        return float("nan")
    rate = float(labels.mean()) if base_rate is None else float(base_rate)
    entropy = binary_entropy(rate)
    if entropy == 0.0:
        return float("nan")
    return log_loss(labels, preds) / entropy


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Mann-Whitney AUC with tied scores counted as half; NaN when only one class is present."""
    labels = np.asarray(labels, dtype=np.float64) > 0.5
    scores = np.asarray(scores, dtype=np.float64)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # Average 1-based ranks over runs of equal scores.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [scores.size]])
    for start, end in zip(starts, ends):
        ranks[order[start:end]] = (start + end + 1) / 2.0
    rank_sum = ranks[labels].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def calibration(labels: np.ndarray, preds: np.ndarray) -> float:
    """Mean prediction / observed positive rate (1.0 = calibrated); NaN with no positives."""
    rate = float(np.mean(labels)) if np.size(labels) else 0.0
    return float(np.mean(preds) / rate) if rate > 0 else float("nan")


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def task_metrics(labels: np.ndarray, logits: np.ndarray, task_names: list[str]) -> dict[str, dict[str, float]]:
    """Per task: ne, auc, calibration, base_rate, log_loss, count; labels/logits are (N, num_tasks)."""
    preds = sigmoid(logits)
    out = {}
    for j, name in enumerate(task_names):
        y, p = labels[:, j], preds[:, j]
        out[name] = {
            "ne": normalized_entropy(y, p),
            "auc": roc_auc(y, p),
            "calibration": calibration(y, p),
            "base_rate": float(y.mean()) if y.size else float("nan"),
            "log_loss": log_loss(y, p) if y.size else float("nan"),
            "count": int(y.size),
        }
    return out


def logit_offsets(labels: np.ndarray, logits: np.ndarray, iterations: int = 25) -> np.ndarray:
    """Per task, the constant b minimizing the mean log loss of sigmoid(logits + b) (Newton's method; the loss is
    convex in b): at the optimum the mean prediction equals the observed rate. 0 for a task with one class only
    (no finite optimum) or no labels. labels/logits are (N, num_tasks); returns (num_tasks,)."""
    y = np.asarray(labels, dtype=np.float64)
    z = np.asarray(logits, dtype=np.float64)
    offsets = np.zeros(z.shape[1])
    rates = y.mean(0) if len(y) else np.zeros(z.shape[1])
    fit = (rates > 0) & (rates < 1)
    for _ in range(iterations):
        p = sigmoid(z + offsets)
        gradient, curvature = (p - y).sum(0), np.maximum((p * (1 - p)).sum(0), 1e-12)
        offsets = np.where(fit, offsets - np.clip(gradient / curvature, -4.0, 4.0), 0.0)
    return offsets
