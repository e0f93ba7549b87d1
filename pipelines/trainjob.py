"""Cluster training: a Kubeflow Trainer v2 TrainJob (torch-distributed runtime) created with the Kubernetes
client, then watched until it completes or fails. The manifest matches infra/k8s/trainjob/trainjob.yaml.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
RUNTIME = "torch-distributed"


class TrainJobError(RuntimeError):
    """The TrainJob failed, timed out or could not be created; the message says which and why."""


@dataclass
class TrainJobSpec:
    name: str
    image: str
    recipe: str
    data_addr: str
    feature_addr: str
    tracking_uri: str
    experiment: str
    num_nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    cpu_per_node: str = "8"
    memory_per_node: str = "64Gi"
    runtime: str = RUNTIME
    labels: dict[str, str] = field(default_factory=dict)


def job_name(pipeline_run: str) -> str:
    """A DNS-1035 label of at most 63 characters derived from the pipeline run's name."""
    slug = re.sub(r"[^a-z0-9-]+", "-", pipeline_run.lower()).strip("-")
    slug = re.sub(r"^[^a-z]+", "", slug)
    return ("gemrec-" + slug)[:63].rstrip("-")


def build(spec: TrainJobSpec) -> dict:
    if spec.num_nodes < 1 or spec.nproc_per_node < 1:
        raise TrainJobError(f"numNodes ({spec.num_nodes}) and numProcPerNode ({spec.nproc_per_node}) must be >= 1")
    requests: dict[str, str | int] = {"cpu": spec.cpu_per_node, "memory": spec.memory_per_node}
    limits: dict[str, str | int] = {"memory": spec.memory_per_node}
    if spec.gpus_per_node:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = spec.gpus_per_node
    env = {
        "MLFLOW_TRACKING_URI": spec.tracking_uri,
        "GEMREC_DATA_ADDR": spec.data_addr,
        "GEMREC_FEATURE_ADDR": spec.feature_addr,
        "NCCL_DEBUG": "WARN",
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {
            "name": spec.name,
            "labels": {
                "app.kubernetes.io/part-of": "gemrec",
                "app.kubernetes.io/name": "gemrec-trainer",
                **spec.labels,
            },
        },
        "spec": {
            "runtimeRef": {"apiGroup": GROUP, "kind": "ClusterTrainingRuntime", "name": spec.runtime},
            "trainer": {
                "image": spec.image,
                "numNodes": spec.num_nodes,
                "numProcPerNode": spec.nproc_per_node,
                # torchrun takes nodes, ranks and the rendezvous from the runtime's PET_* variables.
                "command": ["torchrun", "--no-python", "gemrec"],
                "args": [
                    "train",
                    f"--data-addr={spec.data_addr}",
                    f"--recipe={spec.recipe}",
                    f"--tracking-uri={spec.tracking_uri}",
                    f"--experiment={spec.experiment}",
                ],
                "env": [{"name": k, "value": v} for k, v in env.items()]
                + [
                    {
                        "name": "GEMREC_AUTH_TOKEN",
                        "valueFrom": {"secretKeyRef": {"name": "gemrec-auth", "key": "token", "optional": True}},
                    }
                ],
                "resourcesPerNode": {"requests": requests, "limits": limits},
            },
        },
    }


def api_client(host: str | None = None):
    """In a pod: the service account; elsewhere: kubeconfig; `host` overrides the API server address."""
    from kubernetes import client, config

    if host:
        configuration = client.Configuration()
        configuration.host = host
        return client.ApiClient(configuration)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def create(api, namespace: str, body: dict) -> dict:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    try:
        return client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    except ApiException as err:
        raise TrainJobError(
            f"cannot create TrainJob {body['metadata']['name']} in {namespace}: {err.status} {err.reason}: {err.body}"
        ) from err


def wait(api, namespace: str, name: str, timeout_s: float = 24 * 3600, poll_s: float = 15.0) -> dict:
    """Poll the TrainJob until its Complete or Failed condition is True; return the final object."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    objects = client.CustomObjectsApi(api)
    deadline = time.monotonic() + timeout_s
    last_state = None
    while True:
        try:
            job = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as err:
            raise TrainJobError(f"cannot read TrainJob {namespace}/{name}: {err.status} {err.reason}") from err
        conditions = {c["type"]: c for c in job.get("status", {}).get("conditions", []) if c.get("status") == "True"}
        if "Failed" in conditions:
            c = conditions["Failed"]
            raise TrainJobError(f"TrainJob {namespace}/{name} failed: {c.get('reason', '')}: {c.get('message', '')}")
        if "Complete" in conditions:
            return job
        state = ",".join(sorted(conditions)) or "Pending"
        if state != last_state:
            print(f"[gemrec] TrainJob {namespace}/{name}: {state}", flush=True)
            last_state = state
        if time.monotonic() > deadline:
            raise TrainJobError(f"TrainJob {namespace}/{name} did not finish within {timeout_s:.0f} s")
        time.sleep(poll_s)


def run(
    spec: TrainJobSpec, namespace: str, host: str | None = None, timeout_s: float = 24 * 3600, poll_s: float = 15.0
) -> dict:
    api = api_client(host)
    create(api, namespace, build(spec))
    print(
        f"[gemrec] created TrainJob {namespace}/{spec.name} ({spec.num_nodes} node(s) x "
        f"{spec.nproc_per_node} process(es), image {spec.image})",
        flush=True,
    )
    return wait(api, namespace, spec.name, timeout_s=timeout_s, poll_s=poll_s)
