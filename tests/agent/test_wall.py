"""The wall between runs on a node, tried as an attacker would (issue 44 §0).

A real agent (as root, each run its own uid) runs a victim and an attacker side by side. The
attacker's process tries to read the node's credential, the agent's records of other runs, the
victim's files and environment, to signal the victim, and to escape its group; each attempt
must fail, and the test asserts the failure (the error it got), not only an empty output.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest

from rackplane_wire import VolumeMount
from tests.fixtures.agent import (
    SYSTEM_PY,
    FakeClient,
    agent,
    assignment,
    assignments,
    open_dir,
    step_until,
    wait_until,
)

pytestmark = [
    pytest.mark.no_db,
    pytest.mark.skipif(
        os.geteuid() != 0 or not os.path.exists(SYSTEM_PY), reason="a uid per run needs root"
    ),
]

VICTIM, ATTACKER = (f"00000000-0000-4000-8000-0000000000{i}" for i in ("a1", "a2"))
SECRET = "victim-secret-6b1f"

VICTIM_CODE = f"""
import os, time
open('notes.txt', 'w').write('private notes {SECRET}')
open(os.path.join(os.environ['TMPDIR'], 'scratch'), 'w').write('{SECRET}')
print('victim up', os.getuid(), os.getpid(), flush=True)
time.sleep(120)
"""

# Each probe prints `PROBE name outcome detail`; `outcome` is `refused` (the error it got) or
# `LEAKED`. `paths` come in as argv[1:] (the test knows where things are; an attacker would
# guess or list them).
ATTACKER_CODE = r"""
import glob, json, os, signal, sys, time
credential, run_json, victim_dir, victim_pid, secret = sys.argv[1:6]

def probe(name, fn):
    try:
        got = fn()
    except OSError as exc:
        print('PROBE', name, 'refused', type(exc).__name__, flush=True)
        return
    leaked = got is not None and secret in str(got) or name.startswith('signal') or (
        name == 'credential' and got)
    print('PROBE', name, 'LEAKED' if leaked else 'empty', repr(got)[:80], flush=True)

probe('credential', lambda: open(credential).read())
probe('credential_relative', lambda: open('../../credential').read())
probe('other_run_record', lambda: open(run_json).read())
probe('state_listing', lambda: os.listdir(os.path.dirname(os.path.dirname(run_json))))
probe('victim_files', lambda: open(os.path.join(victim_dir, 'notes.txt')).read())
probe('victim_tmp', lambda: open(os.path.join(victim_dir, 'tmp', 'scratch')).read())
probe('victim_listing', lambda: os.listdir(victim_dir))
probe('work_listing', lambda: os.listdir(os.path.dirname(victim_dir)))
probe('victim_environ', lambda: open(f'/proc/{victim_pid}/environ', 'rb').read().decode())
probe('signal_victim', lambda: os.kill(int(victim_pid), signal.SIGKILL))
probe('signal_agent', lambda: os.kill(os.getppid(), signal.SIGSTOP))
# Every environ on the host this process can read: only its own run's.
found = []
for path in glob.glob('/proc/[0-9]*/environ'):
    try:
        if secret.encode() in open(path, 'rb').read():
            found.append(path)
    except OSError:
        pass
print('PROBE environ_scan', 'LEAKED' if found else 'refused', found, flush=True)
print('attacker uid', os.getuid(), os.getgid(), os.getgroups(), flush=True)
# A process that leaves the run's group and session, to outlive it.
if os.fork() == 0:
    os.setsid()
    open('escaped.pid', 'w').write(str(os.getpid()))
    time.sleep(300)
    os._exit(0)
