"""Every `rackplane` command, run as an operator runs it (a real `.venv/bin/rackplane` process),
once on the embedded default (a fresh SQLite data directory) and once on PostgreSQL: each exits
0, or with its documented code and message, and never prints a Python traceback.

The matrix is keyed by the commands registered in the typer app, so a command added without a
case here fails the suite. About 55 processes of a second or two of CPU each, the two backends
side by side: under a minute on two idle cores."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import typer

from app.cli import DEMO_FLEET, cli
from rackplane_bench.commands.common import TRACES
from tests.fixtures.harness import ROOT, TEST_DB, create_database, drop_database
from tests.fixtures.world import CORDONED_H100, wait_until

RACKPLANE = Path(sys.executable).with_name("rackplane")  # .venv/bin/rackplane


def registered(group=None, path: tuple[str, ...] = ()) -> list[str]:
    """Every leaf command of the typer app, as `fleet health`."""
    group = group or typer.main.get_command(cli)
    out: list[str] = []
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):
            out += registered(cmd, (*path, name))
        else:
            out.append(" ".join((*path, name)))
    return out


@dataclass(frozen=True)
class Case:
    args: str  # after `rackplane`, split on spaces; {placeholders} from earlier cases
    code: int = 0
    says: str | None = None  # in stdout (exit 0) or stderr (a documented error)
    keep: tuple[str, str] | None = None  # (placeholder, regex): a value for later cases
    traces: bool = False  # replays public traces: skipped where ../shared/traces is missing


# Long-running processes (`up`, `worker`: servers that only stop on a signal), benchmarks and
# trace replays (minutes each, on scratch databases and trace files) run with --help only: that
# still imports and builds them as `rackplane` does. They and `openapi` touch no database, so
# they run once, not per backend.
HELP_ONLY = ["up", "worker", "gateway"] + [
    c for c in registered() if c.split()[0] in ("sim", "bench")
]
NO_DATABASE = [*HELP_ONLY, "openapi", "agent"]
BACKENDS = ("sqlite", "postgresql")
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
SSH_PUBLIC_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJ5iA8uFQRe8LONmOliguTQz30Ci7m5MdD8vNqn6iyx3"

# Run in this order on a fresh deployment, an operator's first session: each case may use what
# an earlier one made (the demo fleet, tenant acme, a key, an experiment).
CASES: dict[str, Case] = {
    "migrate": Case("migrate", says="latest migration"),
    # --check against a file that is not there: the document is generated (the app built whole)
    # and the command says it differs, whatever the state of the committed file.
    "openapi": Case("openapi --check --out {tmp}/none.json", code=1, says="is out of date"),
    "fleet import": Case("fleet import {fleet}", says='"created_gpus": 152'),
    "fleet show": Case("fleet show", says="H100-80GB"),
    # Piped, as here: whole names, not cut at 80 columns ("hgx-…").
    "fleet health": Case("fleet health", says="hgx-h100-a"),
    "fleet quarantine": Case(
        "fleet quarantine h100-a-004 --gpu 2 --reason smoke",
        says="GPU 2 of h100-a-004: quarantined",
    ),
    "fleet release": Case("fleet release h100-a-004 --gpu 2", says="GPU 2 of h100-a-004: healthy"),
    "fleet retire": Case("fleet retire a100-w-002 --gpu 0", says="out_of_service"),
    "fleet history": Case("fleet history h100-a-004", says="quarantined by an operator: smoke"),
    "fleet join-token": Case("fleet join-token h100-a-004 --ttl 120", says="rpj_"),
    "fleet stack create": Case(
        "fleet stack create h100-2026.10 --driver 560.35.03 --cuda 12.6 --nccl 2.23.4",
        says="stack h100-2026.10: driver 560.35.03, cuda 12.6, nccl 2.23.4",
    ),
    "fleet stack assign": Case(
        "fleet stack assign h100-2026.10 --node h100-a-003 --node h100-a-004",
        says="2 node(s) should run h100-2026.10; 0 drifted",
    ),
    "fleet stack list": Case("fleet stack list --json", says='"nodes": 2'),
    # The demo fleet's nodes are simulated: no agent to install a stack, so no upgrade.
    "fleet upgrade": Case(
        "fleet upgrade --stack h100-2026.10 --pool h100-train --batch 10%",
        code=2,
        says="have no agent",
    ),
    "fleet upgrades": Case("fleet upgrades --json", says="[]"),
    # Simulated nodes have no agent to lay MIG instances out.
    "fleet mig-layout": Case(
        "fleet mig-layout h100-a-004 1 3g.40gb,2g.20gb", code=2, says="cannot lay out MIG"
    ),
    "fleet upgrade-resume": Case(
        "fleet upgrade-resume 0b0e5a9e-8f4c-4d7e-9a51-3c1f2a6b7d90", code=2, says="No upgrade"
    ),
    "fleet upgrade-rollback": Case(
        "fleet upgrade-rollback nope", code=2, says="No upgrade with id nope"
    ),
    # The node agent's own program: with no NVML here and no inventory, it cannot start (2).
    "agent": Case(
        "agent --api http://127.0.0.1:9 --state-dir {tmp}/agent --same-user",
        code=2,
        says="no GPU inventory",
    ),
    "tenants create": Case(
        "tenants create --name Acme --slug acme --email ops@acme.io",
        says="admin key (shown once): rp_",
    ),
    "tenants list": Case("tenants list", says="acme"),
    # Only a self-service signup is pending; the CLI's tenants are active from the start.
    "tenants approve": Case(
        "tenants approve acme", code=2, says="Only pending tenants can be approved"
    ),
    "keys create": Case(
        "keys create --tenant acme --name spare",
        says="shown once",
        keep=("prefix", r"key (\w{8}) "),
    ),
    "keys revoke": Case("keys revoke {prefix}", says="key {prefix} revoked"),
    "ssh-keys add": Case(
        "ssh-keys add --tenant acme --name laptop --public-key-file {tmp}/id_ed25519.pub",
        says="ssh key laptop added: ssh-ed25519 256 SHA256:",
    ),
    "ssh-keys list": Case("ssh-keys list --tenant acme --json", says='"name": "laptop"'),
    "ssh-keys delete": Case("ssh-keys delete laptop --tenant acme", says="ssh key laptop deleted"),
    "secrets set": Case(
        "secrets set hf-token --tenant acme --from-file {tmp}/hf-token",
        says="secret hf-token set: 19 bytes, version 1",
    ),
    "secrets list": Case("secrets list --tenant acme --json", says='"name": "hf-token"'),
    "secrets delete": Case("secrets delete hf-token --tenant acme", says="secret hf-token deleted"),
    "volumes create": Case(
        "volumes create ckpt --tenant acme --storage shared",
        says="volume ckpt (shared storage) made",
    ),
    "volumes list": Case("volumes list --tenant acme --json", says='"storage": "shared"'),
    "volumes delete": Case("volumes delete ckpt --tenant acme", says="volume ckpt deleted"),
    "endpoints create": Case(
        "endpoints create chat --tenant acme --command serve --gpus 1 --max 2",
        says="endpoint chat made: /e/chat/, 0 replica(s) to start",
    ),
    "endpoints list": Case("endpoints list --tenant acme --json", says='"url_path": "/e/chat/"'),
    "endpoints scale": Case(
        "endpoints scale chat --tenant acme --min 1", says="bounds 1..2, target 1"
    ),
    "endpoints show": Case("endpoints show chat --tenant acme", says="chat-1 queued"),
    "endpoints delete": Case("endpoints delete chat --tenant acme", says="endpoint chat deleted"),
    # Nothing submitted yet (a workload with its connect command: the test below).
    "workloads list": Case("workloads list --tenant acme --json", says="[]"),
    "workloads show": Case(
        "workloads show 0b0e5a9e-8f4c-4d7e-9a51-3c1f2a6b7d90",
        code=2,
        says="No workload with id 0b0e5a9e-8f4c-4d7e-9a51-3c1f2a6b7d90",
    ),
    # Xid 13 is an application error: the GPU stays in the pool.
    "chaos inject": Case(
        "chaos inject --xid 13 --node h100-a-001 --gpu 0 --max-gpus 1 --max-share 0.01 --json",
        says='"held": true',
        keep=("experiment", f'"id": "({UUID})"'),
    ),
    "chaos list": Case("chaos list", says="{experiment}"),
    "chaos report": Case("chaos report {experiment}", says="invariants held"),
    "chaos stop": Case("chaos stop {experiment}", says="stopped"),
    "billing export": Case(
        "billing export --period 2026-01 -o {tmp}/export.csv", says="wrote 0 rows"
    ),
    "billing push": Case("billing push", code=2, says="Stripe is not configured"),
    "billing reconcile": Case("billing reconcile --period 2026-01", says="0 difference"),
    **{c: Case(f"{c} --help", says="Usage") for c in HELP_ONLY},
    # The rolling-upgrade replay on a few hours of Philly and four nodes: seconds, not minutes.
    "sim upgrade": Case(
        "sim upgrade --nodes 4 --window 28:28.1 --scale 1 --start-day 0.02 --batch 1,100% "
        "--parallel 1 --json",
        says='"summary": "sim upgrade"',
        traces=True,
    ),
    # MIG layouts by demand on two nodes for half a day, one static fraction: seconds.
    "sim mig": Case(
        "sim mig --nodes 2 --days 0.5 --warmup-days 0.25 --fractions 0.5 --parallel 1 --json",
        says='"summary": "sim mig"',
        traces=True,
    ),
}


class Deployment:
    def __init__(self, backend: str, env: dict[str, str], tmp: Path):
        self.backend, self.env, self.tmp = backend, env, tmp
        self.state: dict[str, str] = {"fleet": str(DEMO_FLEET), "tmp": str(tmp)}

    def run(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None):
        """`rackplane ARGS` in a directory of its own (no stray `.env`)."""
        return subprocess.run(
            [str(RACKPLANE), *args],
            cwd=cwd or self.tmp,
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def ok(self, *args: str, **kw) -> str:
        r = self.run(*args, **kw)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (
            f"rackplane {' '.join(args)} on {self.backend}: exit {r.returncode}\n{r.stderr}"
        )
        return r.stdout

    def args(self, case: Case) -> list[str]:
        return [a.format(**self.state) for a in case.args.split()]

    def cases(self, commands: list[str]) -> dict[str, subprocess.CompletedProcess | str]:
        """Each case in order; one whose placeholder an earlier case did not fill is skipped
        (its result says which)."""
        out: dict[str, subprocess.CompletedProcess | str] = {}
        for command, case in CASES.items():
            if command not in commands:
                continue
            try:
                args = self.args(case)
            except KeyError as e:
                out[command] = f"not run: no {e} (an earlier case failed)"
                continue
            r = out[command] = self.run(*args)
            if case.keep and (m := re.search(case.keep[1], r.stdout)):
                self.state[case.keep[0]] = m.group(1)
        return out


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("COLUMNS", None)  # piped output, as a script sees it
    env.pop("LINES", None)
    return env


PG_NAME = f"{TEST_DB}_cli"


def _deployment(backend: str, tmp: Path) -> Deployment:
    """A fresh SQLite data directory (the embedded default: no DATABASE_URL, REDIS_URL or
    server secrets), or a PostgreSQL database of its own (the autouse `clean_db` empties the
    suite's between tests) with Redis."""
    tmp.mkdir(parents=True)
    (tmp / "id_ed25519.pub").write_text(SSH_PUBLIC_KEY + " ops@acme\n")  # for `ssh-keys add`
    (tmp / "hf-token").write_text("hf_0123456789abcdef\n")  # `secrets set`: 19 bytes, no newline
    env = _base_env()
    env["RACKPLANE_DATA_DIR"] = str(tmp / "data")
    if backend == "sqlite":
        for k in ("DATABASE_URL", "REDIS_URL", "RACKPLANE_KEY_PEPPER", "RACKPLANE_SECRET_KEY"):
            env.pop(k, None)
    else:
        env["DATABASE_URL"] = create_database(PG_NAME)
        # Its own broker keys and auth channel (still under the run's prefix, cleaned up after).
        env["RACKPLANE_BROKER_PREFIX"] = os.environ["RACKPLANE_BROKER_PREFIX"] + "cli:"
    return Deployment(backend, env, tmp)


def _params() -> list:
    out = []
    for c in registered():
        backends = ("any",) if c in NO_DATABASE else BACKENDS
        out += [pytest.param(b, c, id=f"{b}-{c}") for b in backends]
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, database):
    """Every case run on each backend, the two backends (and the cases run once) side by side:
    {backend: (deployment, {command: result})}."""
    tmp = tmp_path_factory.mktemp("cli")
    commands = registered()

    def backend(b: str):
        d = _deployment(b, tmp / b)
        return d, d.cases([c for c in commands if c not in NO_DATABASE])

    def no_database():
        d = Deployment("any", _base_env(), tmp)
        return d, d.cases(NO_DATABASE)

    try:
        with ThreadPoolExecutor(3) as pool:
            futures = {b: pool.submit(backend, b) for b in BACKENDS}
            futures["any"] = pool.submit(no_database)
            results = {b: f.result() for b, f in futures.items()}
        yield results
    finally:
        drop_database(PG_NAME)


