"""MLflow logging for a training run (rank 0 only) and the run's plots.

Store: `--tracking-uri`, else `MLFLOW_TRACKING_URI`, else `sqlite:///mlruns.db` in the working directory.
A new experiment on a SQLite store keeps its artifacts in `mlartifacts/` beside the database file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gemrec.provenance import git_commit

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlruns.db"


def metric_key(name: str) -> str:
    """`name` as an MLflow metric name (letters, digits, _ - . space : / only): '@' is spelled `_at_` (hr@10 ->
    hr_at_10), any other character MLflow refuses is dropped."""
    return re.sub(r"[^\w\-. :/]", "", name.replace("@", "_at_"))


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


@contextlib.contextmanager
def store_lock(uri: str):
    """Hold an exclusive lock beside a SQLite store while it is created or migrated and the experiment made: two
    processes opening a new store at once otherwise race on MLflow's schema migration (one of them fails)."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.parent / f".{db.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class Tracker:
    """Logs to MLflow when `enabled` (rank 0); every method is a no-op on the other ranks. Keeps the run's train
    and eval records for the curves and the summary."""

    def __init__(
        self, enabled: bool, tracking_uri: str, experiment: str, run_name: str, resume_run_id: str | None = None
    ):
        """`resume_run_id`: continue that run (a resumed training) when it exists in this store."""
        self.enabled = enabled
        self.run_id: str | None = None
        self.resumed = False
        self.history: list[dict] = []  # one record per logged training window
        self.eval_history: list[dict] = []  # one flat record per evaluation
        if not enabled:
            return
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri)
        with store_lock(tracking_uri):
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

    # -- a training run ------------------------------------------------------------------------------------

    def log_start(self, config: dict, params: dict[str, Any], tags: dict[str, Any], seq_lengths, max_seq_len: int):
        """The resolved config (params and `config/config.json`), the run's tags, the history-length histogram."""
        self.log_params(params)
        self.set_tags(tags)
        self.log_dict(config, "config/config.json")
        if seq_lengths is not None and self.enabled:
            self.log_plot(plot_seq_lengths(seq_lengths, max_seq_len), "plots/seq_length_hist.png")

    def log_train(self, record: dict) -> None:
        """One training window's numbers (`step` plus loss, qps, mfu, ...) as `train/*`."""
        self.history.append(record)
        self.log_metrics({f"train/{k}": v for k, v in record.items() if k != "step"}, step=record["step"])

    def log_eval(self, step: int, result: dict | None, split: str = "eval") -> None:
        """An evaluation of `split` (`Evaluator.evaluate`'s result; None on ranks other than 0) as
        `<split>/<metric>_<task>` (`eval/ne_like`, `valid/auc_love`)."""
        if result is None:
            return
        flat: dict[str, Any] = {"step": step, "split": split}
        for name, values in result["tasks"].items():
            for key, value in values.items():
                flat[f"{key}_{name}"] = value
        self.eval_history.append(flat)
        self.log_metrics({f"{split}/{k}": v for k, v in flat.items() if k not in ("step", "split")}, step=step)
        log.info(
            "%s at step %d: %s",
            split,
            step,
            ", ".join(
                f"{n}: NE {v['ne']:.4f} AUC {v['auc']:.4f} calib {v['calibration']:.3f}"
                for n, v in result["tasks"].items()
            ),
        )

    def log_final(self, summary: dict, layer_rows: list[dict], peak: dict, seq_lengths, max_seq_len: int, model):
        """The final numbers, the curves, the layer-MFU plot and table, the summary and the model."""
        mfu = summary["mfu"]
        self.log_metrics(
            {
                "final/qps": summary["qps"],
                "final/tokens_per_s": summary["tokens_per_s"],
                "final/mfu_e2e": mfu["e2e"],
                "final/mfu_local": mfu["local"],
                "final/scaling_ratio": mfu["scaling_ratio"],
                **{f"final/data_{k}": v for k, v in summary["data"].items() if k != "source"},
                **{f"final/ne_{n}": v for n, v in summary["ne"].items()},
                **{f"final/auc_{n}": v for n, v in summary["auc"].items()},
                **({"final/peak_memory_gib": summary["peak_memory_gib"]} if summary.get("peak_memory_gib") else {}),
            },
            step=summary["steps"],
        )
        valid = summary.get("valid")
        if valid:
            self.log_metrics(
                {f"final/valid_best_{valid['metric']}": valid["best"], "final/best_step": valid["best_step"]},
                step=summary["steps"],
            )
            self.set_tags(
                {
                    "early_stopping": f"best valid {valid['metric']} {valid['best']:.4f} at step {valid['best_step']}"
                    f" of {summary['steps']} trained ({valid['max_steps']} at most"
                    + (", stopped early)" if valid["stopped_early"] else ")")
                }
            )
        if not self.enabled:
            return
        self.log_plot(plot_curves(self.history, self.eval_history), "plots/loss_ne_curves.png")
        if seq_lengths is not None:  # the data service gives no length table: plot what training saw
            self.log_plot(plot_seq_lengths(seq_lengths, max_seq_len), "plots/seq_length_hist.png")
        if layer_rows:
            self.log_plot(plot_layer_mfu(layer_rows, mfu["local"], mfu["e2e"]), "plots/layer_mfu.png")
        self.log_dict(
            {"layers": layer_rows, "local_mfu": mfu["local"], "e2e_mfu": mfu["e2e"], "peak": peak}, "mfu/layers.json"
        )
        self.log_dict(summary, "metrics/summary.json")
        if model is not None:
            self.log_model(model)

    def log_plot(self, figure, name: str) -> None:
        """Log a matplotlib figure and close it."""
        import matplotlib.pyplot as plt

        self.log_figure(figure, name)
        plt.close(figure)

    def finish(self, status: str = "FINISHED") -> None:
        if self.enabled:
            self.mlflow.end_run(status=status)
            self.enabled = False