time.sleep(0.3)
print('attacker done', flush=True)
"""


@pytest.fixture
def work_dir():
    path = open_dir("rp-wall-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _output(a, client: FakeClient, workload_id: str) -> str:
    a.ship_logs()
    return client.output(workload_id)


def _probes(output: str) -> dict[str, str]:
    out = {}
    for line in output.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == "PROBE":
            out[parts[1]] = parts[2]
    return out


def test_a_run_cannot_reach_the_agent_or_another_run(state_dir, work_dir):
    client = FakeClient()
    (state_dir / "credential").parent.mkdir(parents=True, exist_ok=True)
    a = agent(state_dir, client, work_dir=work_dir, run_uids=(2_100_000, 2_100_099))
    a.state.write_credential("rpn_" + "N" * 40, {"node_name": "node-1"})
    victim = assignment(VICTIM, [SYSTEM_PY, "-c", VICTIM_CODE], env={"SECRET": SECRET})
    a.set_assignments(assignments(victim))
    step_until(a, lambda: "victim up" in _output(a, client, VICTIM), timeout=15)
    v = a.runs[f"{VICTIM}.0.0"]
    victim_pid = _output(a, client, VICTIM).split()[-1]
    assert v.uid is not None and str(v.uid) in _output(a, client, VICTIM)
    assert psutil.Process(int(victim_pid)).uids().real == v.uid

    argv = [
        SYSTEM_PY, "-c", ATTACKER_CODE,
        str(state_dir / "credential"), str(v.run_dir / "run.json"), v.workdir, victim_pid,
        SECRET,
    ]  # fmt: skip
    attacker = assignment(ATTACKER, argv, env={"MINE": "x"})
    a.set_assignments(assignments(victim, attacker, index=2))
    step_until(
        a,
        lambda: (
            (r := client.last(ATTACKER))
            and r.state == "exited"
            and "attacker done" in _output(a, client, ATTACKER)
        ),
        timeout=20,
    )
    out = _output(a, client, ATTACKER)
    probes = _probes(out)
    expected = {
        "credential", "credential_relative", "other_run_record", "state_listing",
        "victim_files", "victim_tmp", "victim_listing", "work_listing", "victim_environ",
        "signal_victim", "signal_agent", "environ_scan",
    }  # fmt: skip
    assert set(probes) == expected, out
    assert {k: v for k, v in probes.items() if v != "refused"} == {}, out
    # Its own identity: a uid and gid of its own, no supplementary groups, not the victim's.
    att = a.runs[f"{ATTACKER}.0.0"]
    assert f"attacker uid {att.uid} {att.uid} []" in out and att.uid != v.uid
    # The victim lives on, untouched.
    assert psutil.Process(int(victim_pid)).is_running()
    # What left the run's group went with the run: nothing runs as its uid any more.
    wait_until(
        lambda: not [p for p in psutil.process_iter(["uids"]) if p.info["uids"].real == att.uid]
    )
    a.close()


def test_secrets_are_fetched_per_run_and_rest_on_no_disk(state_dir, work_dir):
    """The desired state carries no secret (`fetch_env`): the agent fetches the run's env as
    it starts it, hands it to the run through a launch file the shim removes, and keeps it out
    of its own records; a run whose env is refused is not started."""
    client = FakeClient()
    client.secret_env[VICTIM] = {"HF_TOKEN": SECRET, "RACKPLANE_TOKEN": "rpw_x"}
    a = agent(state_dir, client, work_dir=work_dir, run_uids=(2_100_100, 2_100_199))
    code = "import os, time; print('got', os.environ.get('HF_TOKEN'), flush=True); time.sleep(60)"
    run = assignment(VICTIM, [SYSTEM_PY, "-c", code], fetch_env=True)
    refused = assignment(ATTACKER, [SYSTEM_PY, "-c", "print('never')"], fetch_env=True)
    a.set_assignments(assignments(run, refused))
    step_until(a, lambda: f"got {SECRET}" in _output(a, client, VICTIM), timeout=15)
    rec = a.runs[f"{VICTIM}.0.0"]
    on_disk = [p for p in Path(state_dir).rglob("*") if p.is_file()]
    assert not [p for p in on_disk if SECRET.encode() in p.read_bytes() and p.name != "output.log"]
    assert not (rec.run_dir / "launch.json").exists()
    assert SECRET not in json.dumps(json.loads((rec.run_dir / "run.json").read_text()))
    assert f"{ATTACKER}.0.0" not in a.runs  # not started, to be tried again later
    assert (ATTACKER, 0, 0) in client.env_fetches
    a.close()


def test_a_podman_run_gets_a_fixed_env_and_the_workloads_env_on_a_pipe(state_dir, work_dir):
    """podman is a host process: the workload's env (PATH, LD_PRELOAD, CONTAINERS_CONF ...)
    must not steer it. A stand-in `podman` records what it got."""
    bin_dir = work_dir / "bin"
    bin_dir.mkdir()
    record = work_dir / "podman.json"
    fake = bin_dir / "podman"
    fake.write_text(
        f"#!{SYSTEM_PY}\n"
        "import json, os, sys\n"
        "i = sys.argv.index('--env-file')\n"
        "lines = open(sys.argv[i + 1]).read().splitlines()\n"
        f"json.dump({{'env': dict(os.environ), 'argv': sys.argv, 'file': lines}}, "
        f"open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    environ = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CONTAINERS_CONF": "/etc/agent.conf"}
    client = FakeClient()
    client.secret_env[VICTIM] = {"HF_TOKEN": SECRET}
    a = agent(state_dir, client, work_dir=work_dir, runtimes=["process", "podman"])
    a._environ = environ
    a._runtimes = {}
    from rackplane_agent import runtimes

    a._runtime_names = ["process", "podman"]
    a._runtimes = {n: runtimes.make(n, environ) for n in a._runtime_names}
    hostile = {
        "PATH": "/evil", "LD_PRELOAD": "/evil.so", "PYTHONPATH": "/evil",
        "CONTAINERS_CONF": "/evil.conf", "CONTAINER_HOST": "tcp://evil", "TMPDIR": "/evil",
    }  # fmt: skip
    run = assignment(
        VICTIM, ["true"], runtime="podman", image="--privileged", env=hostile,
        fetch_env=True,
    )  # fmt: skip
    a.set_assignments(assignments(run))
    step_until(a, lambda: record.exists() and record.stat().st_size > 0, timeout=15)
    got = json.loads(record.read_text())
    assert got["env"]["PATH"] == environ["PATH"]
    assert got["env"]["CONTAINERS_CONF"] == "/etc/agent.conf"
    assert not {"LD_PRELOAD", "PYTHONPATH", "CONTAINER_HOST", "HF_TOKEN"} & set(got["env"])
    assert "TMPDIR" not in got["env"]
    assert f"HF_TOKEN={SECRET}" in got["file"] and "LD_PRELOAD=/evil.so" in got["file"]
    assert got["argv"][-3:] == ["--", "--privileged", "true"]  # the image is no option
    assert SECRET not in " ".join(got["argv"])
    a.close()


def test_two_agents_on_one_host_never_share_a_uid(tmp_path, work_dir):
    """Each uid is claimed by one agent (its state directory) until its run is forgotten: a
    second agent with the same range takes the next, and a claim whose agent is gone is taken
    back."""
    from rackplane_agent.runusers import RunUsers

    claims = tmp_path / "claims"
    states = [tmp_path / "state-a", tmp_path / "state-b"]
    for s in states:
        s.mkdir()
    a, b = (
        RunUsers(work_dir / f"w{i}", (2_100_200, 2_100_201), owner=s, claims_dir=claims)
        for i, s in enumerate(states)
    )
    for u in (a, b):
        u.prepare(tmp_path / "elsewhere")
    ua = a.take("run-a", set()).user
    ub = b.take("run-b", set()).user
    assert ua and ub and ua.uid != ub.uid
    with pytest.raises(OSError, match="every uid"):
        a.take("run-c", {ua.uid})
    b.release(ua.uid)  # not b's to release
    assert (claims / str(ua.uid)).read_text() == str(states[0])
    shutil.rmtree(states[1])  # b's agent is gone for good: its claim is stale (once old)
    with pytest.raises(OSError, match="every uid"):
        a.take("run-d", {ua.uid})
    old = time.time() - 120
    os.utime(claims / str(ub.uid), (old, old))
    assert a.take("run-d", {ua.uid}).user == ub


def test_a_volume_is_its_tenants_alone_and_outlives_its_runs(state_dir, work_dir, tmp_path):
    """Issue 45 item 13: a tenant's run writes to its volume (a link in its own directory),
    the tenant's next run (another uid, the tenant's gid) reads and adds to it; another
    tenant's run, told the path, is refused at the tenant's door; the node's volumes live
    outside the agent's state, and a shared volume needs the host's shared storage."""
    client = FakeClient()
    volumes = open_dir("rp-volumes-")
    a = agent(
        state_dir, client, work_dir=work_dir, run_uids=(2_100_300, 2_100_399),
        volumes_dir=volumes,
    )  # fmt: skip
    vol = VolumeMount(id="0000aaaa-0000-4000-8000-000000000001", name="data", storage="node",
                      mount_path="out/data")  # fmt: skip
    mine = dict(tenant="tenant-a", run_gid=2_200_001, volumes=[vol])
    write = "open('out/data/result.txt', 'w').write('step 40'); print('wrote', flush=True)"
    first = assignment(VICTIM, [SYSTEM_PY, "-c", write], **mine)
    a.set_assignments(assignments(first))
    step_until(a, lambda: (r := client.last(VICTIM)) and r.state == "exited", timeout=15)
    assert client.last(VICTIM).exit_code == 0, _output(a, client, VICTIM)
    host = volumes / "tenant-a" / vol.id
    assert (host / "result.txt").read_text() == "step 40"
    assert host.stat().st_gid == 2_200_001 and oct(host.stat().st_mode & 0o7777) == "0o2770"
    assert oct((volumes / "tenant-a").stat().st_mode & 0o777) == "0o710"

    read = (
        "import os; print('read', open('out/data/result.txt').read(), os.getuid(), flush=True);"
        "open('out/data/more.txt', 'w').write('x')"
    )
    again = assignment(VICTIM, [SYSTEM_PY, "-c", read], attempt=1, **mine)
    probe = (
        "import os, sys\n"
        "for name, fn in (('list', lambda: os.listdir(sys.argv[1])),"
        " ('read', lambda: open(os.path.join(sys.argv[1], sys.argv[2], 'result.txt')).read())):\n"
        "    try:\n"
        "        print('PROBE', name, 'LEAKED', fn(), flush=True)\n"
        "    except OSError as exc:\n"
        "        print('PROBE', name, 'refused', type(exc).__name__, flush=True)\n"
    )
    other = assignment(
        ATTACKER, [SYSTEM_PY, "-c", probe, str(volumes / "tenant-a"), vol.id],
        tenant="tenant-b", run_gid=2_200_002,
    )  # fmt: skip
    a.set_assignments(assignments(again, other, index=2))
    step_until(
        a,
        lambda: all((r := client.last(w)) and r.state == "exited" for w in (VICTIM, ATTACKER)),
        timeout=15,
    )
    out = _output(a, client, VICTIM)
    assert "read step 40" in out, out
    assert (host / "more.txt").stat().st_gid == 2_200_001
    assert _probes(_output(a, client, ATTACKER)) == {"list": "refused", "read": "refused"}

    # Shared storage this host does not have: the run cannot start here (not the workload's
    # fault: the control plane places such work only where the agent offers it).
    shared = vol.model_copy(update={"id": "0000aaaa-0000-4000-8000-000000000002",
                                    "storage": "shared"})  # fmt: skip
    lost = assignment("00000000-0000-4000-8000-0000000000a3", [SYSTEM_PY, "-c", "0"],
                      tenant="tenant-a", run_gid=2_200_001, volumes=[shared])  # fmt: skip
    a.set_assignments(assignments(lost, index=3))
    step_until(a, lambda: (r := client.last(lost.workload_id)) and r.state == "failed_to_start")
    assert "shared storage" in client.last(lost.workload_id).message
    assert "shared-volumes" not in a.inventory.capabilities
    a.close()
    shutil.rmtree(volumes, ignore_errors=True)
