"""Lightweight KFP components: typed inputs/outputs around gemrec.pipelines.steps, nothing else.

Each function body is shipped as source to the step's container (or local subprocess), so it imports
gemrec inside. The images come from infra/docker (see pipeline.IMAGES).
"""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

CPU_IMAGE = "ghcr.io/gemrec/gemrec-cpu:0.1.0"
CUDA_IMAGE = "ghcr.io/gemrec/gemrec-cuda:0.1.0"


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def ingest(data: str, publish_dir: str, run_dir: str, dataset: Output[Dataset]):
    """Raw events (or a prepared dataset) -> the dataset folder (also published for the services)."""
    from gemrec.pipelines import steps

    with steps.step_guard(run_dir, "ingest"):
        manifest = steps.ingest(data, dataset.path, publish_dir)
        dataset.metadata.update(
            {
                "name": manifest["name"],
                "dataset_checksum": manifest.get("dataset_checksum", ""),
                "num_events": manifest["num_events"],
                "labels": manifest.get("labels", []),
            }
        )


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def validate(dataset: Input[Dataset], run_dir: str, statistics: Output[Metrics]):
    """Schema and statistics checks; fails fast naming every problem."""
    from gemrec.pipelines import steps

    with steps.step_guard(run_dir, "validate"):
        for name, value in steps.validate(dataset.path).items():
            statistics.log_metric(name, float(value))


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def materialize_features(dataset: Input[Dataset], store: str, redis_url: str, run_dir: str, features: Output[Artifact]):
    """Online features for the feature service (memory store check, or written into Redis)."""
    import json

    from gemrec.pipelines import steps

    with steps.step_guard(run_dir, "materialize"):
        info = steps.materialize(dataset.path, store, redis_url)
        with open(features.path, "w") as f:
            json.dump(info, f, indent=2)
        features.metadata.update({k: v for k, v in info.items() if isinstance(v, (str, int, float))})


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def train(
    dataset: Input[Dataset],
    features: Input[Artifact],
    # The fields of gemrec.pipelines.steps.TrainSpec, flat for the KFP UI (a test keeps the two the same).
    mode: str,
    recipe: str,
    nproc: int,
    tracking_uri: str,
    experiment: str,
    run_dir: str,
    feature_port: int,
    data_port: int,
    data_addr: str,
    feature_addr: str,
    trainer_image: str,
    namespace: str,
    num_nodes: int,
    gpus_per_node: int,
    pipeline_run: str,
    model: Output[Model],
    metrics: Output[Metrics],
):
    """Train (local services + torchrun, torchrun in this pod, or a Kubeflow TrainJob); log NE/AUC/QPS/MFU."""
    import json

    from gemrec.pipelines import steps

    with steps.step_guard(run_dir, "train"):
        spec = steps.TrainSpec.from_inputs(locals())
        with open(features.path) as f:
            feature_info = json.load(f)
        result = steps.train(
            spec,
            dataset.path,
            feature_info,
            dataset.metadata.get("dataset_checksum", ""),
            list(dataset.metadata.get("labels", [])),
        )
        for name, value in result["numbers"].items():
            metrics.log_metric(name, value)
        with open(model.path, "w") as f:
            json.dump(result, f, indent=2)
        model.metadata.update(
            {
                "mlflow_run_id": result["run_id"],
                "recipe": recipe,
                "tracking_uri": tracking_uri,
                "ne": result["numbers"]["ne"],
            }
        )


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def baselines(dataset: Input[Dataset], recipe: str, run_dir: str, metrics: Output[Metrics], results: Output[Artifact]):
    """The baselines (DLRM, GBDT) trained with the same recipe on the same dataset; their eval NE/AUC per label."""
    import json

    from gemrec.pipelines import steps

    with steps.step_guard(run_dir, "baselines"):
        summaries = steps.baselines(dataset.path, recipe, run_dir)
        for name, value in steps.baseline_metrics(summaries).items():
            metrics.log_metric(name.removeprefix("baseline/").replace("/", "_"), value)
        with open(results.path, "w") as f:
            json.dump(summaries, f, indent=2)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def evaluate(
    model: Input[Model],
    dataset: Input[Dataset],
    baselines: Input[Artifact],
    tracking_uri: str,
    recipe: str,
    run_dir: str,
    evaluation: Output[Metrics],
    decision: Output[Artifact],
):
    """Compare the candidate's eval NE with the `champion` model's; log the baselines beside it in its MLflow run."""
    import json

    from gemrec.pipelines import steps

    with steps.step_guard(run_dir, "evaluate"):
        with open(model.path) as f:
            candidate = json.load(f)
        with open(baselines.path) as f:
            baseline_results = json.load(f)
        verdict = steps.evaluate(
            candidate,
            tracking_uri,
            recipe,
            dataset.metadata.get("dataset_checksum", ""),
            list(dataset.metadata.get("labels", [])),
            baseline_results,
        )
        for name, value in verdict["metrics"].items():
            evaluation.log_metric(name, value)
        with open(decision.path, "w") as f:
            json.dump(verdict, f, indent=2)
        decision.metadata.update({"promote": verdict["promote"], "reason": verdict["reason"]})


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def register(
    model: Input[Model],
    decision: Input[Artifact],
    tracking_uri: str,
    recipe: str,
    run_dir: str,
    ui_address: str,
    registered: Output[Model],
):
    """Register the model in MLflow; move the `champion` alias only when NE improved, and say why."""
    import json

    from gemrec.pipelines import steps

    with steps.step_guard(run_dir, "register"):
        with open(model.path) as f:
            candidate = json.load(f)
        with open(decision.path) as f:
            verdict = json.load(f)
        summary = steps.register(candidate, verdict, tracking_uri, recipe, run_dir, ui_address)
        with open(registered.path, "w") as f:
            json.dump(summary, f, indent=2)
        registered.metadata.update(
            {"model": summary["model"], "version": summary["version"], "promoted": summary["promoted"]}
        )