@pytest.fixture
def embedded(matrix) -> Deployment:
    """The matrix's embedded deployment (demo fleet, tenant acme), for what does not depend on
    the backend."""
    return matrix["sqlite"][0]


def test_every_case_is_a_registered_command():
    stale = set(CASES) - set(registered())
    assert not stale, f"smoke cases for commands that do not exist: {sorted(stale)}"


@pytest.mark.parametrize(("backend", "command"), _params())
def test_every_command_runs(matrix, backend, command):
    case = CASES.get(command)
    assert case is not None, f"no smoke case for `rackplane {command}`: add one to CASES"
    if case.traces and not TRACES.is_dir():
        pytest.skip(f"`rackplane {command}` replays the public traces, not in {TRACES} here")
    d, results = matrix[backend]
    r = results[command]
    assert not isinstance(r, str), r
    where = f"rackplane {' '.join(r.args[1:])} on {backend}"
    assert "Traceback" not in r.stderr + r.stdout, f"{where}: a traceback\n{r.stderr[-4000:]}"
    assert r.returncode == case.code, (
        f"{where}: exit {r.returncode}, expected {case.code}\n"
        f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-2000:]}"
    )
    if case.says:
        said = r.stdout + r.stderr if case.code == 0 else r.stderr
        assert case.says.format(**d.state) in said, said


