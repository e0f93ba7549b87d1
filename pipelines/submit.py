"""`gemrec pipeline submit`: compile `gemrec-train` for the cluster and start a run on a KFP server."""

import tempfile
from datetime import UTC, datetime
from pathlib import Path

from .pipeline import PIPELINE_NAME, compile_pipeline


def submit(
    host: str,
    experiment: str = PIPELINE_NAME,
    package: str | None = None,
    arguments: dict | None = None,
    run_name: str | None = None,
    namespace: str | None = None,
    existing_token: str | None = None,
) -> str:
    """Create a run from the compiled package (compiled now unless `package` is given); return the run id."""
    import kfp

    arguments = arguments or {}
    run_name = run_name or (
        f"{PIPELINE_NAME} {arguments.get('recipe', 'movielens')} {datetime.now(UTC):%Y-%m-%d %H:%M:%S}"
    )
    client = kfp.Client(host=host, namespace=namespace, existing_token=existing_token)
    with tempfile.TemporaryDirectory() as tmp:
        path = package or compile_pipeline(str(Path(tmp) / f"{PIPELINE_NAME}.yaml"))
        result = client.create_run_from_pipeline_package(
            path, arguments=arguments, run_name=run_name, experiment_name=experiment, enable_caching=False
        )
    return result.run_id
