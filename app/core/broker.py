"""The Celery application as a client of the broker: crash-safe settings, named queues, the beat
schedule. Whoever sends a task (the outbox) uses it; a worker process (`workers.celery_app`)
adds the task modules and its signals to the same object."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from celery import Celery
from kombu import Queue

from app.core.config import Settings, get_settings
from app.core.redis import sentinel_parts

QUEUES = ("default", "fleet", "placement", "provisioning", "health", "metering", "billing")
# Longest task we expect, with margin; Redis redelivers unacked tasks after this.
VISIBILITY_TIMEOUT_S = 2 * 3600


def celery_settings(s: Settings) -> dict[str, Any]:
    # kombu's SQLAlchemy transport hands every transport option to create_engine, so the
    # Redis-only options are set only for Redis (the SQLite broker redelivers on restart).
    transport: dict[str, Any] = {}
    if s.redis_url:
        transport["visibility_timeout"] = VISIBILITY_TIMEOUT_S
        if s.broker_key_prefix:
            transport["global_keyprefix"] = s.broker_key_prefix
        parts = sentinel_parts(s.redis_url)
        if parts is not None:  # through Sentinel: the master it names, after any failover
            _, master, db, password = parts
            transport.update(master_name=master, db=db)
            if password:
                transport["password"] = password
    return {
        "broker_url": s.broker_url,
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "broker_connection_timeout": 3,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # One unacknowledged message per pool process, so a crash loses nothing in flight.
        # Not on the embedded SQLite broker: its transport has no event loop, so the worker
        # takes acknowledgements between 2-second waits for messages (celery's synloop), one
        # task per wait with a prefetch of 1 -- fewer than beat alone sends, and a submission
        # queued behind the backlog for 30-50 s. It redelivers what was reserved on restart.
        "worker_prefetch_multiplier": 1 if s.redis_url else 32,
        "task_ignore_result": True,
        "task_always_eager": s.celery_always_eager,
        "task_default_queue": "default",
        "task_queues": [Queue(q) for q in QUEUES],
        "task_routes": {
            "fleet.*": {"queue": "fleet"},
            "outbox.*": {"queue": "default"},
            "idempotency.*": {"queue": "default"},
            "sessions.*": {"queue": "default"},
            "logs.*": {"queue": "default"},
            "placement.*": {"queue": "placement"},
            "endpoints.*": {"queue": "placement"},
            "workloads.*": {"queue": "provisioning"},
            "health.*": {"queue": "health"},
            "chaos.*": {"queue": "health"},
            "metering.*": {"queue": "metering"},
            "billing.*": {"queue": "billing"},
        },
        "task_serializer": "json",
        "accept_content": ["json"],
        "timezone": "UTC",
        "worker_hijack_root_logger": False,
        "worker_send_task_events": False,
        "beat_schedule": _beat_schedule(s),
        "beat_schedule_filename": str((s.data_dir / "celerybeat-schedule").resolve()),
        # One beat sends each schedule however many run (workers/beat.py).
        "beat_scheduler": "workers.beat:LeasedScheduler",
        # Reconnects within a second of a broker failover, not after kombu's growing back-off.
        "worker_consumer": "workers.consumer:FailoverConsumer",
    }


@lru_cache
def get_celery() -> Celery:
    """The process's Celery application, configured from the settings on first use."""
    app = Celery("rackplane")
    app.conf.update(celery_settings(get_settings()))
    return app


def _beat_schedule(s: Settings) -> dict[str, Any]:
    """Every reconciler beat sends, and how often: each a sweep or tick that is idempotent."""
    return {
        "outbox.drain": {"task": "outbox.drain", "schedule": 5.0},
        "idempotency.purge": {"task": "idempotency.purge", "schedule": 3600.0},
        "sessions.purge": {"task": "sessions.purge", "schedule": 3600.0},
        "logs.prune": {"task": "logs.prune", "schedule": 3600.0},
        "placement.tick": {"task": "placement.tick", "schedule": s.placement_tick_seconds},
        "endpoints.autoscale": {
            "task": "endpoints.autoscale",
            "schedule": s.endpoint_tick_seconds,
        },
        "workloads.reconcile": {"task": "workloads.reconcile", "schedule": 10.0},
        "workloads.holds": {"task": "workloads.holds", "schedule": 5.0},
        "health.sweep": {"task": "health.sweep", "schedule": s.health_sweep_seconds},
        "fleet.upgrades": {"task": "fleet.upgrades", "schedule": s.upgrade_tick_seconds},
        "agents.mig_layouts": {
            "task": "agents.mig_layouts",
            "schedule": s.mig_relayout_seconds,
        },
        "chaos.watch": {"task": "chaos.watch", "schedule": 5.0},
        "billing.budgets": {"task": "billing.budgets", "schedule": s.budget_eval_seconds},
        "billing.meter_export": {
            "task": "billing.meter_export",
            "schedule": s.meter_export_seconds,
        },
    }
