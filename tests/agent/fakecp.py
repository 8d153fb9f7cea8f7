"""A tiny in-process control plane speaking the agent's routes (rackplane_wire), for tests."""

from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from rackplane_wire import Inventory, LogBatch, StatusReport


def _seconds(wait: str) -> float:
    if wait.endswith("ms"):
        return float(wait[:-2]) / 1000
    return float(wait.rstrip("s"))


class FakeControlPlane:
    def __init__(self) -> None:
        self.tokens = {"rpj_good"}
        self.credentials: set[str] = set()
        self.revoked = False
        self.cond = threading.Condition()
        self.index = 0
        self.assignments: list[dict[str, Any]] = []
        self.heartbeat_s = 0.5
        self.inventories: list[Inventory] = []
        self.reports: list[tuple[float, StatusReport]] = []
        self.chunks: list[dict[str, Any]] = []
        self.telemetry: list[tuple[str, str]] = []
        self.status_failures: list[tuple[int, dict[str, str]]] = []
        self.status_answers: list[tuple[float, int]] = []  # (when, HTTP status)
        self.logs_route = True
        self.telemetry_route = True
        self.exporter_text = (
            "# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n"
            'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-0",Hostname="node-1"} 40\n'
        )
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    # --- the test's controls ---

    def start(self) -> FakeControlPlane:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def set_assignments(self, items: list[Any]) -> None:
        with self.cond:
            self.assignments = [
                a if isinstance(a, dict) else a.model_dump(mode="json") for a in items
            ]
            self.index += 1
            self.cond.notify_all()

    def revoke(self) -> None:
        with self.cond:
            self.revoked = True
            self.cond.notify_all()

    def last_run(self, workload_id: str):
        with self.cond:
            for _, report in reversed(self.reports):
                for run in report.runs:
                    if run.workload_id == workload_id:
                        return run
        return None

    def output(self, workload_id: str) -> str:
        with self.cond:
            got = {c["offset"]: c["data"] for c in self.chunks if c["workload_id"] == workload_id}
        return "".join(got[k] for k in sorted(got))

    # --- the server ---

    def _handler(self):
        cp = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any = None, headers: dict | None = None) -> None:
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(status)
                ctype = "application/problem+json" if status >= 400 else "application/json"
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _problem(self, status: int, code: str, headers: dict | None = None) -> None:
                self._send(
                    status,
                    {
                        "type": "about:blank",
                        "title": code,
                        "status": status,
                        "detail": code,
                        "code": code,
                    },
                    headers,
                )

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _authorized(self) -> bool:
                auth = self.headers.get("Authorization", "")
                token = auth.removeprefix("Bearer ")
                return token in cp.credentials and not cp.revoked

            def do_POST(self) -> None:
                self._route("POST")

            def do_PUT(self) -> None:
                self._route("PUT")

            def do_GET(self) -> None:
                self._route("GET")

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                path = url.path
                cp.requests.append((method, path))
                body = self._body()
                if (method, path) == ("POST", "/v1/agent/join"):
                    token = json.loads(body)["token"]
                    if token not in cp.tokens:
                        return self._problem(401, "invalid_join_token")
                    cp.tokens.discard(token)
                    cred = "rpn_" + secrets.token_hex(8)
                    cp.credentials.add(cred)
                    return self._send(
                        201,
                        {
                            "node_id": "n-1",
                            "node_name": "node-1",
                            "credential": cred,
                            "credential_prefix": cred[:8],
                        },
                    )
                if (method, path) == ("GET", "/metrics"):  # a dcgm-exporter
                    data = cp.exporter_text.encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return None
                if not path.startswith("/v1/agent/"):
                    return self._problem(404, "not_found")
                if not self._authorized():
                    return self._problem(401, "invalid_node_credential")
                if (method, path) == ("GET", "/v1/agent/node"):
                    return self._send(
                        200,
                        {
                            "node_id": "n-1",
                            "node_name": "node-1",
                            "region": "r1",
                            "rack": "hgx-1",
                            "gpu_model": "H100-80GB",
                            "gpus": 2,
                        },
                    )
                if (method, path) == ("PUT", "/v1/agent/inventory"):
                    inv = Inventory.model_validate_json(body)
                    cp.inventories.append(inv)
                    return self._send(
                        200,
                        {
                            "node": "node-1",
                            "matches": False,
                            "differences": ["GPU 2 missing"],
                            "node_state": "ready",
                        },
                    )
                if (method, path) == ("GET", "/v1/agent/assignments"):
                    q = parse_qs(url.query)
                    index = int(q["index"][0])
                    deadline = time.monotonic() + _seconds(q["wait"][0])
                    with cp.cond:
                        while cp.index <= index and not cp.revoked:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            cp.cond.wait(left)
                        if cp.revoked:
                            return self._problem(401, "invalid_node_credential")
                        answer = {
                            "node": "node-1",
                            "index": cp.index,
                            "assignments": cp.assignments,
                            "heartbeat_s": cp.heartbeat_s,
                        }
                    return self._send(200, answer)
                if (method, path) == ("POST", "/v1/agent/status"):
                    with cp.cond:
                        if cp.status_failures:
                            status, headers = cp.status_failures.pop(0)
                            cp.status_answers.append((time.monotonic(), status))
                            return self._problem(status, "unavailable", headers)
                        report = StatusReport.model_validate_json(body)
                        cp.reports.append((time.monotonic(), report))
                        cp.status_answers.append((time.monotonic(), 200))
                    return self._send(200, {"accepted": len(report.runs), "stale": 0})
                if (method, path) == ("POST", "/v1/agent/logs"):
                    if not cp.logs_route:
                        return self._problem(404, "not_found")
                    batch = LogBatch.model_validate_json(body)
                    with cp.cond:
                        cp.chunks += [c.model_dump(mode="json") for c in batch.chunks]
                    return self._send(200, {"accepted": len(batch.chunks), "stale": 0})
                if (method, path) == ("POST", "/v1/agent/telemetry"):
                    if not cp.telemetry_route:
                        return self._problem(404, "not_found")
                    cp.telemetry.append((self.headers.get("Content-Type", ""), body.decode()))
                    return self._send(200, {"accepted": 1})
                return self._problem(404, "not_found")

        return Handler
