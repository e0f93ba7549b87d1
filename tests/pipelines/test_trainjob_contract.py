"""Contract test of the cluster train step's TrainJob code: a recording HTTP endpoint plays the Kubernetes
API server (custom objects of trainer.kubeflow.org/v1alpha1); the created object must satisfy the CRD schema."""

from pathlib import Path

import jsonschema
import pytest
import yaml
from gemrec.pipelines import trainjob

REPO = Path(__file__).resolve().parents[2]
PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs"


def spec(**overrides) -> trainjob.TrainJobSpec:
    values = dict(
        name=trainjob.job_name("gemrec-train-2026-11-30-12-00-00-123456"),
        image="ghcr.io/gemrec/gemrec-cuda:0.1.0",
        recipe="h200-bench",
        data_addr="gemrec-data.gemrec:50052",
        feature_addr="gemrec-features.gemrec:50051",
        tracking_uri="http://gemrec-mlflow.gemrec:5000",
        experiment="gemrec-train",
        num_nodes=2,
        nproc_per_node=8,
        gpus_per_node=8,
    )
    values.update(overrides)
    return trainjob.TrainJobSpec(**values)


def kubernetes_api(endpoint, conditions_sequence):
    """POST stores the object; each GET returns it with the next status from `conditions_sequence`."""
    stored = {}
    polls = iter(conditions_sequence)

    def create(request):
        stored["object"] = request["body"]
        return 201, request["body"]

    def get(request):
        conditions = next(polls, conditions_sequence[-1])
        return 200, {**stored["object"], "status": {"conditions": conditions}}

    endpoint.route("POST", PATH, create)
    endpoint.route("GET", PATH + "/", get)


def condition(kind, reason="", message=""):
    return {"type": kind, "status": "True", "reason": reason, "message": message}


def test_trainjob_is_created_and_watched_until_complete(recording_endpoint):
    kubernetes_api(recording_endpoint, [[], [condition("Created")], [condition("Created"), condition("Complete")]])
    job = trainjob.run(spec(), "team-a", host=recording_endpoint.url, poll_s=0.01)
    assert any(c["type"] == "Complete" for c in job["status"]["conditions"])
    post = recording_endpoint.requests[0]
    assert (post["method"], post["path"]) == ("POST", PATH)
    body = post["body"]
    schema = yaml.safe_load((REPO / "infra/schemas/trainjob-v1alpha1.schema.yaml").read_text())
    jsonschema.validate(body, schema)
    trainer = body["spec"]["trainer"]
    assert body["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    assert trainer["command"] == ["torchrun", "--no-python", "gemrec"]
    assert "--data-addr=gemrec-data.gemrec:50052" in trainer["args"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["MLFLOW_TRACKING_URI"] == "http://gemrec-mlflow.gemrec:5000"
    assert env["GEMREC_FEATURE_ADDR"] == "gemrec-features.gemrec:50051"
    gets = [r for r in recording_endpoint.requests if r["method"] == "GET"]
    assert len(gets) == 3 and gets[0]["path"] == f"{PATH}/{body['metadata']['name']}"


def test_failed_trainjob_raises_with_reason(recording_endpoint):
    kubernetes_api(recording_endpoint, [[condition("Failed", "BackoffLimitExceeded", "node-0 exited 1")]])
    with pytest.raises(trainjob.TrainJobError, match="failed: BackoffLimitExceeded: node-0 exited 1"):
        trainjob.run(spec(), "team-a", host=recording_endpoint.url, poll_s=0.01)


def test_rejected_create_names_the_job_and_status(recording_endpoint):
    recording_endpoint.route("POST", PATH, lambda r: (403, {"kind": "Status", "message": "trainjobs is forbidden"}))
    with pytest.raises(trainjob.TrainJobError, match="cannot create TrainJob .* in team-a: 403"):
        trainjob.run(spec(), "team-a", host=recording_endpoint.url, poll_s=0.01)


def test_cpu_only_job_and_bad_sizes():
    body = trainjob.build(spec(gpus_per_node=0, num_nodes=1, nproc_per_node=2))
    assert "nvidia.com/gpu" not in body["spec"]["trainer"]["resourcesPerNode"]["requests"]
    with pytest.raises(trainjob.TrainJobError, match="numProcPerNode"):
        trainjob.build(spec(nproc_per_node=0))


@pytest.mark.parametrize("run_name", ["gemrec-train-2026-11-30-12-00-00-123456", "0-Weird_Name " * 10, "x"])
def test_job_names_are_dns_labels(run_name):
    name = trainjob.job_name(run_name)
    schema = yaml.safe_load((REPO / "infra/schemas/trainjob-v1alpha1.schema.yaml").read_text())
    jsonschema.validate(name, schema["properties"]["metadata"]["properties"]["name"])
