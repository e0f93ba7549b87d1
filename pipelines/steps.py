"""The work behind each pipeline step. Components (components.py) are thin wrappers around these.

Every step runs inside `step_guard`, which writes `<run_dir>/failure.json` (step and cause) when the step
fails, so the runner can name the step and the cause in one line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from gemrec.components.common.ports import free_port
from gemrec.config import ConfigError, Section

from . import tracking
from .services import (
    LOCALHOST,
    ProcessGroup,
    ServiceError,
    claim_ports,
    gemrec_command,
    gemrec_executable,
)

FAILURE_FILE = "failure.json"


class StepError(RuntimeError):
    """A step failed for a reason the user can act on (the message is the cause)."""


@contextlib.contextmanager
def step_guard(run_dir: str, step: str):
    started = time.monotonic()
    print(f"[gemrec] step {step}: started", flush=True)
    try:
        yield
    except BaseException as err:
        known = isinstance(err, (StepError, ServiceError, ConfigError))
        cause = str(err) if known else f"{type(err).__name__}: {err}"
        if run_dir:
            path = Path(run_dir) / FAILURE_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():  # the first failure is the cause
                path.write_text(json.dumps({"step": step, "cause": cause}, indent=2))
        print(f"[gemrec] step {step}: FAILED: {cause}", file=sys.stderr, flush=True)
        if known:
            raise SystemExit(1) from None  # the cause is known: no traceback
        raise
    print(f"[gemrec] step {step}: done in {time.monotonic() - started:.1f} s", flush=True)


# ---- ingest ---------------------------------------------------------------------------------------------


def ingest(data: str, out: str, publish_dir: str = "") -> dict[str, Any]:
    """Prepare a dataset folder at `out` from raw MovieLens (`data` holds ratings.csv) or copy a prepared one.

    `publish_dir` (cluster): also place the dataset where the service Deployments read it, swapped in whole.
    """
    source = Path(data)
    if not source.exists():
        raise StepError(f"data path {source} does not exist")
    if (source / "manifest.json").is_file():
        shutil.copytree(source, out)
    elif (source / "ratings.csv").is_file():
        from gemrec.components.data_service.errors import DataError
        from gemrec.components.data_service.movielens import prepare_movielens

        try:
            prepare_movielens(Path(out), raw=source, progress=False)
        except DataError as err:
            raise StepError(f"cannot prepare {source}: {err}") from err
    else:
        raise StepError(f"{source} is neither a prepared dataset (manifest.json) nor raw MovieLens (ratings.csv)")
    if publish_dir:
        publish(Path(out), Path(publish_dir))
    return json.loads((Path(out) / "manifest.json").read_text())


def publish(dataset: Path, target: Path) -> None:
    """Copy `dataset` to `target`, replacing what was there only once the copy is complete."""
    staging = target.with_name(target.name + ".incoming")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(dataset, staging)
    previous = target.with_name(target.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    if target.exists():
        target.rename(previous)
    staging.rename(target)
    shutil.rmtree(previous, ignore_errors=True)


# ---- validate -------------------------------------------------------------------------------------------

REQUIRED_SPLITS = ("train", "eval")


EXAMPLE_COLUMNS = ("user", "event", "hist_start", "hist_end", "timestamp")


def validate(dataset: str) -> dict[str, float]:
    """Schema and statistics checks; raise StepError listing every problem found. Returns statistics."""
    import pyarrow.parquet as pq
    from gemrec.components.data_service.builder import read_manifest
    from gemrec.components.data_service.errors import DataError
    from gemrec.model.config import FeatureSchema

    try:
        m = read_manifest(dataset)
    except DataError as err:
        raise StepError(f"dataset schema: {err}") from err
    problems = FeatureSchema.manifest_problems(m)  # what the model needs of the features and labels
    labels = m.get("labels", [])
    stats: dict[str, float] = {"num_events": m["num_events"], "num_users": m["num_users"], "num_items": m["num_items"]}
    for split in REQUIRED_SPLITS:
        if split not in m.get("splits", {}):
            problems.append(f"split {split!r} is missing")
            continue
        count = int(m["splits"][split]["num_examples"])
        stats[f"{split}_examples"] = count
        if count == 0:
            problems.append(f"split {split!r} has no examples")
        path = Path(dataset) / "examples" / f"{split}.parquet"
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        meta = pq.read_metadata(path)
        if meta.num_rows != count:
            problems.append(f"{path.name} has {meta.num_rows} rows but the manifest says {count}")
        columns = set(meta.schema.to_arrow_schema().names)
        missing = [c for c in (*EXAMPLE_COLUMNS, *labels) if c not in columns]
        if missing:
            problems.append(f"{path.name} lacks column(s) {', '.join(missing)}")
    rates = m.get("label_rates", {})
    for label in labels:
        rate = (rates.get("train") or {}).get(label)
        if rate is None:
            continue
        stats[f"train_rate_{label}"] = rate
        if not 0.0 < rate < 1.0:
            problems.append(f"label {label!r} has base rate {rate} in train: NE is undefined (need 0 < rate < 1)")
    stats.update({f"seq_len_{k}": v for k, v in m.get("max_seq_len", {}).items()})
    if problems:
        raise StepError(f"dataset {m.get('name')} at {dataset} failed validation: " + "; ".join(problems))
    return stats


# ---- materialize ----------------------------------------------------------------------------------------


def materialize(dataset: str, store: str, redis_url: str) -> dict[str, Any]:
    """Load the online features from the dataset; with the Redis store, write them into Redis."""
    from gemrec.components.feature_service.store import MemoryStore
    from gemrec.components.feature_service.store import materialize as to_redis

    memory = MemoryStore(dataset)
    info = {
        "store": store,
        "dataset_checksum": memory.schema.dataset_checksum,
        "entities": {n: {"ids": e.num_ids, "features": len(e.features)} for n, e in memory.schema.entities.items()},
    }
    if store == "redis":
        if not redis_url:
            raise StepError("the redis feature store needs --redis-url")
        try:
            info.update(to_redis(memory, redis_url, progress=False))
        except Exception as err:
            raise StepError(f"cannot materialize features into Redis at {redis_url}: {err}") from err
        info["redis_url"] = redis_url
    elif store != "memory":
        raise StepError(f"unknown feature store {store!r}: use memory or redis")
    return info


# ---- train ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSpec(Section):
    """Everything the pipeline's train step is told, in one typed definition. The KFP `train` component's flat
    parameters (what the KFP UI shows) are these fields, checked against this class by a test, and the component
    hands them over as one `TrainSpec`."""

    SECTION: ClassVar[str] = "train_step"

    mode: Literal["local", "pod", "trainjob"] = "local"  # local services + torchrun | torchrun in a GPU pod | TrainJob
    recipe: str = "tiny"  # a built-in recipe name or a .toml path (components/trainer/recipes)
    nproc: int = 1  # trainer processes per node (torchrun --nproc_per_node)
    tracking_uri: str = "sqlite:///mlruns.db"
    experiment: str = "gemrec-train"
    run_dir: str = "runs/local"  # the pipeline run's folder (logs, trainer metrics, checkpoints)
    feature_port: int = 0  # local: the feature service's port (0 = a free one)
    data_port: int = 0  # local: the data service's port (0 = a free one)
    data_addr: str = ""  # cluster: the data service Deployment
    feature_addr: str = ""  # cluster: the feature service Deployment
    trainer_image: str = ""  # trainjob: the trainer nodes' image
    namespace: str = "gemrec"  # trainjob: where the TrainJob is created
    num_nodes: int = 1  # trainjob: nodes
    gpus_per_node: int = 0  # trainjob: GPUs requested per node
    pipeline_run: str = ""  # the KFP run's name (labels, TrainJob name)

    def check(self) -> None:
        for key in ("nproc", "num_nodes"):
            self.require(getattr(self, key) >= 1, key, "must be at least 1")
        for key in ("feature_port", "data_port"):
            self.require(0 <= getattr(self, key) <= 65535, key, "must be a port in [0, 65535] (0 = any free port)")
        self.require(self.gpus_per_node >= 0, "gpus_per_node", "must be >= 0")

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any]) -> TrainSpec:
        """The spec from a KFP component's inputs (its `locals()`): every field, nothing else."""
        return cls.from_dict({k: v for k, v in inputs.items() if k in cls.keys()})

    def torchrun(self, data_addr: str, metrics_out: str, *rendezvous: str) -> list[str]:
        """`torchrun` of `nproc` trainer processes: `gemrec train` over the data service at `data_addr`, metrics to
        `metrics_out`, checkpoints beside it; `rendezvous`: torchrun's own flags (master address and port)."""
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(self.nproc),
            *rendezvous,
            "--no-python",
            gemrec_executable(),
            "train",
            "--data-addr",
            data_addr,
            "--recipe",
            self.recipe,
            "--tracking-uri",
            self.tracking_uri,
            "--experiment",
            self.experiment,
            "--metrics-out",
            metrics_out,
            "--run-dir",
            str(Path(metrics_out).parent / "trainer"),
        ]


