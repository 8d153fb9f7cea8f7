"""Settings, read once from the environment (prefix-free names, as operators expect)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.limits import parse


class Settings(BaseSettings):
    """Every knob Rackplane reads. Unset database/broker means the embedded default."""

    # Besides the environment: `.env` in the working directory, or the file RACKPLANE_ENV_FILE
    # names ("": none; the tests set that, so a checkout's own `.env` never changes them).
    model_config = SettingsConfigDict(
        env_file=os.environ.get("RACKPLANE_ENV_FILE", ".env") or None, extra="ignore"
    )

    data_dir: Path = Field(default=Path(".rackplane"), alias="RACKPLANE_DATA_DIR")
    database_url: str | None = Field(default=None, alias="DATABASE_URL")
    redis_url: str | None = Field(default=None, alias="REDIS_URL")
    # The beat lease's name: beats that share a broker and this name send each schedule once
    # between them (workers/beat.py).
    beat_lease: str = Field(
        default="default", alias="RACKPLANE_BEAT_LEASE", pattern=r"^[a-z0-9-]+$"
    )
    # Prefix for every Redis key Celery uses, so several deployments can share one Redis.
    broker_key_prefix: str = Field(default="", alias="RACKPLANE_BROKER_PREFIX")
    api_host: str = Field(default="127.0.0.1", alias="RACKPLANE_HOST")
    api_port: int = Field(default=8000, alias="RACKPLANE_PORT")
    # Where `rackplane up` runs its inference gateway (`rackplane gateway`; 0: none).
    gateway_port: int = Field(default=8001, ge=0, le=65_535, alias="RACKPLANE_GATEWAY_PORT")
    log_level: str = Field(default="INFO", alias="RACKPLANE_LOG_LEVEL")
    log_json: bool = Field(default=True, alias="RACKPLANE_LOG_JSON")
    # Where the logs go: stderr (unset), or this file with only errors on stderr besides
    # (`rackplane up` sets one per process, so its console stays for people).
    log_file: Path | None = Field(default=None, alias="RACKPLANE_LOG_FILE")
    max_body_bytes: int = Field(default=1_048_576, alias="RACKPLANE_MAX_BODY_BYTES")
    max_import_bytes: int = Field(default=32 * 1_048_576, alias="RACKPLANE_MAX_IMPORT_BYTES")
    # Requests inside the app at once, per API process: below the database pool (each holds at
    # most one connection at a time), so a request never waits for a connection that another
    # request holds while it waits for a thread. The rest queue; past the timeout they get 503.
    # Few, because one process runs Python on one core at a time: a handful of requests in
    # flight is enough to cover their database waits, while more only fight over the GIL (at
    # 100 submissions/s, 24 in flight cost ~30 % more API CPU than 8 and tipped it over).
    api_max_in_flight: int = Field(default=8, ge=1, alias="RACKPLANE_API_MAX_IN_FLIGHT")
    api_queue_timeout_seconds: float = Field(
        default=15.0, gt=0, alias="RACKPLANE_API_QUEUE_TIMEOUT_SECONDS"
    )
    # How long an API process trusts a key it has checked (0: never). Any committed change to a
    # key or tenant ends that at once everywhere, through an epoch in Redis (app/tenancy/auth.py);
    # without Redis nothing is cached.
    auth_cache_seconds: float = Field(default=30.0, ge=0, alias="RACKPLANE_AUTH_CACHE_SECONDS")
    # Server secrets (app/core/secrets.py): the pepper mixed into API-key hashes, and the key
    # that encrypts stored responses. Generated in the data directory on the embedded default;
    # required on PostgreSQL.
    key_pepper: str = Field(default="", alias="RACKPLANE_KEY_PEPPER")
    secret_key: str = Field(default="", alias="RACKPLANE_SECRET_KEY")
    # Token buckets per API key by route class (app/ratelimit): N per second, minute or hour;
    # "off" limits nothing. A tenant's keys together get `tenant_factor` times one key's;
    # an operator key `operator_factor` times (0: operators are exempt).
    rate_limits: str = Field(
        default="read=200/s,write=100/s,expensive=5/s,signup=20/m,signin=30/m,anonymous=60/m",
        alias="RACKPLANE_RATE_LIMITS",
    )
    rate_limit_tenant_factor: float = Field(
        default=4.0, ge=1, alias="RACKPLANE_RATE_LIMIT_TENANT_FACTOR"
    )
    rate_limit_operator_factor: float = Field(
        default=10.0, ge=0, alias="RACKPLANE_RATE_LIMIT_OPERATOR_FACTOR"
    )
    # Portal sign-ins (app/sessions): a session ends after this long unused, and this long after
    # it began whatever its use.
    session_idle_seconds: float = Field(default=1800.0, gt=0, alias="RACKPLANE_SESSION_IDLE")
    session_max_seconds: float = Field(default=43200.0, gt=0, alias="RACKPLANE_SESSION_MAX")
    idempotency_ttl_hours: int = Field(default=24, alias="RACKPLANE_IDEMPOTENCY_TTL_HOURS")
    seed_demo: bool = Field(default=True, alias="RACKPLANE_SEED_DEMO")
    celery_always_eager: bool = Field(default=False, alias="RACKPLANE_CELERY_EAGER")
    # The simulated provider (embedded default and tests): boot time and failure rate.
    sim_boot_seconds: float = Field(default=3.0, ge=0, alias="RACKPLANE_SIM_BOOT_SECONDS")
    sim_fail_rate: float = Field(default=0.0, ge=0, le=1, alias="RACKPLANE_SIM_FAIL_RATE")
    # Node agents (app/agents): a placed workload whose agents have not all started it this long
    # after provisioning began goes back to the queue (image pulls count); an agent waiting for
    # its assignments is answered after at most this long; the URL runs are told to report to.
    agent_start_timeout_seconds: float = Field(
        default=300.0, gt=0, alias="RACKPLANE_AGENT_START_TIMEOUT"
    )
    agent_max_wait_seconds: float = Field(default=60.0, gt=0, alias="RACKPLANE_AGENT_MAX_WAIT")
    # Each node's agent has a token bucket of its own on the agent's routes (by its node, not
    # by route class): this many requests a second, bursts of up to `burst` (0: no limit). An
    # agent long-polls its assignments, reports status every third of a heartbeat and on
    # changes, ships logs about once a second and telemetry every 10 s: a few a second.
    agent_rate_limit: float = Field(default=20.0, ge=0, alias="RACKPLANE_AGENT_RATE_LIMIT")
    agent_rate_burst: float = Field(default=100.0, ge=1, alias="RACKPLANE_AGENT_RATE_BURST")
    # Body caps of an agent's pushes: one node's dcgm-exporter scrape (~100 KiB for 8 GPUs)
    # and one batch of its runs' output (the agent sends at most 512 KiB of output a batch and
    # halves that after a 413).
    max_agent_telemetry_bytes: int = Field(
        default=1_048_576, gt=0, alias="RACKPLANE_MAX_AGENT_TELEMETRY_BYTES"
    )
    max_agent_log_bytes: int = Field(
        default=2 * 1_048_576, gt=0, alias="RACKPLANE_MAX_AGENT_LOG_BYTES"
    )
    # The pools whose agents' nodes may run the `process` runtime (comma-separated; `*`: every
    # pool): the operator's word that those nodes are trusted or single-tenant. Elsewhere a
    # tenant's work runs in a container (or a VM), never as a bare process beside another
    # tenant's. `local` is the embedded default's local-0.
    process_pools: str = Field(default="local", alias="RACKPLANE_PROCESS_POOLS")
    public_api_url: str = Field(default="http://127.0.0.1:8000", alias="RACKPLANE_PUBLIC_API_URL")
    # `rackplane up` adds the local node local-0 and runs its agent (the embedded walkthrough).
    local_agent: bool = Field(default=True, alias="RACKPLANE_LOCAL_AGENT")
    # Workload logs (app/logs): a workload keeps at most this many bytes of output (its oldest
    # chunks go first), and no chunk longer than this many hours after it arrived.
    log_max_bytes_per_workload: int = Field(
        default=8 * 1_048_576, ge=1, alias="RACKPLANE_LOG_MAX_BYTES_PER_WORKLOAD"
    )
    log_retention_hours: float = Field(default=72.0, gt=0, alias="RACKPLANE_LOG_RETENTION_HOURS")
    # A preempted workload may checkpoint for this long before it is stopped.
    preemption_grace_seconds: float = Field(default=120.0, ge=0, alias="RACKPLANE_PREEMPTION_GRACE")
    # Unset: work-conserving fair share. A number >= 1: while others wait, no tenant starts more
    # work beyond this multiple of its fair share (QueueConfig.share_cap).
    fair_share_cap: float | None = Field(default=None, ge=1, alias="RACKPLANE_FAIR_SHARE_CAP")
    stripe_api_key: str | None = Field(default=None, alias="RACKPLANE_STRIPE_API_KEY")
    stripe_api_base: str | None = Field(default=None, alias="RACKPLANE_STRIPE_API_BASE")
    # Usage goes to Stripe per bucket of this many seconds, once the bucket ended this long ago
    # (late ledger events after that become corrections).
    meter_bucket_seconds: int = Field(default=3600, ge=1, le=86400, alias="RACKPLANE_METER_BUCKET")
    meter_settle_seconds: float = Field(default=300.0, ge=0, alias="RACKPLANE_METER_SETTLE")
    meter_export_seconds: float = Field(default=60.0, gt=0, alias="RACKPLANE_METER_EXPORT_EVERY")
    # Every so often the planner compares the whole 34-day window with Stripe, not only what
    # changed since its last run: it catches anything its late-row search could not see.
    meter_full_pass_seconds: float = Field(default=21600.0, gt=0, alias="RACKPLANE_METER_FULL_PASS")
    budget_eval_seconds: float = Field(default=60.0, gt=0, alias="RACKPLANE_BUDGET_EVAL_SECONDS")
    placement_tick_seconds: float = Field(default=5.0, gt=0, alias="RACKPLANE_PLACEMENT_TICK")
    # --- inference endpoints (app/endpoints, app/gateway) -----------------------------------
    # The autoscaler's tick, and Knative's KPA windows: the stable window it averages over (and
    # the quiet it waits before scaling to zero), the panic window a burst is seen in, and how
    # long a lower target must hold before replicas go.
    endpoint_tick_seconds: float = Field(default=1.0, gt=0, alias="RACKPLANE_ENDPOINT_TICK")
    endpoint_stable_window_s: float = Field(
        default=60.0, gt=0, alias="RACKPLANE_ENDPOINT_STABLE_WINDOW"
    )
    endpoint_panic_window_s: float = Field(
        default=6.0, gt=0, alias="RACKPLANE_ENDPOINT_PANIC_WINDOW"
    )
    endpoint_scale_down_delay_s: float = Field(
        default=300.0, ge=0, alias="RACKPLANE_ENDPOINT_SCALE_DOWN_DELAY"
    )
    # The gateway holds a request for an endpoint with no ready replica this long at most, and
    # this many per endpoint at most (Knative's activator), while the first replica starts.
    gateway_hold_s: float = Field(default=90.0, ge=0, alias="RACKPLANE_GATEWAY_HOLD_S")
    gateway_max_held: int = Field(default=256, ge=0, alias="RACKPLANE_GATEWAY_MAX_HELD")
    # --- the GPU health loop (app/health) ---------------------------------------------------
    max_telemetry_bytes: int = Field(
        default=32 * 1_048_576, gt=0, alias="RACKPLANE_MAX_TELEMETRY_BYTES"
    )
    # A node whose agent has not pushed for this long is unreachable (a fault).
    # GraphQL: limits checked before a query runs, and whether the schema may be introspected.
    graphql_max_depth: int = Field(default=10, ge=2, alias="RACKPLANE_GRAPHQL_MAX_DEPTH")
    graphql_max_aliases: int = Field(default=15, ge=1, alias="RACKPLANE_GRAPHQL_MAX_ALIASES")
    graphql_max_tokens: int = Field(default=2000, ge=50, alias="RACKPLANE_GRAPHQL_MAX_TOKENS")
    # Upper bound of a query's work: fields x the page items they may return (app/graphql/limits).
    graphql_max_cost: int = Field(default=50_000, ge=100, alias="RACKPLANE_GRAPHQL_MAX_COST")
    graphql_introspection: bool = Field(default=True, alias="RACKPLANE_GRAPHQL_INTROSPECTION")
    heartbeat_timeout_seconds: float = Field(
        default=90.0, gt=0, alias="RACKPLANE_HEARTBEAT_TIMEOUT"
    )
    # The ports a gang's rendezvous (`MASTER_PORT`) is chosen from, per attempt: FIRST-LAST.
    master_ports: str = Field(
        default="20000-29999", pattern=r"^[0-9]{4,5}-[0-9]{4,5}$", alias="RACKPLANE_MASTER_PORTS"
    )
    # How often the beat looks for silent nodes, lost repair messages and ended bursts.
    health_sweep_seconds: float = Field(default=15.0, gt=0, alias="RACKPLANE_HEALTH_SWEEP")
    # Per-GPU aggregates go to the database at most this often (and at once with a fault).
    telemetry_flush_seconds: float = Field(
        default=300.0, ge=0, alias="RACKPLANE_TELEMETRY_FLUSH_SECONDS"
    )
    # Fault signals on a node within this window of each other are one incident (NVIDIA's
    # fleet tooling: three minutes without an Xid ends a burst).
    incident_window_seconds: float = Field(default=180.0, gt=0, alias="RACKPLANE_INCIDENT_WINDOW")
    # The circuit breaker: automatic quarantine takes at most this share of a region's (and of a
    # rack's) GPUs out within the window, and never fewer than `breaker_min_gpus`.
    breaker_region_share: float = Field(default=0.10, gt=0, le=1, alias="RACKPLANE_BREAKER_REGION")
    breaker_rack_share: float = Field(default=0.50, gt=0, le=1, alias="RACKPLANE_BREAKER_RACK")
    breaker_window_seconds: float = Field(default=3600.0, gt=0, alias="RACKPLANE_BREAKER_WINDOW")
    breaker_min_gpus: int = Field(default=8, ge=0, alias="RACKPLANE_BREAKER_MIN_GPUS")
    # The simulated provider's repairs: a GPU reset takes seconds, a node reboot minutes; each
    # fails with this probability (then the GPU goes out of service).
    sim_reset_seconds: float = Field(default=5.0, ge=0, alias="RACKPLANE_SIM_RESET_SECONDS")
    sim_reboot_seconds: float = Field(default=180.0, ge=0, alias="RACKPLANE_SIM_REBOOT_SECONDS")
    sim_repair_fail_rate: float = Field(default=0.0, ge=0, le=1, alias="RACKPLANE_SIM_REPAIR_FAIL")
    # After a repair a GPU is validated this long; a fatal fault within `refault_window` of a
    # repair sends it out of service instead of through another repair.
    validate_seconds: float = Field(default=10.0, ge=0, alias="RACKPLANE_VALIDATE_SECONDS")
    # Burn-in: nodes with an agent pass a validation suite before they take work (bring-up,
    # after a node-level repair or an RMA return). The suite: a YAML file of steps
    # (`{steps: [{name, command, timeout_s, min_busbw_gbps?, optional?}]}`), or by default
    # dcgmi diag -r 3 and an NCCL all-reduce across the node's GPUs (app/health/burnin.py).
    burn_in: bool = Field(default=True, alias="RACKPLANE_BURN_IN")
    burn_in_suite: Path | None = Field(default=None, alias="RACKPLANE_BURN_IN_SUITE")
    # Rolling upgrades (app/fleet/upgrades.py): how each stack component is installed on a
    # host, a YAML file `{component: {command: [argv...], timeout_s?}}` with `{version}`,
    # `{component}` and `{stack}` in argv (checked when the API starts; an upgrade keeps the
    # commands it began with), and how often the upgrade controller looks again.
    upgrade_commands: Path | None = Field(default=None, alias="RACKPLANE_UPGRADE_COMMANDS")
    upgrade_tick_seconds: float = Field(default=10.0, gt=0, alias="RACKPLANE_UPGRADE_TICK")
    # MIG layouts that follow demand (app/agents/miglayout.py): on nodes whose agents can lay
    # MIG instances out, idle GPUs are re-laid for what the queue waits for, this often.
    mig_relayout: bool = Field(default=True, alias="RACKPLANE_MIG_RELAYOUT")
    mig_relayout_seconds: float = Field(default=30.0, gt=0, alias="RACKPLANE_MIG_RELAYOUT_TICK")
    refault_window_seconds: float = Field(default=86400.0, ge=0, alias="RACKPLANE_REFAULT_WINDOW")
    # Chaos experiments (app/chaos): off unless asked for.
    chaos_enabled: bool = Field(default=False, alias="RACKPLANE_CHAOS_ENABLED")
    # A measured slowdown fades toward the model's nominal with this time constant.
    perf_decay_seconds: float = Field(default=21600.0, gt=0, alias="RACKPLANE_PERF_DECAY")

    @field_validator("rate_limits")
    @classmethod
    def _rate_limits(cls, value: str) -> str:
        parse(value)  # a typo is a refusal to start, not a silent absence of limits
        return value

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            url = self.database_url
            # Accept the common libpq spelling and use psycopg 3.
            if url.startswith("postgres://"):
                url = "postgresql://" + url[len("postgres://") :]
            if url.startswith("postgresql://"):
                url = "postgresql+psycopg://" + url[len("postgresql://") :]
            return url
        return f"sqlite:///{(self.data_dir / 'rackplane.sqlite').resolve()}"

    @property
    def is_sqlite(self) -> bool:
        return self.sqlalchemy_url.startswith("sqlite")

    @property
    def broker_url(self) -> str:
        if self.redis_url and self.redis_url.startswith("redis+sentinel://"):
            # kombu's Sentinel transport: each Sentinel, and the master's name and db in the
            # transport options (app/core/broker.py).
            hosts = self.redis_url.removeprefix("redis+sentinel://").rsplit("@", 1)[-1]
            hosts = hosts.split("/", 1)[0]
            return ";".join(f"sentinel://{h}" for h in hosts.split(","))
        if self.redis_url:
            return self.redis_url
        # Embedded default: kombu's SQLAlchemy transport on its own SQLite file, so the
        # broker's polling never contends with the application database's write lock.
        return f"sqla+sqlite:///{(self.data_dir / 'broker.sqlite').resolve()}"


@lru_cache
def get_settings() -> Settings:
    return Settings()
