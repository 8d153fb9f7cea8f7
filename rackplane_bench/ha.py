"""The high-availability topology of issue 38 on one machine, from Debian's engines: one etcd, a
three-member Patroni cluster of PostgreSQL with synchronous replication, Redis with two replicas
and three Sentinels, and Rackplane over them (two API processes, two Celery workers, one beat).

`python -m rackplane_bench.ha up [--dir .ha]` starts it and leaves it running (`make ha`);
`... down` stops it. The failover benchmark and the CI test start the same topology with
`Topology(...)` and kill its parts (`kill_postgres_leader`, `kill_redis_master`, ...).

How Rackplane finds the leaders (docs/ha.md says why this way):
- PostgreSQL through a libpq multi-host URL with `target_session_attrs=read-write`: psycopg tries
  each member and keeps the one that takes writes; SQLAlchemy's pre-ping drops a pooled
  connection to a dead or demoted member before it is used.
- Redis through its Sentinels (`redis+sentinel://s1,s2,s3/rackplane`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rackplane_bench.deploy import api_command, free_port

ROOT = Path(__file__).resolve().parents[1]
SCOPE = "rackplane"  # the Patroni cluster and the Sentinels' master name
DATABASE = "rackplane"
# Patroni: a leader key lives 10 s in etcd unless renewed; a member loops every second. The
# leader's SIGKILL is noticed when its key expires (at most `ttl`), then the synchronous
# standby promotes: writes again within ~10-15 s, against the 30 s.
TTL, LOOP_WAIT, RETRY_TIMEOUT = 10, 1, 4
ENGINES = ("etcd", "patroni", "redis-server", "redis-sentinel")


def missing_engines() -> list[str]:
    return [e for e in ENGINES if shutil.which(e) is None]


def _pg_bin() -> str:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if not found:
        raise RuntimeError("no PostgreSQL server binaries under /usr/lib/postgresql")
    return str(found[-1].parent)


@dataclass
class Ports:
    etcd: int
    etcd_peer: int
    pg: list[int]
    patroni: list[int]
    redis: list[int]
    sentinel: list[int]
    api: list[int]

    @classmethod
    def pick(cls, base: int | None) -> Ports:
        """Fixed ports from `base` (the documented topology), else free ones (tests)."""
        if base is None:
            p = free_port
            return cls(p(), p(), [p(), p(), p()], [p(), p(), p()], [p(), p(), p()],
                       [p(), p(), p()], [p(), p()])  # fmt: skip
        b = base
        return cls(
            etcd=b + 79,
            etcd_peer=b + 80,
            pg=[b + 1, b + 2, b + 3],
            patroni=[b + 11, b + 12, b + 13],
            redis=[b + 21, b + 22, b + 23],
            sentinel=[b + 31, b + 32, b + 33],
            api=[b + 41, b + 42],
        )


@dataclass
class State:
    """What `down` and the benchmark need: ports and the process groups by role."""

    root: str
    ports: Ports
    pids: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def database_url(self) -> str:
        hosts = "&".join(f"host=127.0.0.1:{p}" for p in self.ports.pg)
        return (
            f"postgresql+psycopg://postgres@/{DATABASE}?{hosts}"
            "&target_session_attrs=read-write&connect_timeout=2"
        )

    @property
    def redis_url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports.sentinel)
        return f"redis+sentinel://{hosts}/{SCOPE}"

    @property
    def api_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports.api]


class Topology:
    """The whole topology under `root`; `start()` returns when every part answers."""

    def __init__(
        self,
        root: Path,
        base_port: int | None = None,
        seed_demo: bool = False,
        env: dict[str, str] | None = None,
    ):
        self.extra_env = env or {}
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.state = State(str(self.root), Ports.pick(base_port))
        self.seed_demo = seed_demo
        self.seeded: dict[str, str] | None = None
        self._pg_user = _postgres_user()

    # ----- starting -------------------------------------------------------------------------

    def _spawn(self, role: str, argv: list[str], *, env=None, cwd=None, user=None) -> None:
        log = open(self.root / f"{role}.log", "ab")
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd or self.root,
            start_new_session=True,  # kill() takes its whole group
            user=user,
        )
        self.state.pids[role] = proc.pid
        self._save()

    def _save(self) -> None:
        (self.root / "state.json").write_text(json.dumps(asdict(self.state), indent=1))

    def start(self, app: bool = True) -> State:
        self.start_etcd()
        for i in range(3):
            self.start_member(i)
        self.wait_postgres()
        for i in range(3):
            self.start_redis(i)
        for i in range(3):
            self.start_sentinel(i)
        self.wait_redis()
        if app:
            self.start_app()
        return self.state

    def start_etcd(self) -> None:
        p = self.state.ports
        d = self.root / "etcd"
        d.mkdir(exist_ok=True)
        self._spawn(
            "etcd",
            [
                "etcd",
                "--name", "etcd1",
                "--data-dir", str(d),
                "--listen-client-urls", f"http://127.0.0.1:{p.etcd}",
                "--advertise-client-urls", f"http://127.0.0.1:{p.etcd}",
                "--listen-peer-urls", f"http://127.0.0.1:{p.etcd_peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{p.etcd_peer}",
                "--initial-cluster", f"etcd1=http://127.0.0.1:{p.etcd_peer}",
            ],
        )  # fmt: skip
        _wait(lambda: httpx.get(f"http://127.0.0.1:{p.etcd}/health", timeout=1).is_success, 30)

    def _member_conf(self, i: int) -> Path:
        p = self.state.ports
        d = self.root / f"pg{i + 1}"
        d.mkdir(exist_ok=True)
        conf = {
            "scope": SCOPE,
            "name": f"pg{i + 1}",
            "log": {"level": "WARNING"},
            "restapi": {
                "listen": f"127.0.0.1:{p.patroni[i]}",
                "connect_address": f"127.0.0.1:{p.patroni[i]}",
            },
            "etcd3": {"hosts": f"127.0.0.1:{p.etcd}"},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 1 << 20,
                    # A commit is acknowledged only once a standby has it, and only that
                    # standby may be promoted: an acknowledged write survives the leader.
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "max_connections": 200,
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, "data-checksums"],
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{p.pg[i]}",
                "connect_address": f"127.0.0.1:{p.pg[i]}",
                "data_dir": str(d / "data"),
                "bin_dir": _pg_bin(),
                "pgpass": str(d / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                    "rewind": {"username": "postgres", "password": "postgres"},
                },
                "parameters": {"unix_socket_directories": str(d)},
            },
            "tags": {"nofailover": False, "noloadbalance": False},
        }
        path = d / "patroni.yml"
        path.write_text(json.dumps(conf, indent=1))  # JSON is YAML
        if self._pg_user is not None:
            uid, gid = self._pg_user
            for parent in self.root.parents:
                if not os.stat(parent).st_mode & 0o001:
                    raise RuntimeError(
                        f"{parent} is private: PostgreSQL (as postgres) cannot reach {d}"
                    )
            for x in (self.root, d, path):
                os.chown(x, uid, gid)
        return path

    def start_member(self, i: int) -> None:
        """A Patroni member (and the PostgreSQL it runs), as the postgres user when root:
        initdb refuses to run as root."""
        conf = self._member_conf(i)
        user = self._pg_user[0] if self._pg_user else None
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["PATRONI_LOG_LEVEL"] = "WARNING"
        self._spawn(f"pg{i + 1}", ["patroni", str(conf)], env=env, user=user)

    def patroni(self, i: int, path: str, timeout: float = 1.0) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.state.ports.patroni[i]}{path}", timeout=timeout)

    def cluster(self) -> list[dict[str, Any]]:
        for i in range(3):
            with contextlib.suppress(httpx.HTTPError):
                r = self.patroni(i, "/cluster")
                if r.is_success:
                    return r.json().get("members", [])
        return []

    def postgres_leader(self) -> int | None:
        """The member index Patroni names leader, if any."""
        for m in self.cluster():
            if m.get("role") == "leader" and m.get("state") == "running":
                return int(m["name"].removeprefix("pg")) - 1
        return None

    def wait_postgres(self, timeout: float = 120) -> None:
        """A leader, two streaming replicas and one of them synchronous; then the database."""

        def ready() -> bool:
            members = self.cluster()
            roles = sorted(m.get("role", "") for m in members)
            streaming = [m for m in members if m.get("state") in ("streaming", "running")]
            return len(streaming) == 3 and "leader" in roles and "sync_standby" in roles

        _wait(ready, timeout, what="the Patroni cluster (leader, sync standby, replica)")
        import sqlalchemy as sa

        admin = sa.create_engine(
            self.state.database_url.replace(f"/{DATABASE}?", "/postgres?"),
            isolation_level="AUTOCOMMIT",
        )
        with admin.connect() as c:
            q = sa.text("SELECT 1 FROM pg_database WHERE datname = :d")
            if not c.scalar(q, {"d": DATABASE}):
                c.execute(sa.text(f'CREATE DATABASE "{DATABASE}"'))
        admin.dispose()

    def start_redis(self, i: int) -> None:
        p = self.state.ports
        argv = ["redis-server", "--port", str(p.redis[i]), "--bind", "127.0.0.1"]
        d = self.root / f"redis{i + 1}"
        d.mkdir(exist_ok=True)
        argv += ["--dir", str(d)]
        # Every write is in the append-only file before it is acknowledged to the client
        # (fsync each second): the broker's messages survive a restart of the same node.
        argv += ["--appendonly", "yes"]
        argv += ["--save", ""]
        if i > 0:
            argv += ["--replicaof", "127.0.0.1", str(self._redis_master_port())]
        self._spawn(f"redis{i + 1}", argv)

    def _redis_master_port(self) -> int:
        import redis

        for s in self.state.ports.sentinel:
            with contextlib.suppress(Exception):
                got = redis.Redis(port=s, socket_timeout=0.5).sentinel_get_master_addr_by_name(
                    SCOPE
                )
                if got:
                    return int(got[1])
        return self.state.ports.redis[0]

    def start_sentinel(self, i: int) -> None:
        p = self.state.ports
        conf = self.root / f"sentinel{i + 1}.conf"
        if not conf.exists():  # a Sentinel rewrites its own file with what it learns
            conf.write_text(
                f"port {p.sentinel[i]}\nbind 127.0.0.1\ndir {self.root}\n"
                f"sentinel monitor {SCOPE} 127.0.0.1 {p.redis[0]} 2\n"
                f"sentinel down-after-milliseconds {SCOPE} 1000\n"
                f"sentinel failover-timeout {SCOPE} 6000\n"
                f"sentinel parallel-syncs {SCOPE} 1\n"
            )
        self._spawn(f"sentinel{i + 1}", ["redis-sentinel", str(conf)])

    def redis_master(self) -> int:
        """The Redis node index the Sentinels name master."""
        return self.state.ports.redis.index(self._redis_master_port())

    def wait_redis(self, timeout: float = 60) -> None:
        import redis

        def ready() -> bool:
            s = redis.Redis(port=self.state.ports.sentinel[0], socket_timeout=0.5)
            ok = [r for r in s.sentinel_slaves(SCOPE) if r.get("master-link-status") == "ok"]
            return len(ok) == 2 and len(s.sentinel_sentinels(SCOPE)) == 2

        _wait(ready, timeout, what="Redis (a master, two replicas, three Sentinels)")

    def app_env(self) -> dict[str, str]:
        if not self.state.env:
            import secrets

            self.state.env = {
                "DATABASE_URL": self.state.database_url,
                "REDIS_URL": self.state.redis_url,
                "RACKPLANE_DATA_DIR": str(self.root / "data"),
                "RACKPLANE_KEY_PEPPER": secrets.token_urlsafe(32),
                "RACKPLANE_SECRET_KEY": secrets.token_urlsafe(32),
                "RACKPLANE_SEED_DEMO": "true" if self.seed_demo else "false",
                "RACKPLANE_SIM_BOOT_SECONDS": "0.5",
                "RACKPLANE_PLACEMENT_TICK": "1",
                "RACKPLANE_LOG_JSON": "true",
                "RACKPLANE_LOG_LEVEL": "INFO",
                "RACKPLANE_BEAT_LEASE": "ha",
                **self.extra_env,
            }
            self._save()
        return {**os.environ, **self.state.env}

    def start_app(self) -> None:
        from workers.settings import worker_command

        env = self.app_env()
        (self.root / "data").mkdir(exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "app.cli", "migrate"],
            cwd=ROOT, env=env, check=True, capture_output=True,
        )  # fmt: skip
        if self.seed_demo:  # as `rackplane up` does: the demo fleet, a tenant, keys shown once
            code = "import json; from app.cli.demo import seed_demo; print(json.dumps(seed_demo()))"
            out = subprocess.run(
                [sys.executable, "-c", code],
                cwd=ROOT, env=env, check=True, capture_output=True, text=True,
            )  # fmt: skip
            self.seeded = json.loads(out.stdout.strip().splitlines()[-1])
        for i in range(2):
            self.start_api(i)
        for i in range(2):
            self._spawn(f"worker{i + 1}", worker_command(f"w{i + 1}@ha"), env=env, cwd=ROOT)
        beat = [sys.executable, "-m", "celery", "-A", "workers.celery_app", "beat"]
        beat += ["--loglevel", "INFO", "-s", str(self.root / "data" / "beat-schedule")]
        self._spawn("beat", beat, env=env, cwd=ROOT)
        for url in self.state.api_urls:
            _wait(lambda u=url: httpx.get(f"{u}/healthz", timeout=1).is_success, 60, what=url)
        for i in range(2):
            log = self.root / f"worker{i + 1}.log"
            _wait(lambda p=log: b"ready" in p.read_bytes(), 60, what=f"worker{i + 1}")

    def start_api(self, i: int) -> None:
        argv = api_command(self.state.ports.api[i])
        self._spawn(f"api{i + 1}", argv, env=self.app_env(), cwd=ROOT)

    # ----- failing --------------------------------------------------------------------------

    def kill(self, role: str) -> None:
        """SIGKILL to a role's whole process group, as a machine's loss would."""
        pid = self.state.pids.get(role)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def kill_member(self, i: int) -> None:
        """A Patroni member dies whole: Patroni, and the PostgreSQL it detached (postmaster
        runs in a session of its own, so it outlives Patroni unless killed too)."""
        pidfile = self.root / f"pg{i + 1}" / "data" / "postmaster.pid"
        postmaster = None
        with contextlib.suppress(OSError, ValueError, IndexError):
            postmaster = int(pidfile.read_text().split()[0])
        self.kill(f"pg{i + 1}")
        if postmaster is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(postmaster), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(postmaster, signal.SIGKILL)

    def kill_postgres_leader(self) -> int:
        leader = self.postgres_leader()
        if leader is None:
            raise RuntimeError("no PostgreSQL leader to kill")
        self.kill_member(leader)
        return leader

    def kill_redis_master(self) -> int:
        i = self.redis_master()
        self.kill(f"redis{i + 1}")
        return i

    # ----- stopping -------------------------------------------------------------------------

    def stop(self) -> None:
        stop(self.root)


def _postgres_user() -> tuple[int, int] | None:
    if os.getuid() != 0:
        return None
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("running as root needs a postgres user for initdb") from None
    return pw.pw_uid, pw.pw_gid


def stop(root: Path) -> None:
    """Stop what `root/state.json` names: the application first, the engines last."""
    path = Path(root) / "state.json"
    if not path.exists():
        return
    state = json.loads(path.read_text())
    order = ["beat", "worker1", "worker2", "api1", "api2", "sentinel1", "sentinel2", "sentinel3"]
    order += ["redis1", "redis2", "redis3", "pg1", "pg2", "pg3", "etcd"]
    for role in order:
        pid = state["pids"].get(role)
        if pid is None:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    # Patroni's PostgreSQL runs in sessions of their own: stop what is left of them.
    for i in range(3):
        pidfile = Path(root) / f"pg{i + 1}" / "data" / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError, ProcessLookupError):
            os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
    path.unlink()


def _wait(check, timeout: float, what: str = "", interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"{what or 'the topology'} not ready in {timeout:.0f} s ({last!r})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rackplane_bench.ha", description=__doc__)
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument("--dir", default=".ha", help="Where data, logs and state live.")
    ap.add_argument("--base-port", type=int, default=15400, help="Ports are numbered from it.")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if args.action == "down":
        stop(root)
        print(f"stopped what {root}/state.json named")
        return
    if args.action == "status":
        state = json.loads((root / "state.json").read_text())
        print(json.dumps(state, indent=1))
        return
    if missing_engines():
        sys.exit(f"missing {', '.join(missing_engines())}: run scripts/ensure-ha.sh")
    if (root / "state.json").exists():
        sys.exit(f"{root}/state.json exists: run `make ha-down` first")
    topo = Topology(root, base_port=args.base_port, seed_demo=True)
    try:
        state = topo.start()
    except BaseException:
        topo.stop()
        raise
    print(f"PostgreSQL (Patroni {SCOPE}): {state.database_url}")
    print(f"Redis (Sentinel):            {state.redis_url}")
    for u in state.api_urls:
        print(f"API:                         {u}")
    if topo.seeded:
        print(f"demo tenant key:             {topo.seeded['tenant_key']}  (shown once)")
        print(f"operator key:                {topo.seeded['operator_key']}")
    print(f"logs and data in {root}/; stop with `make ha-down`")


if __name__ == "__main__":
    main()
