"""The worker process's Celery application: the broker client of `app.core.broker`, with every
task module and the signals a worker process needs."""

from __future__ import annotations

import gc

from celery import signals

import app.models  # noqa: F401  (every model registered: tasks flush across foreign keys)
from app.core.broker import get_celery
from app.core.config import get_settings

celery_app = get_celery()
celery_app.autodiscover_tasks(
    [
        "app.fleet",
        "app.outbox",
        "app.idempotency",
        "app.sessions",
        "app.logs",
        "app.scheduling",
        "app.workloads",
        "app.billing",
        "app.health",
        "app.chaos",
        "app.agents",
        "app.endpoints",
    ],
    related_name="tasks",
    force=True,
)


@signals.worker_process_init.connect
def _fresh_engine(**_kwargs) -> None:
    """A forked worker child must not reuse the parent's database connections."""
    from app.core.db import get_engine

    get_engine().dispose(close=False)


@signals.worker_ready.connect
@signals.worker_process_init.connect
def _freeze(**_kwargs) -> None:
    """What start-up built (the app, its models, every task module) lives as long as the
    process: out of the collector's sight, as in the API (app/main.py). A full collection of
    the pool process walked its 150-210k objects, 120-160 ms each time (more on a busy
    machine), while submissions waited for the next placement cycle."""
    gc.collect()
    gc.freeze()


@signals.setup_logging.connect
def _logging(**_kwargs) -> None:
    from app.core.logging import configure_logging

    s = get_settings()
    configure_logging(s.log_level, s.log_json, s.log_file)


@signals.task_prerun.connect
def _bind_task(task_id=None, task=None, **_kwargs) -> None:
    """Every log line of a task carries its id and name, as request logs carry the request id."""
    import structlog

    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(task_id=task_id, task=getattr(task, "name", None))
