"""MLflow logging for a training run (rank 0 only) and the run's plots.

Store: `--tracking-uri`, else `MLFLOW_TRACKING_URI`, else `sqlite:///mlruns.db` in the working directory.
A new experiment on a SQLite store keeps its artifacts in `mlartifacts/` beside the database file.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlruns.db"
REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_tracking_uri(uri: str | None = None) -> str:
    """The store URI (flag, $MLFLOW_TRACKING_URI, default) with a relative SQLite path made absolute."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///") :]).resolve())
    return uri


def sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def artifact_root(uri: str) -> Path | None:
    """Where runs of a SQLite store keep their artifacts: `mlartifacts/` beside the database file."""
    db = sqlite_path(uri)
    return db.resolve().parent / "mlartifacts" if db is not None else None


def git_commit() -> str:
    """$GEMREC_GIT_COMMIT (set in container images, which have no .git), else this checkout's HEAD."""
    if os.environ.get("GEMREC_GIT_COMMIT"):
        return os.environ["GEMREC_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Tracker:
    """Logs to MLflow when `enabled` (rank 0); every method is a no-op on the other ranks."""

    def __init__(
        self, enabled: bool, tracking_uri: str, experiment: str, run_name: str, resume_run_id: str | None = None
    ):
        """`resume_run_id`: continue that run (a resumed training) when it exists in this store."""
        self.enabled = enabled
        self.run_id: str | None = None
        self.resumed = False
        if not enabled:
            return
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri)
        if mlflow.get_experiment_by_name(experiment) is None:
            root = artifact_root(tracking_uri)
            mlflow.create_experiment(experiment, artifact_location=root.as_uri() if root else None)
        mlflow.set_experiment(experiment)
        if resume_run_id is not None:
            try:
                mlflow.get_run(resume_run_id)
                self.resumed = True
            except mlflow.exceptions.MlflowException:
                log.info(
                    "MLflow run %s of the checkpoint is not in %s: starting a new run", resume_run_id, tracking_uri
                )
        self.run = mlflow.start_run(run_id=resume_run_id) if self.resumed else mlflow.start_run(run_name=run_name)
        self.run_id = self.run.info.run_id
        log.info(
            "MLflow run %s%s in experiment %r at %s",
            self.run_id,
            " (resumed)" if self.resumed else "",
            experiment,
            tracking_uri,
        )

    def log_params(self, params: dict[str, Any]) -> None:
        if self.enabled:
            self.mlflow.log_params(
                {k: json.dumps(v) if isinstance(v, (list, tuple, dict)) else v for k, v in params.items()}
            )

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.enabled:
            self.mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
            finite = {k: float(v) for k, v in metrics.items() if v is not None and np.isfinite(v)}
            if finite:
                self.mlflow.log_metrics(finite, step=step)

    def log_dict(self, data: dict, name: str) -> None:
        if self.enabled:
            self.mlflow.log_dict(data, name)

    def log_text(self, text: str, name: str) -> None:
        if self.enabled:
            self.mlflow.log_text(text, name)

    def log_figure(self, figure, name: str) -> None:
        if self.enabled:
            self.mlflow.log_figure(figure, name)

    def log_model(self, model, name: str = "model") -> None:
        """The trained model as an MLflow PyTorch model (pickled module + its state dict)."""
        if not self.enabled:
            return
        import mlflow.pytorch
        import torch

        mlflow.pytorch.log_model(
            model,
            name=name,
            serialization_format="pickle",
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "state_dict.pt"
            torch.save(model.state_dict(), path)
            self.mlflow.log_artifact(str(path), artifact_path="checkpoint")

    def finish(self, status: str = "FINISHED") -> None:
        if self.enabled:
            self.mlflow.end_run(status=status)
            self.enabled = False


def plot_curves(history: list[dict], eval_history: list[dict]):
    """Training loss and NE per logged step, eval NE per task at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ne) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [h["step"] for h in history]
    ax_loss.plot(steps, [h["loss"] for h in history], label="train loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (BCE, summed over tasks)")
    ax_loss.legend()
    ne_keys = sorted({k for h in history for k in h if k.startswith("ne_")})
    for key in ne_keys:
        ax_ne.plot(steps, [h.get(key, np.nan) for h in history], label=f"train {key[3:]}")
    eval_keys = sorted({k for e in eval_history for k in e if k.startswith("ne_")})
    for key in eval_keys:
        ax_ne.plot([e["step"] for e in eval_history], [e[key] for e in eval_history], "o--", label=f"eval {key[3:]}")
    ax_ne.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax_ne.set_xlabel("step")
    ax_ne.set_ylabel("NE (1.0 = base rate)")
    ax_ne.legend()
    fig.tight_layout()
    return fig


def plot_layer_mfu(rows: list[dict], local_mfu: float, e2e_mfu: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows) + 3), 4.5))
    names = [r["name"] for r in rows]
    ax.bar(range(len(rows)), [100 * r["mfu"] for r in rows])
    ax.axhline(100 * local_mfu, color="C1", ls="--", label=f"local MFU {100 * local_mfu:.1f}%")
    ax.axhline(100 * e2e_mfu, color="C2", ls=":", label=f"E2E MFU {100 * e2e_mfu:.1f}%")
    ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("MFU % (layer alone, fwd+bwd)")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_seq_lengths(lengths: np.ndarray, max_seq_len: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(lengths, bins=min(50, max(1, max_seq_len)), range=(0, max_seq_len))
    ax.set_xlabel(f"history length (tokens, capped at {max_seq_len})")
    ax.set_ylabel("examples")
    ax.set_title(f"mean {np.mean(lengths):.1f}, p90 {np.percentile(lengths, 90):.0f}" if len(lengths) else "")
    fig.tight_layout()
    return fig