def train_local(spec: TrainSpec, dataset: str, features: dict, metrics_out: str) -> dict[str, Any]:
    """Start the feature and data services on 127.0.0.1, run the trainer under torchrun, stop the services.

    Returns the trainer's metrics JSON plus `run_id` (its MLflow run).
    """
    from gemrec.components.trainer.config import balance_linear_weight, load_recipe

    try:  # before any service starts; the data service balances ranks for this model
        linear_weight = balance_linear_weight(load_recipe(spec.recipe))
    except ValueError as err:  # ConfigError: the recipe or one of its values
        raise StepError(f"recipe {spec.recipe!r}: {err}") from err
    logs = Path(spec.run_dir) / "logs"
    feature_port, data_port = claim_ports([(spec.feature_port, "feature service"), (spec.data_port, "data service")])
    feature_addr, data_addr = f"{LOCALHOST}:{feature_port}", f"{LOCALHOST}:{data_port}"
    store = ["--store", "redis", "--redis-url", features["redis_url"]] if features.get("store") == "redis" else []
    started_ms = int(time.time() * 1000)
    with ProcessGroup() as group:
        print(f"[gemrec] starting feature service on {feature_addr}", flush=True)
        group.start_service(
            "feature service",
            gemrec_command("serve", "features", "--dataset", dataset, "--port", str(feature_port), *store),
            feature_addr,
            logs / "feature-service.log",
        )
        print(f"[gemrec] starting data service on {data_addr}", flush=True)
        group.start_service(
            "data service",
            gemrec_command(
                "serve",
                "data",
                "--dataset",
                dataset,
                "--port",
                str(data_port),
                "--features",
                feature_addr,
                "--linear-weight",
                str(linear_weight),
            ),
            data_addr,
            logs / "data-service.log",
        )
        print(f"[gemrec] training with torchrun --nproc_per_node {spec.nproc}", flush=True)
        torchrun = spec.torchrun(data_addr, metrics_out, "--master_addr", LOCALHOST, "--master_port", str(free_port()))
        trainer = group.start(
            "trainer",
            torchrun,
            logs / "trainer.log",
            env={
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "GEMREC_FEATURE_ADDR": feature_addr,
                "GEMREC_DATA_ADDR": data_addr,
            },
            echo=True,
        )
        code = trainer.stream()
        if code != 0:
            raise StepError(
                f"the trainer exited with code {code}: {last_error(trainer.log_path)} (log: {trainer.log_path})"
            )
        for process in group.processes[:2]:
            if not process.alive():
                raise StepError(f"the {process.name} died during training (log: {process.log_path})")
    return with_run_id(read_trainer_metrics(metrics_out), spec.tracking_uri, spec.experiment, started_ms)


