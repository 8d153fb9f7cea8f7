"""How a Celery worker process is started on Rackplane's queues."""

from __future__ import annotations

import sys

from app.core.broker import QUEUES


def worker_command(
    name: str | None = None,
    *,
    beat: bool = False,
    concurrency: int = 1,
    loglevel: str = "INFO",
    queues: tuple[str, ...] = QUEUES,
) -> list[str]:
    """The command line of a Celery worker on Rackplane's queues (`name` as its node name)."""
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "workers.celery_app",
        "worker",
        "-Q",
        ",".join(queues),
        "--concurrency",
        str(concurrency),
        "--loglevel",
        loglevel,
    ]
    if name:
        argv += ["-n", name]
    if beat:
        argv.append("--beat")
    return argv
