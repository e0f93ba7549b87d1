"""The `gemrec-train` pipeline: ingest -> validate -> materialize features -> train -> evaluate -> register, with
the baselines (DLRM, GBDT) trained on the same dataset (beside train on the cluster, after it locally) and logged
beside GEM by evaluate.

`build(target)` gives the same DAG for two targets:
- "local": run by kfp.local's SubprocessRunner; train starts the services on 127.0.0.1.
- "cluster": compiled IR for a KFP server; steps run in the infra/ images with the shared dataset volume,
  train runs torchrun in a GPU pod (num_nodes == 1) or creates a Kubeflow TrainJob (num_nodes > 1).
"""

from kfp import dsl, kubernetes

from . import components as c
from .steps import TrainSpec

PIPELINE_NAME = "gemrec-train"
DATA_PVC = "gemrec-data"
DATA_MOUNT = "/data"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_NODE_LABEL = ("nvidia.com/gpu.present", "true")


def build(target: str = "local"):
    if target not in ("local", "cluster"):
        raise ValueError(f"unknown pipeline target {target!r}")
    cluster = target == "cluster"

    @dsl.pipeline(name=PIPELINE_NAME, description="Train, evaluate and register a gemrec model.")
    def gemrec_train(
        recipe: str = "movielens" if cluster else "tiny",
        data: str = f"{DATA_MOUNT}/raw/movielens-latest-small" if cluster else "",
        nproc: int = 8 if cluster else 1,
        num_nodes: int = 1,
        gpus_per_node: int = 8 if cluster else 0,
        tracking_uri: str = "http://gemrec-mlflow.gemrec:5000" if cluster else "sqlite:///mlruns.db",
        experiment: str = PIPELINE_NAME,
        run_dir: str = f"{DATA_MOUNT}/runs" if cluster else "runs/local",
        feature_store: str = "redis" if cluster else "memory",
        redis_url: str = "redis://gemrec-redis.gemrec:6379/0" if cluster else "",
        feature_port: int = 0,
        data_port: int = 0,
        data_addr: str = "gemrec-data.gemrec:50052" if cluster else "",
        feature_addr: str = "gemrec-features.gemrec:50051" if cluster else "",
        trainer_image: str = c.CUDA_IMAGE,
        namespace: str = "gemrec",
        ui_address: str = "http://gemrec-mlflow.gemrec:5000" if cluster else "http://127.0.0.1:5000",
        publish_dir: str = f"{DATA_MOUNT}/datasets/movielens" if cluster else "",
    ):
        # On the cluster every pipeline run gets its own folder under run_dir (on the shared volume).
        run_dir = f"{run_dir}/{dsl.PIPELINE_JOB_NAME_PLACEHOLDER}" if cluster else run_dir
        ingest = c.ingest(data=data, publish_dir=publish_dir, run_dir=run_dir).set_display_name("ingest")
        validate = c.validate(dataset=ingest.outputs["dataset"], run_dir=run_dir).set_display_name("validate")
        materialize = c.materialize_features(
            dataset=ingest.outputs["dataset"], store=feature_store, redis_url=redis_url, run_dir=run_dir
        )
        materialize.set_display_name("materialize features").after(validate)
        # The train step's TrainSpec fields come from the pipeline parameters of the same names.
        params = locals()
        train_args = {name: params[name] for name in TrainSpec.keys() if name in params}
        train_args.update(
            dataset=ingest.outputs["dataset"],
            features=materialize.outputs["features"],
            pipeline_run=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
        )
        if cluster:
            with dsl.If(num_nodes == 1, name="single-node"):
                pod = c.train(mode="pod", **train_args).set_display_name("train (GPU pod)")
                gpu_task(pod, gpus_per_node)
            with dsl.Else(name="multi-node"):
                job = c.train(mode="trainjob", **train_args).set_display_name("train (Kubeflow TrainJob)")
            model = dsl.OneOf(pod.outputs["model"], job.outputs["model"])
            tasks = [ingest, validate, materialize, pod, job]
        else:
            trained = c.train(mode="local", **train_args).set_display_name("train")
            model = trained.outputs["model"]
            tasks = [ingest, validate, materialize, trained]
        baselines = c.baselines(dataset=ingest.outputs["dataset"], recipe=recipe, run_dir=run_dir)
        # On the cluster beside the GPU train step; locally the steps run one at a time, GEM's train first.
        baselines.set_display_name("baselines (DLRM, GBDT)").after(validate if cluster else trained)
        evaluate = c.evaluate(
            model=model,
            dataset=ingest.outputs["dataset"],
            baselines=baselines.outputs["results"],
            tracking_uri=tracking_uri,
            recipe=recipe,
            run_dir=run_dir,
        ).set_display_name("evaluate")
        register = c.register(
            model=model,
            decision=evaluate.outputs["decision"],
            tracking_uri=tracking_uri,
            recipe=recipe,
            run_dir=run_dir,
            ui_address=ui_address,
        ).set_display_name("register")
        tasks += [baselines, evaluate, register]
        for task in tasks:
            task.set_caching_options(False)
            if cluster:
                cluster_task(task)

    return gemrec_train


def cluster_task(task: dsl.PipelineTask) -> None:
    """Every step mounts the shared dataset volume (raw data, prepared datasets, run folders)."""
    kubernetes.mount_pvc(task, pvc_name=DATA_PVC, mount_path=DATA_MOUNT)
    kubernetes.set_image_pull_policy(task, "IfNotPresent")


def gpu_task(task: dsl.PipelineTask, gpus) -> None:
    """The single-node train step: the CUDA image on a GPU node with `gpus` GPUs."""
    task.set_container_image(c.CUDA_IMAGE)
    task.set_accelerator_type(GPU_RESOURCE)
    task.set_accelerator_limit(gpus)
    task.set_cpu_request("16").set_memory_request("128G").set_memory_limit("256G")
    kubernetes.add_node_selector(task, label_key=GPU_NODE_LABEL[0], label_value=GPU_NODE_LABEL[1])
    kubernetes.add_toleration(task, key=GPU_RESOURCE, operator="Exists", effect="NoSchedule")
    kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory")


def compile_pipeline(path: str) -> str:
    from kfp import compiler

    compiler.Compiler().compile(build("cluster"), package_path=path)
    return path