# torchrun prefixes worker output with "[rankN]: ".
ERROR_LINE = re.compile(r"^(\[rank\d+\]:)?\s*(gemrec \w+: error: .*|([\w.]+\.)?\w*(Error|Exception): .*)$")


def last_error(log_path: Path) -> str:
    """The trainer's own error line from its log (not torchrun's ChildFailedError wrapper)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "no log"
    errors = [
        " ".join(m.group(1, 2)) if m.group(1) else m.group(2)
        for line in lines
        if (m := ERROR_LINE.match(line)) and "ChildFailedError" not in line
    ]
    cli_errors = [line for line in errors if "gemrec " in line and ": error: " in line]
    return (cli_errors or errors or ["see the log"])[-1]


def with_run_id(result: dict[str, Any], tracking_uri: str, experiment: str, started_ms: int) -> dict[str, Any]:
    """The trainer's metrics with `run_id`: the one it reports, else its newest run in the experiment."""
    run_id = (result.get("mlflow") or {}).get("run_id")
    result["run_id"] = run_id or tracking.find_training_run(tracking_uri, experiment, started_ms)
    return result


def read_trainer_metrics(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as err:
        raise StepError(f"the trainer finished but wrote no metrics to {path}") from err
    except json.JSONDecodeError as err:
        raise StepError(f"the trainer's metrics file {path} is not JSON: {err}") from err


def headline(metrics: dict[str, Any], labels: list[str]) -> dict[str, float]:
    """Flat numbers for KFP Metrics and the summary: NE/AUC of the primary label (the first) and per label."""
    out: dict[str, float] = {}
    primary = labels[0] if labels else None
    for key in ("ne", "auc"):
        value = metrics.get(key)
        if isinstance(value, dict):
            for label, v in value.items():
                out[f"{key}_{label}"] = float(v)
            first = primary if primary in value else next(iter(value), None)
            if first is not None:
                out[key] = float(value[first])
        elif value is not None:
            out[key] = float(value)
    for key in ("qps", "tokens_per_s"):
        if isinstance(metrics.get(key), (int, float)):
            out[key] = float(metrics[key])
    mfu = metrics.get("mfu")
    if isinstance(mfu, dict):  # {"e2e", "local", "scaling_ratio", ...}: MFU means end-to-end MFU
        for key, name in (("e2e", "mfu"), ("local", "local_mfu"), ("scaling_ratio", "scaling_ratio")):
            if isinstance(mfu.get(key), (int, float)):
                out[name] = float(mfu[key])
    elif isinstance(mfu, (int, float)):
        out["mfu"] = float(mfu)
    return {k: v for k, v in out.items() if math.isfinite(v)}


def require_ne(numbers: dict[str, float]) -> float:
    if "ne" not in numbers:
        raise StepError(f"the trainer reported no NE (metrics: {', '.join(numbers) or 'none'})")
    return numbers["ne"]


def train_in_pod(spec: TrainSpec, metrics_out: str) -> dict[str, Any]:
    """Cluster, one node: torchrun in this (GPU) pod against the cluster's data service."""
    started_ms = int(time.time() * 1000)
    log_path = Path(metrics_out).parent / "trainer.log"
    with ProcessGroup() as group:
        code = group.start("trainer", spec.torchrun(spec.data_addr, metrics_out), log_path, echo=True).stream()
    if code != 0:
        raise StepError(f"the trainer exited with code {code}: {last_error(log_path)}")
    return with_run_id(read_trainer_metrics(metrics_out), spec.tracking_uri, spec.experiment, started_ms)


def train_trainjob(spec: TrainSpec) -> dict[str, Any]:
    """Cluster, many nodes: a Kubeflow TrainJob; the metrics come back through the MLflow run."""
    from . import trainjob

    started_ms = int(time.time() * 1000)
    job = trainjob.TrainJobSpec(
        name=trainjob.job_name(spec.pipeline_run),
        image=spec.trainer_image,
        recipe=spec.recipe,
        data_addr=spec.data_addr,
        feature_addr=spec.feature_addr,
        tracking_uri=spec.tracking_uri,
        experiment=spec.experiment,
        num_nodes=spec.num_nodes,
        nproc_per_node=spec.nproc,
        gpus_per_node=spec.gpus_per_node,
        labels={"gemrec/pipeline-run": spec_label(spec.pipeline_run)},
    )
    try:
        trainjob.run(job, spec.namespace)
    except trainjob.TrainJobError as err:
        raise StepError(str(err)) from err
    run_id = tracking.find_training_run(spec.tracking_uri, spec.experiment, started_ms)
    logged = tracking.client(spec.tracking_uri).get_run(run_id).data.metrics
    return {**tracking.metrics_from_run(logged), "run_id": run_id, "trainjob": f"{spec.namespace}/{job.name}"}


def spec_label(value: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in value)[:63].strip("-_.") or "none"


def train(spec: TrainSpec, dataset: str, features: dict, dataset_checksum: str, labels: list[str]) -> dict[str, Any]:
    """Dispatch on `spec.mode` (local | pod | trainjob), then name and tag the MLflow run."""
    metrics_out = str(Path(spec.run_dir) / "trainer-metrics.json")
    Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
    if spec.mode == "local":
        result = train_local(spec, dataset, features, metrics_out)
    elif spec.mode == "pod":
        result = train_in_pod(spec, metrics_out)
    else:
        result = train_trainjob(spec)
    numbers = headline(result, labels)
    require_ne(numbers)
    if isinstance(result.get("mfu"), dict) and "device" in result["mfu"]:
        result.setdefault("device", result["mfu"]["device"])
    commit = result.get("git_commit") or tracking.git_commit()  # the commit the trainer ran
    tracking.label_run(
        spec.tracking_uri,
        result["run_id"],
        tracking.run_name(spec.recipe, commit),
        {
            "git_commit": commit,
            "dataset_checksum": dataset_checksum,
            "device": result.get("device", ""),
            "pipeline": "gemrec-train",
            "pipeline_run": spec.pipeline_run,
            "recipe": spec.recipe,
            "train_mode": spec.mode,
        },
        numbers,
        tracking.describe(spec.recipe, commit, dataset_checksum, numbers),
    )
    return {
        "run_id": result["run_id"],
        "numbers": numbers,
        "trainer": result,
        "git_commit": commit,
        "dataset_checksum": dataset_checksum,
    }


# ---- baselines ------------------------------------------------------------------------------------------

BASELINE_ARMS = ("dlrm", "gbdt")


def baselines(dataset: str, recipe: str, run_dir: str) -> dict[str, dict]:
    """Train the baselines (`BASELINE_ARMS`) with the recipe on the dataset, in this process on the CPU and without
    MLflow (the evaluate step logs them into GEM's run): arm -> its run summary (eval NE/AUC/calibration per label)."""
    from gemrec.cli import CLIError
    from gemrec.components.trainer.bench import train_arms
    from gemrec.components.trainer.config import load_recipe

    try:
        configs = {arm: load_recipe(recipe, ["train.local_mfu=false"], arch=arm) for arm in BASELINE_ARMS}
    except ValueError as err:  # ConfigError: the recipe or one of its values
        raise StepError(f"recipe {recipe!r}: {err}") from err
    try:
        results = train_arms(
            configs,
            Path(dataset),
            Path(run_dir) / "baselines",
            tracking_uri=None,
            experiment="",
            device="cpu",
            progress=False,
            tracking=False,
        )
    except CLIError as err:
        raise StepError(f"baselines: {err}") from err
    for arm, summary in results.items():
        ne = ", ".join(f"{label} {value:.4f}" for label, value in summary["ne"].items())
        print(f"[gemrec] baseline {arm}: eval NE {ne} ({summary['wall_seconds']:.0f} s)", flush=True)
    return {arm: tracking.finite_or_none(summary) for arm, summary in results.items()}


def baseline_metrics(results: dict[str, dict]) -> dict[str, float]:
    """`baseline/<arm>/<ne|auc|calibration>_<label>` of every baseline, and `baseline/base_rate/ne_<label>` (the NE
    of predicting the training base rate), as logged into GEM's MLflow run."""
    out: dict[str, float] = {}
    for arm, summary in results.items():
        for key in ("ne", "auc", "calibration"):
            for label, value in summary[key].items():
                out[f"baseline/{arm}/{key}_{label}"] = value
        for label, value in summary["ne_train_base_rate"].items():
            out[f"baseline/base_rate/ne_{label}"] = value
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(v)}


