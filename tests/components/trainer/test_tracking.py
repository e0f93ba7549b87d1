"""The MLflow Tracker: processes opening one new SQLite store at the same time."""

import multiprocessing

from gemrec.components.trainer.tracking import Tracker


def _open_and_log(uri: str, index: int) -> None:
    tracker = Tracker(True, uri, "shared", run_name=f"run-{index}")
    tracker.log_metrics({"index": float(index)}, step=0)
    tracker.finish()


def test_processes_creating_one_sqlite_store_at_once_all_log(tmp_path):
    """MLflow migrates a new SQLite store's schema on first use; without the store lock two processes racing on it
    fail (one of them: "table _alembic_tmp_tags already exists")."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'store' / 'mlruns.db'}"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_open_and_log, args=(uri, i)) for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("shared").experiment_id])
    assert sorted(r.data.metrics["index"] for r in runs) == [0.0, 1.0, 2.0]
