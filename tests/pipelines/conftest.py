import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


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
