"""`rackplane up`'s server: the API under uvicorn, with the local node agent and a Celery
worker (with beat) as children. Apart from the CLI's module because uvicorn is imported for
this command alone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import uvicorn

from app.cli import local_agent
from app.cli.common import ROOT, console, err
from app.core import pubsub
from app.core.config import get_settings
from app.core.processes import stop_groups
from workers.settings import worker_command

# After SIGTERM or SIGINT: the server's graceful stop (3 s for requests in flight), then its
# children's (a worker's running tasks); past this, whatever hangs is stopped regardless.
STOP_DEADLINE_S = 30.0


class _Server(uvicorn.Server):
    """uvicorn's server, whose stop wakes every long poll (agents' assignments) to answer now,
    and which is stopped outright if its graceful stop hangs past STOP_DEADLINE_S."""

    children: list[subprocess.Popen] = []

    def handle_exit(self, sig: int, frame: Any) -> None:
        try:
            asyncio.get_running_loop().call_soon_threadsafe(pubsub.hub.shut)
        except RuntimeError:  # not from the loop's thread: no loop to hand it to
            pubsub.hub.closing = True
        if not self.should_exit:
            timer = threading.Timer(STOP_DEADLINE_S, self._overdue, args=(sig,))
            timer.daemon = True  # a process that stopped in time does not wait for it
            timer.start()
        super().handle_exit(sig, frame)

    def _overdue(self, sig: int) -> None:
        err.print(
            f"[red]still stopping {STOP_DEADLINE_S:g} s after {signal.Signals(sig).name}: "
            "stopping now[/red]"
        )
        stop_groups(self.children, timeout=5)
        os._exit(1)


def _gateway(host: str, port: int, log_path) -> subprocess.Popen:
    """The inference gateway, as a child process in its own session, logging to `log_path`."""
    out = open(log_path, "ab")  # noqa: SIM115 (the child's, for as long as it runs)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "app.cli", "gateway", "--host", host, "--port", str(port)],
            cwd=ROOT,
            env={**os.environ, "RACKPLANE_LOG_FILE": str(log_path)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        out.close()


def gateway(host: str, port: int) -> None:
    """Serve the inference gateway (app/gateway) until SIGTERM or SIGINT."""
    uvicorn.run(
        "app.gateway.app:create_gateway",
        factory=True,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=3,
    )


def serve(
    host: str,
    port: int,
    base: str,
    children: list[subprocess.Popen],
    agent: bool | None,
    worker: bool,
    concurrency: int,
) -> None:
    """Start the children (each appended to `children` as it starts, for the caller to stop),
    then serve the API until SIGTERM or SIGINT."""
    settings = get_settings()
    # Logs to files, so the console stays for people (errors still show there); a log file
    # the operator chose is kept for the API, and the worker gets its own beside it.
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if settings.log_file is None:
        settings.log_file = logs / "api.log"  # read by the app this process serves
    worker_log = settings.log_file.with_name("worker.log")
    agent_started = False
    if agent if agent is not None else settings.local_agent:
        if "RACKPLANE_PUBLIC_API_URL" not in os.environ:
            settings.public_api_url = base  # what this process tells the runs to report to
        children.append(local_agent.start(base))
        agent_started = True
        console.print(
            f"  node agent {local_agent.NODE} (4 made-up GPUs: examples/local-0.yaml), "
            "runs work submitted with region `local`"
        )
    if settings.gateway_port:
        children.append(_gateway(host, settings.gateway_port, logs / "gateway.log"))
        console.print(
            f"  gateway    http://{host}:{settings.gateway_port}/e/{{endpoint}}/...  "
            "(inference endpoints; a key with the `invoke` scope)"
        )
    if worker:
        cmd = worker_command(
            f"rackplane-{os.getpid()}@%h",
            beat=True,
            concurrency=concurrency,
            loglevel=settings.log_level,
        )
        # Its own process group, so the worker's pool and beat children stop with it.
        out = open(worker_log, "ab")  # noqa: SIM115 (the child's, for as long as it runs)
        children.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**os.environ, "RACKPLANE_LOG_FILE": str(worker_log)},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        out.close()
    console.print(
        f"  logs       {settings.log_file}, {worker_log.name} beside it"
        + (f"; the node agent's: {local_agent.log_path()}" if agent_started else "")
        + " (errors show here too)",
        soft_wrap=True,
    )
    sys.stdout.flush()
    # An agent's blocking query holds its request open for up to a minute: the server wakes it
    # to answer at once when it stops (the agent asks again, of whichever server answers).
    server = _Server(
        uvicorn.Config(
            "app.main:app",
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=3,
        )
    )
    server.children = children
    server.run()
