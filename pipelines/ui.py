"""`gemrec ui`: the MLflow web UI over the project's store, on 127.0.0.1."""

import os
import sys
from pathlib import Path

from . import tracking
from .services import LOCALHOST, ProcessGroup, claim_port


def server_command(tracking_uri: str, port: int) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        LOCALHOST,
        "--port",
        str(port),
        "--backend-store-uri",
        tracking_uri,
        "--workers",
        "1",
    ]
    artifacts = tracking.artifact_root(tracking_uri)
    if artifacts is not None:
        command += ["--artifacts-destination", str(artifacts)]
    return command


def check_store(tracking_uri: str) -> None:
    db = tracking.sqlite_path(tracking_uri)
    if db is not None and not db.is_file():
        raise FileNotFoundError(
            f"no MLflow store at {db}: run `gemrec pipeline run` (or `make run`) first, or pass --tracking-uri"
        )


def serve(tracking_uri: str | None, port: int) -> int:
    """Run the MLflow server in the foreground until Ctrl-C or SIGTERM; return its exit code."""
    tracking_uri = tracking.resolve_tracking_uri(tracking_uri)
    check_store(tracking_uri)
    claim_port(port, "MLflow UI")
    artifacts = tracking.artifact_root(tracking_uri)
    if artifacts is not None:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
    print(f"MLflow UI at http://{LOCALHOST}:{port} over {tracking_uri} (Ctrl-C stops it)", flush=True)
    with ProcessGroup(grace_s=15) as group:
        # Server-side jobs (GenAI evaluation workers) are not needed to browse runs: keep the UI light.
        jobs = os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        server = group.start(
            "MLflow UI",
            server_command(tracking_uri, port),
            log_path=None,
            env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": jobs},
        )
        try:
            return server.popen.wait()
        except KeyboardInterrupt:
            return 0