def plot_curves(history: list[dict], eval_history: list[dict]):
    """Training loss and NE per logged step, valid and eval NE per task at each evaluation."""
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
    for split, style in (("valid", ".-"), ("eval", "o--")):
        records = [e for e in eval_history if e["split"] == split]
        for key in eval_keys:
            if records:
                ax_ne.plot([e["step"] for e in records], [e[key] for e in records], style, label=f"{split} {key[3:]}")
    ax_ne.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax_ne.set_xlabel("step")
    ax_ne.set_ylabel("NE (1.0 = base rate)")
    ax_ne.legend()
    fig.tight_layout()
    return fig


def plot_ne_comparison(ne: dict[str, dict[str, float | None]], base_rate: dict[str, float | None], tasks, title: str):
    """Eval NE per task of every arm (`ne`: arm -> task -> NE), beside `base_rate` (task -> the NE of predicting the
    training base rate) and the line NE = 1 (predicting the eval base rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(arm, [values.get(t) for t in tasks]) for arm, values in ne.items()]
    rows.append(("base rate (train)", [base_rate.get(t) for t in tasks]))
    fig, ax = plt.subplots(figsize=(2.0 + 1.6 * len(tasks) * len(rows) / 3, 3.6))
    width = 0.8 / len(rows)
    for i, (name, values) in enumerate(rows):
        xs = [j + i * width for j in range(len(tasks))]
        ax.bar(xs, [v if v is not None else float("nan") for v in values], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], [f"NE {t}" for t in tasks])
    ax.set_ylabel("eval NE (lower is better)")
    ax.set_title(title)
    ax.legend(fontsize=8)
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


def run_summary(
    *,
    recipe: str,
    arch: str,
    steps: int,
    world_size: int,
    final_eval: dict,
    totals: dict[str, float],
    data_waits: list[float],
    data_source: str,
    peak: dict,
    local_mfu: float,
    layer_rows: list[dict],
    train_loss: float,
    checkpoint: str | None,
    mlflow: dict,
    dataset: dict,
    valid: dict | None = None,
) -> dict:
    """The summary of a training run (the `--metrics-out` JSON, `metrics/summary.json` in MLflow).

    `totals`: examples, tokens, model FLOPs and seconds of the timed training windows, summed over ranks, and their
    steps, data wait (the slowest-fed rank's), batches read ahead and data-service CPU seconds; `data_waits`: this
    rank's wait for data at each timed step; `data_source`: "remote" (the data service) or "dataset" (in process);
    `peak`: `mfu.Peak.as_dict()` of one device; `valid`: what validation decided (`Trainer.valid_summary`), None
    without validation; `checkpoint`: the checkpoint of the evaluated weights (the best validated one)."""
    seconds, timed_steps = totals["seconds"], totals["steps"]
    waits_ms = 1000 * np.asarray(data_waits, dtype=np.float64)
    tasks = final_eval["tasks"]
    e2e = totals["flops"] / seconds / (peak["flops"] * world_size) if seconds else float("nan")
    return {
        "recipe": recipe,
        "arch": arch,
        "steps": steps,
        "world_size": world_size,
        "tasks": list(tasks),
        "ne": {n: v["ne"] for n, v in tasks.items()},
        "auc": {n: v["auc"] for n, v in tasks.items()},
        "calibration": {n: v["calibration"] for n, v in tasks.items()},
        "base_rate": {n: v["base_rate"] for n, v in tasks.items()},
        # NE of always predicting the training split's positive rate (the "base rate" arm).
        "ne_train_base_rate": {n: v.get("ne_train_base_rate_predictor") for n, v in tasks.items()},
        "eval_examples": final_eval["examples"],
        "qps": totals["examples"] / seconds if seconds else float("nan"),
        "tokens_per_s": totals["tokens"] / seconds if seconds else float("nan"),
        "mfu": {
            "e2e": e2e,
            "local": local_mfu,
            "scaling_ratio": e2e / local_mfu if local_mfu and np.isfinite(local_mfu) else float("nan"),
            "peak_flops": peak["flops"],
            "peak_source": peak["source"],
            "measured_peak_flops": peak["measured_flops"],
            "device": peak["device"],
            "layers": {r["name"]: r["mfu"] for r in layer_rows},
        },
        "data": {
            "source": data_source,
            "wait_ms_p50": float(np.percentile(waits_ms, 50)) if len(waits_ms) else float("nan"),
            "wait_ms_p99": float(np.percentile(waits_ms, 99)) if len(waits_ms) else float("nan"),
            "wait_share": totals["data_wait_s"] / seconds if seconds else float("nan"),
            "batches_in_flight": totals["in_flight"] / timed_steps if timed_steps else float("nan"),
            "service_cpu_ms_per_batch": 1000 * totals["build_cpu_s"] / timed_steps if timed_steps else float("nan"),
        },
        "train_loss": train_loss,
        # the most memory any rank's CUDA allocator held during training (None off CUDA)
        "peak_memory_gib": totals.get("peak_memory_gib") or None,
        "train_seconds": seconds,
        "timed_steps": int(timed_steps),
        "checkpoint": checkpoint,
        "valid": valid,
        "mlflow": mlflow,
        "dataset": dataset,
        "git_commit": git_commit(),
    }


def finite_or_none(value):
    """JSON-safe copy: NaN/Inf (undefined metrics) become null."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def write_summary(path: Path, summary: dict) -> None:
    """The summary as JSON (`--metrics-out`), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(finite_or_none(summary), indent=2))
    os.replace(tmp, path)
