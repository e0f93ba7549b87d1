import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from gemrec.components.common.ports import free_port


class RecordingEndpoint:
    """A real HTTP server on 127.0.0.1 that records every request and answers from `routes`.

    `routes` maps (method, path prefix) to a function(request) -> (status, json body); the first
    matching prefix wins. Used for contract tests against the KFP and Kubernetes APIs.
    """

    def __init__(self):
        self.requests: list[dict] = []
        self.routes: list[tuple[str, str, object]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError:
                    body = raw.decode(errors="replace")
                request = {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
                endpoint.requests.append(request)
                for method, prefix, answer in endpoint.routes:
                    if method == self.command and self.path.split("?")[0].startswith(prefix):
                        status, payload = answer(request)
                        break
                else:
                    status, payload = 404, {"error": f"no route for {self.command} {self.path}"}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def route(self, method: str, prefix: str, answer) -> None:
        self.routes.append((method, prefix, answer))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recording_endpoint():
    endpoint = RecordingEndpoint()
    yield endpoint
    endpoint.close()


def gemrec_cli() -> str:
    """The environment's `gemrec` console script."""
    import shutil
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "gemrec"
    return str(script) if script.is_file() else shutil.which("gemrec")


def live_processes_mentioning(text: str) -> list[str]:
    """Command lines of live (non-zombie) processes that mention `text`: orphan detection."""
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if text in cmdline and state != "Z":
            found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory, movielens_raw):
    """The whole local pipeline, once per session, on the `tiny` recipe (the real CLI in a subprocess)."""
    import subprocess
    import time

    work = tmp_path_factory.mktemp("pipeline")
    store = f"sqlite:///{work}/mlruns.db"
    ui_port = free_port()
    started = time.monotonic()
    result = subprocess.run(
        [
            gemrec_cli(),
            "pipeline",
            "run",
            "--recipe",
            "tiny",
            "--data",
            str(movielens_raw),
            "--runs",
            str(work / "runs"),
            "--tracking-uri",
            store,
            "--ui-port",
            str(ui_port),
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.monotonic() - started
    run_dirs = sorted((work / "runs").glob("*-tiny"))
    summary_path = run_dirs[-1] / "summary.json" if run_dirs else None
    summary = json.loads(summary_path.read_text()) if summary_path and summary_path.is_file() else None
    return {
        "result": result,
        "work": work,
        "store": store,
        "ui_port": ui_port,
        "seconds": seconds,
        "run_dir": run_dirs[-1] if run_dirs else None,
        "summary": summary,
    }


@pytest.fixture(scope="session")
def gemrec_script() -> str:
    return gemrec_cli()


@pytest.fixture(scope="session")
def orphans():
    """orphans(text): live processes whose command line mentions `text`."""
    return live_processes_mentioning