# ---- evaluate and register ------------------------------------------------------------------------------


def evaluate(
    candidate: dict,
    tracking_uri: str,
    recipe: str,
    dataset_checksum: str,
    labels: list[str],
    baseline_results: dict[str, dict],
) -> dict[str, Any]:
    """The champion decision on GEM's eval NE; GEM's MLflow run gets the baselines beside it (metrics, a PNG)."""
    ne = require_ne(candidate["numbers"])
    current = tracking.champion(tracking_uri, tracking.model_name(recipe))
    promote, reason = tracking.decide(ne, current, dataset_checksum)
    metrics = {"candidate_ne": ne, "promote": float(promote)}
    if current is not None and current.ne is not None:
        metrics.update({"champion_ne": current.ne, "ne_improvement": current.ne - ne})
    logged = baseline_metrics(baseline_results)
    versus = {
        arm: logged[key]
        for arm in (*baseline_results, "base_rate")
        if (key := f"baseline/{arm}/ne_{labels[0]}") in logged
    }
    metrics.update({f"{arm}_ne": value for arm, value in versus.items()})
    tracking.log_baselines(tracking_uri, candidate["run_id"], candidate["numbers"], logged, labels, recipe)
    others = ", ".join(f"{arm.replace('_', ' ')} {value:.4f}" for arm, value in versus.items())
    print(f"[gemrec] eval NE {labels[0]}: gem {ne:.4f}, {others}", flush=True)
    print(f"[gemrec] {reason}", flush=True)
    return {
        "promote": promote,
        "reason": reason,
        "metrics": metrics,
        "champion_version": current.version if current else None,
        "baselines": versus,
    }


def register(
    candidate: dict, verdict: dict, tracking_uri: str, recipe: str, run_dir: str, ui_address: str
) -> dict[str, Any]:
    name = tracking.model_name(recipe)
    numbers = candidate["numbers"]
    won_with = {k: numbers[k] for k in ("ne", "auc", "qps", "mfu") if k in numbers}
    version = tracking.register(
        tracking_uri,
        candidate["run_id"],
        name,
        won_with,
        verdict["promote"],
        verdict["reason"],
        candidate["dataset_checksum"],
        recipe,
    )
    summary = {
        "status": "succeeded",
        "model": name,
        "version": version,
        "model_uri": f"models:/{name}/{version}",
        "promoted": verdict["promote"],
        "reason": verdict["reason"],
        "run_id": candidate["run_id"],
        "metrics": numbers,
        "baselines": verdict.get("baselines", {}),  # arm -> eval NE of the first label
        "tracking_uri": tracking_uri,
        "ui": ui_address,
    }
    if run_dir:
        (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
