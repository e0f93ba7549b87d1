"""Champion logic against a real MLflow store (SQLite in tmp_path): the alias moves only when NE improves,
and every decision is recorded on the run and the model version."""

import mlflow
import pytest
import torch
from gemrec.pipelines import tracking

CHECKSUM = "sha256:abc"


def test_decide_without_champion_promotes():
    promote, reason = tracking.decide(0.93, None, CHECKSUM)
    assert promote and "no champion yet" in reason


@pytest.mark.parametrize("candidate, promote", [(0.90, True), (0.95, False), (0.95000001, False)])
def test_decide_compares_ne(candidate, promote):
    current = tracking.Champion(version="3", run_id="r", ne=0.95, dataset_checksum=CHECKSUM)
    decision, reason = tracking.decide(candidate, current, CHECKSUM)
    assert decision is promote
    assert ("improved" in reason) is promote and "v3" in reason and "(same dataset)" in reason


def test_relative_sqlite_uri_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.resolve_tracking_uri() == f"sqlite:///{tmp_path}/mlruns.db"
    assert tracking.resolve_tracking_uri("http://mlflow:5000") == "http://mlflow:5000"
    assert tracking.artifact_root(tracking.resolve_tracking_uri()) == tmp_path / "mlartifacts"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite store for the module (creating one runs every MLflow migration: seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlruns.db"


def train_run(uri: str, experiment: str, with_model: bool = True) -> str:
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        mlflow.create_experiment(experiment, artifact_location=tracking.artifact_root(uri).as_uri())
    mlflow.set_experiment(experiment)
    with mlflow.start_run() as run:
        mlflow.log_metric("ne", 0.9)
        if with_model:
            mlflow.pytorch.log_model(
                torch.nn.Linear(2, 1), name="model", pip_requirements=["torch"], serialization_format="pickle"
            )
        return run.info.run_id


def test_register_moves_champion_only_on_better_ne(store):
    uri = store
    name = tracking.model_name("tiny")
    client = tracking.client(uri)

    first = train_run(uri, "gemrec-train")
    promote, reason = tracking.decide(0.92, tracking.champion(uri, name), CHECKSUM)
    v1 = tracking.register(uri, first, name, {"ne": 0.92, "qps": 1000.0}, promote, reason, CHECKSUM, "tiny")
    champion = tracking.champion(uri, name)
    assert (champion.version, champion.ne, champion.run_id) == (v1, 0.92, first)
    assert "Champion: version 1" in client.get_registered_model(name).description

    worse = train_run(uri, "gemrec-train")
    promote, reason = tracking.decide(0.97, tracking.champion(uri, name), CHECKSUM)
    v2 = tracking.register(uri, worse, name, {"ne": 0.97, "qps": 1000.0}, promote, reason, CHECKSUM, "tiny")
    assert (v1, v2) == ("1", "2") and not promote
    assert tracking.champion(uri, name).version == "1"
    tags = client.get_run(worse).data.tags
    assert tags["gemrec.champion_decision"] == "kept"
    assert "does not improve on champion v1 NE 0.9200" in tags["gemrec.champion_reason"]
    version = client.get_model_version(name, v2)
    assert version.tags["ne"] == "0.97" and "does not improve" in version.description

    better = train_run(uri, "gemrec-train")
    promote, reason = tracking.decide(0.90, tracking.champion(uri, name), CHECKSUM)
    v3 = tracking.register(uri, better, name, {"ne": 0.90}, promote, reason, CHECKSUM, "tiny")
    assert tracking.champion(uri, name).version == v3 == "3"
    assert client.get_run(better).data.tags["gemrec.champion_decision"] == "promoted"


def test_run_without_a_model_cannot_be_registered(store):
    run_id = train_run(store, "no-model", with_model=False)
    with pytest.raises(LookupError, match="has no logged model"):
        tracking.register(store, run_id, "gemrec-x", {"ne": 0.9}, True, "first", CHECKSUM, "x")


def test_a_recipe_given_as_a_path_registers_under_its_file_stem(store, tmp_path):
    recipe = str(tmp_path / "my recipe:v2.toml")
    name = tracking.model_name(recipe)
    assert name == "gemrec-my-recipe-v2" and tracking.run_name(recipe, "0123456789") == "my-recipe-v2@01234567"
    promote, reason = tracking.decide(0.9, tracking.champion(store, name), CHECKSUM)
    version = tracking.register(
        store, train_run(store, "gemrec-train"), name, {"ne": 0.9}, promote, reason, CHECKSUM, recipe
    )
    assert tracking.champion(store, name).version == version