def _revoke_and_check(revoke, get) -> None:
    """200, twice (the second from the API's key cache, where there is one: Redis), the CLI
    revokes, then 401 at once."""
    for _ in range(2):
        assert get().status_code == 200
    revoke()
    r = get()
    assert r.status_code == 401 and r.json()["code"] == "revoked_api_key", r.text


def test_a_key_revoked_from_the_cli_answers_401_over_rest_on_postgresql(client, world, tmp_path):
    """The issue: `keys revoke` could not load its models, and the key kept working. The API
    here is the suite's (PostgreSQL, Redis, its key cache); the CLI a process of its own."""
    key = world.key(world.tenant("acme"), scopes=("read",))
    d = Deployment("postgresql", _base_env(), tmp_path)
    _revoke_and_check(
        lambda: d.ok("keys", "revoke", key[3:11]),
        lambda: client.get("/v1/keys", headers={"Authorization": f"Bearer {key}"}),
    )


def test_a_key_revoked_from_the_cli_answers_401_over_rest_on_sqlite(embedded):
    """The same on the embedded default, with an API process on its data directory."""
    from rackplane_bench.deploy import api_command, free_port

    d = embedded
    out = d.ok("keys", "create", "--tenant", "acme", "--scope", "read", "--name", "rv")
    key = re.search(r"(rp_\w+)", out).group(1)
    port = free_port()
    log_path = d.tmp / f"api-{port}.log"
    with open(log_path, "wb") as log:
        api = subprocess.Popen(api_command(port), cwd=d.tmp, env=d.env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert api.poll() is None, log_path.read_text()
            try:
                return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=60, interval=0.2)
        _revoke_and_check(
            lambda: d.ok("keys", "revoke", key[3:11]),
            lambda: httpx.get(f"{base}/v1/keys", headers={"Authorization": f"Bearer {key}"}),
        )
    finally:
        api.terminate()
        api.wait(timeout=20)


