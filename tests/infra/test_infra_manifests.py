"""Every Kubernetes manifest under infra/ parses and validates; the overlays render with kustomize."""

import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"
BASE = K8S / "base"
TRAINJOB_SCHEMA = REPO / "infra" / "schemas" / "trainjob-v1alpha1.schema.yaml"
K8S_VERSION = "1.33"  # the oldest Kubernetes we support: gRPC probes, policy/v1 PDBs
KUBECTL = shutil.which("kubectl")


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def base_files() -> list[Path]:
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    return [BASE / name for name in listed]


def validate_core(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", base_files(), ids=lambda p: p.name)
def test_base_manifest_validates_against_kubernetes_schema(path):
    docs = load_docs(path)
    assert docs, f"{path} holds no objects"
    for doc in docs:
        validate_core(doc)


def test_validator_rejects_a_broken_deployment():
    doc = load_docs(BASE / "feature-service.yaml")[0]
    doc["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(doc)
    doc = load_docs(BASE / "feature-service.yaml")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"  # typo: strict mode
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(doc)


def test_base_has_every_service_the_system_needs():
    objects = {(d["kind"], d["metadata"]["name"]) for p in base_files() for d in load_docs(p)}
    for name in ("gemrec-features", "gemrec-data", "gemrec-redis", "gemrec-mlflow"):
        assert ("Deployment", name) in objects and ("Service", name) in objects, name
    for name in ("gemrec-postgres", "gemrec-minio"):
        assert ("StatefulSet", name) in objects and ("Service", name) in objects, name
    for name in ("gemrec-features", "gemrec-data"):  # the servers bind 127.0.0.1 unless told otherwise
        service = next(
            d for p in base_files() for d in load_docs(p) if d["kind"] == "Deployment" and d["metadata"]["name"] == name
        )
        assert "--host=0.0.0.0" in service["spec"]["template"]["spec"]["containers"][0]["args"], name
    mlflow = next(d for p in base_files() for d in load_docs(p) if d["metadata"]["name"] == "gemrec-mlflow")
    args = " ".join(mlflow["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--backend-store-uri=postgresql://" in args and "--artifacts-destination=s3://" in args


def test_no_secret_values_in_infra():
    for path in (REPO / "infra").rglob("*"):
        if not path.is_file():
            continue
        text = path.read_text()
        assert "kind: Secret\n" not in text, f"{path} defines a Secret: reference one instead"
        # Credentials only ever come from secretKeyRef, never as literal env values.
        for match in re.finditer(r"name: (\w*(PASSWORD|SECRET|TOKEN|ACCESS_KEY)\w*)\n\s+value:", text):
            pytest.fail(f"{path}: {match.group(1)} has a literal value")


def trainjob_validator() -> jsonschema.Draft202012Validator:
    schema = yaml.safe_load(TRAINJOB_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_trainjob_template_validates_against_crd_schema():
    (doc,) = load_docs(K8S / "trainjob" / "trainjob.yaml")
    errors = [e.message for e in trainjob_validator().iter_errors(doc)]
    assert not errors, errors
    assert doc["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert doc["spec"]["trainer"]["command"][0] == "torchrun"


@pytest.mark.parametrize(
    "path, value",
    [
        (("spec", "trainer", "numProcPerNode"), 0),
        (("spec", "trainer", "numNodes"), -1),
        (("spec", "trainer", "numNode"), 2),  # misspelt field
        (("spec", "runtimeRef", "name"), ""),
        (("metadata", "name"), "Gemrec_Train"),
        (("spec", "trainer", "resourcesPerNode", "limits", "nvidia.com/gpu"), "eight"),
    ],
)
def test_trainjob_schema_rejects_bad_fields(path, value):
    (doc,) = load_docs(K8S / "trainjob" / "trainjob.yaml")
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert list(trainjob_validator().iter_errors(doc)), f"{path}={value!r} was accepted"


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (make system-deps installs it)")
@pytest.mark.parametrize("overlay", ["local", "prod"])
def test_overlay_renders_and_validates(overlay):
    result = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    for doc in docs:
        validate_core(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "gemrec", doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gemrec"
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    images = {c["image"] for d in deployments.values() for c in d["spec"]["template"]["spec"]["containers"]}
    expected = {"local": "gemrec-cpu:dev", "prod": "ghcr.io/gemrec/gemrec-cpu:0.1.0"}[overlay]
    assert expected in images
    replicas = deployments["gemrec-features"]["spec"]["replicas"]
    assert replicas == {"local": 1, "prod": 3}[overlay]


def test_dockerfiles_copy_what_exists():
    for dockerfile in sorted((REPO / "infra" / "docker").glob("Dockerfile.*")):
        if dockerfile.suffix == ".dockerignore":
            continue
        text = dockerfile.read_text()
        assert text.lstrip().splitlines()[0].startswith("#") and "\nFROM " in text
        for sources in re.findall(r"^COPY (.+) \S+$", text, re.MULTILINE):
            for source in sources.split():
                assert source == "." or (REPO / source).exists(), f"{dockerfile.name}: COPY {source} is missing"
        assert "USER gemrec" in text, f"{dockerfile.name} must not run as root"
