"""`gemrec pipeline compile`: the IR YAML loads back with kfp and holds the DAG, images, GPUs and volumes."""

import pytest
import yaml
from gemrec.cli import main
from gemrec.pipelines import components as c
from gemrec.pipelines.pipeline import DATA_MOUNT, DATA_PVC, GPU_RESOURCE, PIPELINE_NAME, build
from kfp import components

STEPS = ["ingest", "validate", "materialize-features", "train", "baselines", "evaluate", "register"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile") / "gemrec-train.yaml"
    assert main(["pipeline", "compile", "-o", str(path)]) == 0
    return path


def all_tasks(dag: dict, spec: dict) -> dict[str, dict]:
    """Tasks of a DAG, with the tasks of nested sub-DAGs (If/Else branches) flattened in."""
    tasks = {}
    for name, task in dag["tasks"].items():
        tasks[name] = task
        sub = spec["components"][task["componentRef"]["name"]]
        if "dag" in sub:
            tasks.update(all_tasks(sub["dag"], spec))
    return tasks


def test_compiled_yaml_loads_back_as_the_pipeline(compiled):
    loaded = components.load_component_from_file(str(compiled))
    assert loaded.name == PIPELINE_NAME
    inputs = loaded.component_spec.inputs
    for name in ("recipe", "data", "nproc", "num_nodes", "gpus_per_node", "tracking_uri", "experiment"):
        assert name in inputs, name
    assert loaded.pipeline_spec.pipeline_info.name == PIPELINE_NAME


def test_dag_runs_the_steps_in_order(compiled):
    spec, platform = yaml.safe_load_all(compiled.read_text())
    tasks = all_tasks(spec["root"]["dag"], spec)
    step_of = {name: name.rsplit("-", 1)[0] if name.startswith("train-") else name for name in tasks}
    for step in STEPS:
        assert step in step_of.values(), f"{step} missing from {sorted(tasks)}"
    root = spec["root"]["dag"]["tasks"]
    assert root["validate"]["dependentTasks"] == ["ingest"]
    assert set(root["materialize-features"]["dependentTasks"]) == {"ingest", "validate"}
    assert set(root["baselines"]["dependentTasks"]) == {"ingest", "validate"}  # beside materialize and train
    # evaluate and register consume the trained model from whichever branch ran (dsl.OneOf).
    assert {"ingest", "baselines"} <= set(root["evaluate"]["dependentTasks"])
    assert "evaluate" in root["register"]["dependentTasks"]
    conditions = [t for t in tasks.values() if "triggerPolicy" in t]
    assert {t["triggerPolicy"]["condition"].count("num_nodes") for t in conditions} == {1}
    # Typed artifacts between the steps.
    artifacts = {
        name: c_spec.get("outputDefinitions", {}).get("artifacts", {}) for name, c_spec in spec["components"].items()
    }
    assert artifacts["comp-ingest"]["dataset"]["artifactType"]["schemaTitle"] == "system.Dataset"
    assert artifacts["comp-train"]["model"]["artifactType"]["schemaTitle"] == "system.Model"
    assert artifacts["comp-train"]["metrics"]["artifactType"]["schemaTitle"] == "system.Metrics"
    assert artifacts["comp-validate"]["statistics"]["artifactType"]["schemaTitle"] == "system.Metrics"
    assert artifacts["comp-baselines"]["metrics"]["artifactType"]["schemaTitle"] == "system.Metrics"
    evaluate_inputs = spec["components"]["comp-evaluate"]["inputDefinitions"]["artifacts"]
    assert evaluate_inputs["baselines"]["artifactType"]["schemaTitle"] == "system.Artifact"


def test_each_cluster_run_writes_its_own_folder(compiled):
    spec, _ = yaml.safe_load_all(compiled.read_text())
    tasks = all_tasks(spec["root"]["dag"], spec)
    steps = {name: task for name, task in tasks.items() if "run_dir" in task.get("inputs", {}).get("parameters", {})}
    assert len(steps) == 8  # seven steps, train twice (GPU pod or TrainJob)
    for name, task in steps.items():
        value = task["inputs"]["parameters"]["run_dir"]["runtimeValue"]["constant"]
        assert value.endswith("/{{$.pipeline_job_name}}"), (name, value)


def test_images_gpus_node_selector_tolerations_volumes(compiled):
    spec, platform = yaml.safe_load_all(compiled.read_text())
    executors = spec["deploymentSpec"]["executors"]
    images = {name: e["container"]["image"] for name, e in executors.items()}
    gpu = [name for name, e in executors.items() if "accelerator" in e["container"].get("resources", {})]
    assert len(gpu) == 1, gpu
    (gpu_exec,) = gpu
    accelerator = executors[gpu_exec]["container"]["resources"]["accelerator"]
    assert accelerator["resourceType"] == GPU_RESOURCE and "gpus_per_node" in accelerator["resourceCount"]
    assert images[gpu_exec] == c.CUDA_IMAGE
    assert {img for name, img in images.items() if name != gpu_exec} == {c.CPU_IMAGE}
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(k8s) == set(executors)
    for config in k8s.values():
        assert config["pvcMount"][0]["mountPath"] == DATA_MOUNT
        assert config["pvcMount"][0]["constant"] == DATA_PVC
    assert k8s[gpu_exec]["nodeSelector"]["labels"] == {"nvidia.com/gpu.present": "true"}
    assert k8s[gpu_exec]["tolerations"][0]["key"] == GPU_RESOURCE
    assert any(m["mountPath"] == "/dev/shm" for m in k8s[gpu_exec]["emptyDirMounts"])


def test_images_match_infra(compiled):
    """The pipeline runs the images that infra/ builds and deploys."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    prod = yaml.safe_load((repo / "infra/k8s/overlays/prod/kustomization.yaml").read_text())
    (image,) = prod["images"]
    assert f"{image['newName']}:{image['newTag']}" == c.CPU_IMAGE
    trainjob = yaml.safe_load((repo / "infra/k8s/trainjob/trainjob.yaml").read_text())
    assert trainjob["spec"]["trainer"]["image"] == c.CUDA_IMAGE
    assert (repo / "infra/docker/Dockerfile.cpu").is_file() and (repo / "infra/docker/Dockerfile.cuda").is_file()


def test_unknown_target_is_rejected():
    with pytest.raises(ValueError, match="unknown pipeline target"):
        build("laptop")


def test_train_component_takes_exactly_the_train_spec():
    """The KFP train step's flat parameters are TrainSpec's fields, name for name and type for type."""
    from typing import Literal, get_origin

    from gemrec.config import field_types
    from gemrec.pipelines.steps import TrainSpec

    kfp_type = {str: "String", int: "Integer"}
    want = {
        name: "String" if get_origin(tp) is Literal else kfp_type[tp] for name, tp in field_types(TrainSpec).items()
    }
    inputs = c.train.component_spec.inputs
    got = {name: spec.type for name, spec in inputs.items() if not spec.type.startswith("system.")}
    assert got == want
    assert list(got) == list(want)  # same order as the dataclass (the KFP UI lists them so)