def test_workloads_show_and_list_say_how_to_log_in(client, world, tmp_path):
    """An instance launched with an SSH key, its run's SSH server where a node agent reports it
    (the columns set here): `workloads show` and `workloads list` give the API's `connect`, and
    whether the server answers yet."""
    import uuid as _uuid

    from app.core.db import session_scope, utcnow
    from app.models.workloads import Workload

    world.fleet(CORDONED_H100)  # it queues: where it runs is set below, as if placed
    tenant = world.tenant("acme")
    h = {"Authorization": f"Bearer {world.key(tenant)}"}
    r = client.post(
        "/v1/ssh-keys", json={"name": "laptop", "public_key": SSH_PUBLIC_KEY}, headers=h
    )
    assert r.status_code == 201, r.text
    body = {"name": "box", "kind": "instance", "gpus": 1, "runtime": "podman"}
    body |= {"image": "docker.io/library/ubuntu:24.04", "ssh_keys": ["laptop"]}
    r = client.post("/v1/workloads", json=body, headers=h)
    assert r.status_code == 201, r.text
    wid = r.json()["id"]
    placement = [
        {"replica": 0, "region": "r1", "rack": "hgx-h100", "node": "h100-1", "gpu_indices": [3]}
    ]

    def report(**columns) -> None:  # as a node agent's report lands
        with session_scope() as s:
            w = s.get(Workload, _uuid.UUID(wid))
            for k, v in columns.items():
                setattr(w, k, v)

    d = Deployment("postgresql", _base_env(), tmp_path)
    out = d.ok("workloads", "show", wid)
    assert "connect:" in out and "has not reported a port" in out, out  # not placed yet
    report(state="running", placement=placement, ssh_host="10.0.0.7", ssh_port=22001)
    out = d.ok("workloads", "show", wid)
    for said in ("state:    running", "kind:     instance", "runtime:  podman", "nodes:    h100-1"):
        assert said in out, out
    assert "connect:  ssh -p 22001 root@10.0.0.7" in out and "booting" in out, out
    doc = json.loads(d.ok("workloads", "show", wid, "--json"))
    assert (doc["tenant"], doc["ssh_keys"]) == ("acme", [SSH_PUBLIC_KEY]), doc
    assert doc["connect"]["command"] == "ssh -p 22001 root@10.0.0.7"
    assert doc["connect"]["ready"] is False
    report(ssh_ready_at=utcnow())
    out = d.ok("workloads", "show", wid)
    assert "ready:    yes, since" in out, out
    # The list: newest first, narrowed by tenant and state.
    other = client.post("/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=h)
    assert other.status_code == 201, other.text
    listed = json.loads(d.ok("workloads", "list", "--tenant", "acme", "--json"))
    assert [w["id"] for w in listed] == [other.json()["id"], wid]
    listed = json.loads(d.ok("workloads", "list", "--state", "running", "--json"))
    assert [(w["id"], w["connect"]["ready"]) for w in listed] == [(wid, True)]
    table = d.ok("workloads", "list", "--tenant", "acme", "--limit", "1", "--state", "running")
    assert wid in table and "ssh -p 22001 root@10.0.0.7 (ready)" in table, table
    r = d.run("workloads", "list", "--tenant", "nope")
    assert r.returncode == 2 and "no tenant nope" in r.stderr, r.stderr
    # Ended: no way in, and it says why.
    report(state="terminated")
    out = d.ok("workloads", "show", wid)
    assert "connect:  none: it is terminated" in out and "ssh -p" not in out, out


def test_fleet_health_json_is_whole(embedded):
    report = json.loads(embedded.ok("fleet", "health", "--json"))
    racks = {rk["rack"] for reg in report["regions"] for rk in reg["racks"]}
    assert {"hgx-h100-a", "nvl72-a", "hgx-a100-w"} <= racks


def test_chaos_off_for_the_cli_says_where_it_reads_the_setting(embedded):
    """The CLI is a process of its own: it reads RACKPLANE_CHAOS_ENABLED from its environment
    or ./.env, as the server does from its own."""
    args = ["chaos", "inject", "--xid", "13", "--node", "h100-a-001", "--gpu", "5"]
    args += ["--max-gpus", "1", "--max-share", "0.01"]
    # As a user's shell: no chaos setting, and `.env` read (the tests' own processes read none).
    off = {
        k: v
        for k, v in embedded.env.items()
        if k not in ("RACKPLANE_CHAOS_ENABLED", "RACKPLANE_ENV_FILE")
    }
    r = embedded.run(*args, env=off)
    assert r.returncode == 2
    assert "RACKPLANE_CHAOS_ENABLED=true" in r.stderr and ".env" in r.stderr, r.stderr
    # From a directory whose .env turns it on (as `make run` reads the checkout's .env).
    here = embedded.tmp / "with-dotenv"
    here.mkdir()
    (here / ".env").write_text("RACKPLANE_CHAOS_ENABLED=true\n")
    r = embedded.run(*args, env=off, cwd=here)
    assert r.returncode == 0, r.stderr


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


def test_the_readme_cli_lines_name_registered_commands_as_installed():
    """`rackplane` is not on PATH after `make run`: the README says `.venv/bin/rackplane`."""
    block = re.search(r"```sh\n(.*?)```", _readme_section("CLI"), re.S).group(1)
    commands = registered()
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert lines
    for line in lines:
        assert line.startswith(".venv/bin/rackplane "), line
        words = line.split()[1:3]
        assert " ".join(words) in commands or words[0] in commands, line


def test_the_readme_first_chaos_experiment_runs_on_the_demo_fleet(embedded):
    """The chaos section's first experiment, as written (the data directory aside), on the demo
    fleet: its node exists, `chaos list` shows the id, report and stop take it."""
    section = _readme_section("Chaos experiments (`app/chaos`)")
    block = re.search(r"```sh\n(.*?)```", section.split("### A first experiment", 1)[1], re.S)
    lines = [ln.strip() for ln in block.group(1).splitlines() if ln.strip()]
    env = dict(embedded.env)
    env.pop("RACKPLANE_CHAOS_ENABLED")  # the README says how to turn it on
    experiment = None
    for line in lines:
        if experiment:
            line = line.replace("EXPERIMENT_ID", experiment)
        assert "EXPERIMENT_ID" not in line, f"no experiment id yet for: {line}"
        r = subprocess.run(
            ["bash", "-c", f"cd {ROOT} && set -e; {line}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0 and "Traceback" not in r.stderr, f"{line}\n{r.stderr}"
        env.update(_exported(line))
        found = re.search(r"experiment ([0-9a-f-]{36})", r.stdout)
        experiment = experiment or (found and found.group(1))
        if " chaos list" in line:
            assert experiment in r.stdout
    assert experiment, "the section starts no experiment"


def _exported(line: str) -> dict[str, str]:
    m = re.match(r"export (\w+)=(\S+)", line)
    return {m.group(1): m.group(2)} if m else {}
