"""MLflow side of the pipeline: finding and naming the training run, the champion model, promotion.

Store default: `sqlite:///mlruns.db` in the working directory (the trainer's default too), artifacts in
`mlartifacts/` beside the database file.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from gemrec.components.trainer.tracking import artifact_root as artifact_root
from gemrec.components.trainer.tracking import finite_or_none as finite_or_none
from gemrec.components.trainer.tracking import resolve_tracking_uri as resolve_tracking_uri
from gemrec.components.trainer.tracking import sqlite_path as sqlite_path
from gemrec.provenance import git_commit as git_commit

CHAMPION_ALIAS = "champion"


def run_name(recipe: str, commit: str) -> str:
    from gemrec.components.trainer.config import recipe_name

    return f"{recipe_name(recipe)}@{commit[:8]}"


def model_name(recipe: str) -> str:
    """One registered model per recipe (built-in name or .toml path): a `tiny` run never competes with a
    `movielens` champion."""
    from gemrec.components.trainer.config import recipe_name

    return f"gemrec-{recipe_name(recipe)}"


def client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def find_training_run(tracking_uri: str, experiment: str, started_after_ms: int) -> str:
    """The run the trainer created in `experiment` after `started_after_ms` (newest first)."""
    mlflow_client = client(tracking_uri)
    exp = mlflow_client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"the trainer created no MLflow experiment {experiment!r} in {tracking_uri}")
    runs = mlflow_client.search_runs(
        [exp.experiment_id],
        filter_string=f"attributes.start_time >= {started_after_ms}",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        raise LookupError(f"the trainer logged no MLflow run in experiment {experiment!r} at {tracking_uri}")
    return runs[0].info.run_id


HEADLINE = ("ne", "auc", "qps", "mfu")


def label_run(
    tracking_uri: str, run_id: str, name: str, tags: dict[str, str], numbers: dict[str, float], description: str
) -> None:
    """Name the run, describe it, add the tags and headline metrics the trainer did not set (never
    overwriting the trainer's values) and show its experiment in MLflow's model-training view."""
    mlflow_client = client(tracking_uri)
    run = mlflow_client.get_run(run_id)
    mlflow_client.update_run(run_id, name=name)
    for key, value in tags.items():
        if value and (key not in run.data.tags or run.data.tags[key] in ("", "unknown")):
            mlflow_client.set_tag(run_id, key, value)
    mlflow_client.set_tag(run_id, "mlflow.note.content", description)
    for key in HEADLINE:
        if key in numbers and key not in run.data.metrics:
            mlflow_client.log_metric(run_id, key, numbers[key])
    mlflow_client.set_experiment_tag(run.info.experiment_id, "mlflow.experimentKind", "custom_model_development")


def headline_text(key: str, value: float) -> str:
    """`NE 0.7591`, `QPS 388`, `MFU 3.99 %`."""
    if key == "mfu":
        return f"MFU {100 * value:.2f} %"
    if key == "qps":
        return f"QPS {value:,.0f}"
    return f"{key.upper()} {value:.4f}"


def describe(recipe: str, commit: str, dataset_checksum: str, numbers: dict[str, float]) -> str:
    """The run's description (markdown) in the MLflow UI."""
    rows = "\n".join(
        f"| {key.upper()} | {headline_text(key, numbers[key]).split(' ', 1)[1]} |" for key in HEADLINE if key in numbers
    )
    return (
        f"**gemrec-train** pipeline run, recipe `{recipe}`, commit `{commit[:12]}`, dataset `{dataset_checksum[:19]}`."
        f"\n\n| metric | value |\n|---|---|\n{rows}\n\nNE is eval normalized entropy (lower is better), "
        "QPS training examples per second, MFU model FLOP utilization."
    )


@dataclass
class Champion:
    version: str
    run_id: str
    ne: float | None
    dataset_checksum: str


def champion(tracking_uri: str, name: str) -> Champion | None:
    from mlflow.exceptions import MlflowException

    mlflow_client = client(tracking_uri)
    try:
        version = mlflow_client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    except MlflowException:
        return None
    tags = version.tags or {}
    ne = float(tags["ne"]) if "ne" in tags else None
    return Champion(str(version.version), version.run_id, ne, tags.get("dataset_checksum", ""))


def decide(candidate_ne: float, current: Champion | None, dataset_checksum: str) -> tuple[bool, str]:
    """Whether the candidate becomes champion, and why (lower NE is better)."""
    if current is None:
        return True, f"no champion yet: the first model (NE {candidate_ne:.4f}) becomes champion"
    if current.ne is None:
        return True, f"champion v{current.version} has no recorded NE: replaced by NE {candidate_ne:.4f}"
    same_data = " (same dataset)" if current.dataset_checksum == dataset_checksum else " (different dataset)"
    if candidate_ne < current.ne:
        return True, (f"NE improved {current.ne:.4f} -> {candidate_ne:.4f} over champion v{current.version}{same_data}")
    return False, (
        f"NE {candidate_ne:.4f} does not improve on champion v{current.version} NE {current.ne:.4f}"
        f"{same_data}: alias stays"
    )


def log_baselines(
    tracking_uri: str,
    run_id: str,
    numbers: dict[str, float],
    baselines: dict[str, float],
    labels: list[str],
    recipe: str,
) -> None:
    """Into GEM's run: the baselines' metrics (`baseline/<arm>/<metric>_<label>`, `steps.baseline_metrics`), a tag
    with the first label's NEs and `plots/baselines.png` (GEM's eval NE per label beside every baseline's)."""
    import matplotlib.pyplot as plt
    from gemrec.components.trainer.tracking import plot_ne_comparison
    from mlflow.entities import Metric

    mlflow_client = client(tracking_uri)
    now = int(time.time() * 1000)
    mlflow_client.log_batch(run_id, metrics=[Metric(key, value, now, 0) for key, value in baselines.items()])
    arms = sorted({key.split("/")[1] for key in baselines} - {"base_rate"})
    ne = {"gem": {label: numbers.get(f"ne_{label}") for label in labels}}
    ne.update({arm: {label: baselines.get(f"baseline/{arm}/ne_{label}") for label in labels} for arm in arms})
    base_rate = {label: baselines.get(f"baseline/base_rate/ne_{label}") for label in labels}
    mlflow_client.set_tag(
        run_id,
        "gemrec.baselines",
        f"eval NE {labels[0]}: "
        + ", ".join(f"{arm} {values[labels[0]]:.4f}" for arm, values in ne.items() if values[labels[0]] is not None),
    )
    fig = plot_ne_comparison(ne, base_rate, labels, f"recipe {recipe}: GEM beside the baselines (same dataset)")
    mlflow_client.log_figure(run_id, fig, "plots/baselines.png")
    plt.close(fig)


def model_uri(tracking_uri: str, run_id: str) -> str:
    """The model the trainer logged in the run (an MLflow PyTorch model named `model`)."""
    mlflow_client = client(tracking_uri)
    models = mlflow_client.search_logged_models(
        experiment_ids=[mlflow_client.get_run(run_id).info.experiment_id],
        filter_string=f"source_run_id = '{run_id}'",
        max_results=1,
    )
    if models:
        return f"models:/{models[0].model_id}"
    names = {a.path for a in mlflow_client.list_artifacts(run_id)}
    if "model" in names:
        return f"runs:/{run_id}/model"
    raise LookupError(f"MLflow run {run_id} has no logged model to register")


def register(
    tracking_uri: str,
    run_id: str,
    name: str,
    metrics: dict[str, float],
    promote: bool,
    reason: str,
    dataset_checksum: str,
    recipe: str,
) -> str:
    """Register the run's model as a new version; move the champion alias when `promote`. Returns the version."""
    mlflow_client = client(tracking_uri)
    if not mlflow_client.search_registered_models(filter_string=f"name = '{name}'"):
        mlflow_client.create_registered_model(
            name,
            description=f"gemrec model trained with the `{recipe}` recipe by the gemrec-train pipeline. "
            f"The `{CHAMPION_ALIAS}` alias points at the version with the lowest eval NE.",
        )
    uri = model_uri(tracking_uri, run_id)
    if uri.startswith("models:/"):  # an MLflow 3 logged model: register its artifacts and link it
        logged = mlflow_client.get_logged_model(uri[len("models:/") :])
        version = mlflow_client.create_model_version(
            name, logged.artifact_location, run_id=run_id, tags={"recipe": recipe}, model_id=logged.model_id
        ).version
    else:
        version = mlflow_client.create_model_version(name, uri, run_id=run_id, tags={"recipe": recipe}).version
    summary = ", ".join(headline_text(k, v) for k, v in metrics.items())
    mlflow_client.update_model_version(name, version, description=f"{summary}. {reason}.")
    for key, value in metrics.items():
        mlflow_client.set_model_version_tag(name, version, key, f"{value:.6g}")
    mlflow_client.set_model_version_tag(name, version, "dataset_checksum", dataset_checksum)
    mlflow_client.set_model_version_tag(name, version, "promotion", reason)
    if promote:
        mlflow_client.set_registered_model_alias(name, CHAMPION_ALIAS, version)
        mlflow_client.update_registered_model(
            name,
            description=f"gemrec model trained with the `{recipe}` recipe by the gemrec-train pipeline. "
            f"Champion: version {version} with {summary}.",
        )
    mlflow_client.set_tag(run_id, "gemrec.registered_model", f"{name}/{version}")
    mlflow_client.set_tag(run_id, "gemrec.champion_decision", "promoted" if promote else "kept")
    mlflow_client.set_tag(run_id, "gemrec.champion_reason", reason)
    mlflow_client.log_text(
        run_id,
        json.dumps(
            {"promoted": promote, "reason": reason, "model": name, "version": version, "metrics": metrics}, indent=2
        ),
        "champion_decision.json",
    )
    return str(version)


def metrics_from_run(logged: dict[str, float]) -> dict:
    """The trainer's metrics-out shape (`ne`/`auc` per label, `qps`, `mfu`) rebuilt from its `final/*` metrics."""
    import re

    out: dict = {}
    for key, value in logged.items():
        match = re.fullmatch(r"final/(ne|auc)_(\w+)", key)
        if match:
            out.setdefault(match.group(1), {})[match.group(2)] = value
        elif key in ("final/qps", "final/tokens_per_s"):
            out[key.split("/")[1]] = value
        elif key in ("final/mfu_e2e", "final/mfu_local", "final/scaling_ratio"):
            out.setdefault("mfu", {})[key.split("/")[1].removeprefix("mfu_")] = value
    return out
