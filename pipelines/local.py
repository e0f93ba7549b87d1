"""`gemrec pipeline run`: the whole pipeline on this machine with kfp.local, outputs under ./runs/<run>/.

The run folder holds `status.json` (running -> succeeded | failed, with the failed step and its cause),
`summary.json` (metrics, MLflow run, registered model), `logs/` (services, trainer) and `kfp/` (the step
artifacts). A failed run also gets an empty `FAILED` marker file.
"""

import contextlib
import io
import json
import re
import sys
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

from . import tracking
from .pipeline import PIPELINE_NAME, build
from .services import claim_ports
from .steps import FAILURE_FILE


class ExecutorLogFilter(io.TextIOBase):
    """Tees everything to the run's pipeline.log; the console skips the KFP executor's own chatter
    (its INFO lines and the executor-input JSON dump), keeping step progress, service and trainer output."""

    def __init__(self, console, log_path: Path):
        self.console, self.log = console, open(log_path, "a", buffering=1)  # closed in close()
        self.pending, self.in_json = "", False

    def write(self, text: str) -> int:
        self.log.write(text)
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if self.in_json:
                self.in_json = line.rstrip() != "    }"
            elif line.startswith("    [KFP Executor"):
                self.in_json = line.rstrip().endswith("Got executor_input:")
            else:
                self.console.write(line + "\n")
        self.console.flush()
        return len(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def close(self) -> None:
        if self.closed:
            return
        if self.pending:
            self.console.write(self.pending)
        super().close()
        self.log.close()


class InputError(ValueError):
    """Bad command-line input, found before anything runs."""


class PipelineFailed(RuntimeError):
    def __init__(self, step: str, cause: str, run_dir: Path):
        super().__init__(f"step {step} failed: {cause} (partial outputs in {run_dir}, marked failed)")
        self.step, self.cause, self.run_dir = step, cause, run_dir


def check_inputs(recipe: str, data: str | None, nproc: int, feature_port: int, data_port: int) -> Path:
    """Fail before anything runs: unknown recipe, missing data, bad --nproc, a port in use."""
    from gemrec.components.trainer.config import RecipeError, recipe_path

    try:
        recipe_path(recipe)
    except RecipeError as err:
        raise InputError(str(err)) from err
    if not data:
        raise InputError("no data: pass --data PATH (MovieLens ml-latest-small folder or a prepared dataset)")
    path = Path(data).expanduser().resolve()
    if not path.exists():
        raise InputError(f"data path {path} does not exist")
    if not ((path / "ratings.csv").is_file() or (path / "manifest.json").is_file()):
        raise InputError(
            f"{path} is neither MovieLens ml-latest-small (ratings.csv) nor a prepared dataset (manifest.json)"
        )
    if nproc < 1:
        raise InputError(f"--nproc must be at least 1 (got {nproc})")
    claim_ports([(feature_port, "feature service"), (data_port, "data service")])
    return path


def new_run_dir(root: Path, recipe: str) -> Path:
    """runs/<UTC time>-<recipe name> (the file name's stem for a recipe given as a .toml path)."""
    from gemrec.components.trainer.config import recipe_name

    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    recipe = recipe_name(recipe)
    run_dir = root / f"{stamp}-{recipe}"
    suffix = 1
    while run_dir.exists():
        suffix += 1
        run_dir = root / f"{stamp}-{recipe}-{suffix}"
    run_dir.mkdir(parents=True)
    return run_dir


def write_status(run_dir: Path, **status) -> None:
    (run_dir / "status.json").write_text(json.dumps(status, indent=2))


def failed_step(run_dir: Path, err: BaseException) -> tuple[str, str]:
    """The failed step and its cause: from the step's failure record, else from kfp's message."""
    record = run_dir / FAILURE_FILE
    if record.is_file():
        info = json.loads(record.read_text())
        return info["step"], info["cause"]
    match = re.search(r"Task '([\w-]+)' finished with status FAILURE", str(err))
    step = match.group(1) if match else "unknown"
    return step, f"{type(err).__name__}: {err}"


def run(
    recipe: str,
    data: str | None,
    nproc: int = 1,
    runs_root: str = "runs",
    tracking_uri: str | None = None,
    feature_store: str = "memory",
    redis_url: str = "",
    feature_port: int = 0,
    data_port: int = 0,
    ui_port: int = 5000,
    verbose: bool = False,
) -> dict:
    """Run `gemrec-train` locally; return the summary (raises PipelineFailed naming the step and cause)."""
    from kfp import local

    data_path = check_inputs(recipe, data, nproc, feature_port, data_port)
    tracking_uri = tracking.resolve_tracking_uri(tracking_uri)
    run_dir = new_run_dir(Path(runs_root).resolve(), recipe)
    started = time.time()
    write_status(
        run_dir,
        status="running",
        pipeline=PIPELINE_NAME,
        recipe=recipe,
        data=str(data_path),
        started=datetime.now(UTC).isoformat(),
    )
    print(f"[gemrec] pipeline {PIPELINE_NAME}: recipe {recipe}, data {data_path}, nproc {nproc}", flush=True)
    print(f"[gemrec] outputs in {run_dir}; MLflow store {tracking_uri}", flush=True)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(run_dir / "kfp"), raise_on_error=True)
    pipeline = build("local")
    console = None if verbose else ExecutorLogFilter(sys.stdout, run_dir / "pipeline.log")
    output = contextlib.redirect_stdout(console) if console else contextlib.nullcontext()
    try:
        with output, warnings.catch_warnings():
            # The steps' cluster image names are irrelevant to the subprocess runner.
            warnings.filterwarnings("ignore", message=".*non-Python base image.*")
            warnings.filterwarnings(
                "ignore", message=r"Task '.*': settings \[.*\] have no effect", category=UserWarning
            )
            pipeline(
                recipe=recipe,
                data=str(data_path),
                nproc=nproc,
                tracking_uri=tracking_uri,
                experiment=PIPELINE_NAME,
                run_dir=str(run_dir),
                feature_store=feature_store,
                redis_url=redis_url,
                feature_port=feature_port,
                data_port=data_port,
                ui_address=f"http://127.0.0.1:{ui_port}",
            )
    except BaseException as err:
        step, cause = failed_step(run_dir, err)
        if isinstance(err, KeyboardInterrupt):
            step, cause = step if step != "unknown" else "pipeline", "interrupted"
        write_status(
            run_dir,
            status="failed",
            pipeline=PIPELINE_NAME,
            recipe=recipe,
            step=step,
            cause=cause,
            seconds=round(time.time() - started, 1),
        )
        (run_dir / "FAILED").touch()
        if isinstance(err, KeyboardInterrupt):
            raise
        raise PipelineFailed(step, cause, run_dir) from err
    finally:
        if console:
            console.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["seconds"] = round(time.time() - started, 1)
    summary["run_dir"] = str(run_dir)
    write_status(
        run_dir,
        status="succeeded",
        pipeline=PIPELINE_NAME,
        recipe=recipe,
        seconds=summary["seconds"],
        run_id=summary["run_id"],
        model=f"{summary['model']}/{summary['version']}",
    )
    return summary


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = summary["metrics"]
    label = next((k[3:] for k in m if k.startswith("ne_") and m[k] == m["ne"]), "")
    task = f"eval, {label}" if label else "eval"
    table = Table(
        title=f"gemrec-train finished in {summary['seconds']:.0f} s", caption="NE: normalized entropy (lower is better)"
    )
    table.add_column("result", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_row(f"NE ({task})", f"{m['ne']:.4f}")
    for arm, ne in summary.get("baselines", {}).items():
        table.add_row(
            f"NE ({task}), {arm.replace('_', ' ')}", f"{ne:.4f}" + (" (train rate)" if arm == "base_rate" else "")
        )
    if "auc" in m:
        table.add_row(f"AUC ({task})", f"{m['auc']:.4f}")
    if "qps" in m:
        table.add_row("QPS (train examples/s)", f"{m['qps']:,.0f}")
    if "mfu" in m:
        table.add_row("MFU (end to end)", f"{100 * m['mfu']:.2f} %")
    table.add_row("MLflow run id", summary["run_id"])
    table.add_row(
        "model",
        f"{summary['model']} v{summary['version']}"
        + (" (new champion)" if summary["promoted"] else " (champion kept)"),
    )
    table.add_row("MLflow UI", f"{summary['ui']} (run `gemrec ui`)")
    console = Console()
    console.print(table)
    console.print(f"champion: {summary['reason']}")
    console.print(f"outputs: {summary['run_dir']}", soft_wrap=True)
