"""What `rackplane bench agents` (rackplane_bench/agents.py) reads and reports: the scratch
database's placements, row counts and states, the processes' and the machine's CPU, and the
figures of the measured window from them and the simulated agents' runs and counters."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rackplane_bench.agents_sim import Sim, Stats

# --- what the database says --------------------------------------------------------------------


def _ts(at: datetime) -> float:
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def placements(engine) -> dict[tuple[str, int], dict[str, Any]]:
    """Each (workload, attempt): its placing time, its provisioning time, its replicas."""
    import sqlalchemy as sa

    with engine.connect() as c:
        rows = c.execute(
            sa.text(
                "SELECT e.workload_id, e.seq, e.to_state, e.at, w.replicas FROM workload_events e "
                "JOIN workloads w ON w.id = e.workload_id WHERE e.kind = 'transition' "
                "AND e.to_state IN ('placing', 'provisioning') ORDER BY e.workload_id, e.seq"
            )
        ).all()
    out: dict[tuple[str, int], dict[str, Any]] = {}
    attempt: dict[str, int] = {}
    for wid, _seq, state, at, replicas in rows:
        wid = str(wid)
        if state == "placing":
            attempt[wid] = attempt.get(wid, 0) + 1
            out[(wid, attempt[wid])] = {"placing": _ts(at), "replicas": replicas}
        elif wid in attempt:
            out[(wid, attempt[wid])].setdefault("provisioning", _ts(at))
    return out


def db_rows(engine) -> dict[str, int]:
    """Rows written per table, and (as `:sessions`, `:commits`) the connections opened to the
    database and the transactions committed in it."""
    import sqlalchemy as sa

    with engine.connect() as c:
        out = {
            name: int(n)
            for name, n in c.execute(
                sa.text(
                    "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables"
                )
            )
        }
        sessions, commits = c.execute(
            sa.text(
                "SELECT sessions, xact_commit FROM pg_stat_database "
                "WHERE datname = current_database()"
            )
        ).one()
    out[":sessions"], out[":commits"] = int(sessions), int(commits)
    return out


def states(engine) -> dict[str, int]:
    """Workloads by state."""
    import sqlalchemy as sa

    with engine.connect() as c:
        return {
            s: int(n)
            for s, n in c.execute(sa.text("SELECT state, count(*) FROM workloads GROUP BY state"))
        }


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4)


# --- what the processes and the machine spent ------------------------------------------------


def each_cpu(pids: list[int]) -> dict[int, float]:
    """CPU seconds (user + system) of each process still alive."""
    import psutil

    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def machine_busy() -> float:
    """CPU seconds the whole machine spent busy (every core, every process)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def own_cpu() -> float:
    """This process's CPU alone (cpu_seconds counts children: the API and worker are ours)."""
    t = os.times()
    return t.user + t.system


def rss_mib(pid: int) -> float | None:
    """A process's resident memory, MiB (None when it is gone)."""
    import psutil

    try:
        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except psutil.Error:
        return None


# --- the figures -----------------------------------------------------------------------------


@dataclass
class Window:
    """The measured window: its bounds, its wall-clock length, and the readings at both ends
    (CPU seconds by part, rows written by table, the API's memory at the end); and when the
    drain after it stopped looking for runs placed in it."""

    t0: float
    t_end: float
    wall: float
    cpu0: dict[str, float]
    cpu1: dict[str, float]
    rows0: dict[str, int]
    rows1: dict[str, int]
    rss: float | None
    observed_until: float = 0.0


def figures(
    sim: Sim,
    window: Window,
    submitted: list,
    placed: dict,
    join_s: float,
    end_states: dict,
    agents: int,
    bring_up_s: float | None = None,
) -> dict[str, Any]:
    """The run's figures (see rackplane_bench/agents.py's docstring)."""
    minutes = agents * window.wall / 60
    return {
        "agents": agents,
        "duration_s": round(window.wall, 1),
        **_paths(sim, placed, window),
        **_cpu(window, minutes),
        **_database(window, minutes),
        **_traffic(sim.stats, submitted, window),
        **_bring_up(sim, join_s, bring_up_s),
        "end_states": end_states,
    }


def _paths(sim: Sim, placed: dict, w: Window) -> dict[str, Any]:
    """Per run placed in the window: assign to start and to ack, and the path in its parts."""
    a2s, a2a, p2p, p2r, r2s, s2a = [], [], [], [], [], []
    unstarted = 0
    measured_workloads = 0
    for (wid, att), v in placed.items():
        if not w.t0 <= v["placing"] < w.t_end:
            continue
        measured_workloads += 1
        prov = v.get("provisioning")
        if prov is not None:
            p2p.append(prov - v["placing"])
        for rep in range(v["replicas"]):
            run = sim.runs.get((wid, att, rep))
            if run is None or run.sent is None:
                unstarted += 1
                a2s.append(w.observed_until - v["placing"])  # a lower bound
                continue
            a2s.append(run.sent - v["placing"])
            r2s.append(run.sent - run.received)
            if prov is not None:
                p2r.append(run.received - prov)
            if run.acked is not None:
                a2a.append(run.acked - v["placing"])
                s2a.append(run.acked - run.sent)
    return {
        "workloads": measured_workloads,
        "runs": len(a2s),
        "assign_to_start_p50_s": _pct(a2s, 0.5),
        "assign_to_start_p99_s": _pct(a2s, 0.99),
        "assign_to_start_max_s": _pct(a2s, 1.0),
        "assign_to_ack_p50_s": _pct(a2a, 0.5),
        "assign_to_ack_p99_s": _pct(a2a, 0.99),
        "runs_unstarted": unstarted,
        "placing_to_provisioning_p50_s": _pct(p2p, 0.5),
        "placing_to_provisioning_p99_s": _pct(p2p, 0.99),
        "provisioning_to_received_p50_s": _pct(p2r, 0.5),
        "provisioning_to_received_p99_s": _pct(p2r, 0.99),
        "received_to_sent_p99_s": _pct(r2s, 0.99),
        "sent_to_ack_p50_s": _pct(s2a, 0.5),
        "sent_to_ack_p99_s": _pct(s2a, 0.99),
    }


def _cpu(w: Window, minutes: float) -> dict[str, Any]:
    """CPU of the API, the worker, PostgreSQL, this load generator and the machine."""
    cpu0, cpu1, wall = w.cpu0, w.cpu1, w.wall
    api = cpu1["api"] - cpu0["api"]
    return {
        "api_cpu_s": round(api, 2),
        "api_cpu_share": round(api / wall, 3),
        "api_cpu_s_per_agent_minute": round(api / minutes, 5),
        "api_rss_mib": w.rss,
        "worker_cpu_share": round((cpu1["worker"] - cpu0["worker"]) / wall, 3),
        "postgres_cpu_share": round((cpu1["pg"] - cpu0["pg"]) / wall, 3),
        "bench_cpu_share": round((cpu1["bench"] - cpu0["bench"]) / wall, 3),
        # Everything else on the machine (2 cores here, shared with whatever else runs).
        "machine_busy_cores": round((cpu1["machine"] - cpu0["machine"]) / wall, 2),
        "other_cpu_share": round(
            (
                (cpu1["machine"] - cpu0["machine"])
                - sum(cpu1[k] - cpu0[k] for k in ("api", "worker", "pg", "bench"))
            )
            / wall,
            2,
        ),
        "cores": os.cpu_count(),
    }


def _database(w: Window, minutes: float) -> dict[str, Any]:
    """Rows written (by table), connections opened and commits, over the window."""
    delta = {t: w.rows1.get(t, 0) - w.rows0.get(t, 0) for t in w.rows1}
    sessions, commits = delta.pop(":sessions"), delta.pop(":commits")
    rows = sum(delta.values())
    return {
        "db_rows_per_agent_minute": round(rows / minutes, 2),
        "db_rows": rows,
        "db_rows_by_table": {
            t: n for t, n in sorted(delta.items(), key=lambda kv: -kv[1]) if n > 0
        },
        # Connections PostgreSQL accepted for the scratch database (the API's pool opening
        # connections beyond its size, and closing them again); transactions committed in it
        # (API, worker and this bench).
        "db_connections_opened": sessions,
        "db_commits_per_s": round(commits / w.wall, 1),
    }


def _traffic(st: Stats, submitted: list, w: Window) -> dict[str, Any]:
    """Submissions, reports, long polls and every answer by route and status in the window."""
    five = sum(n for (_, s), n in st.codes.items() if s.isdigit() and s.startswith("5"))
    failed = sum(n for (_, s), n in st.codes.items() if not s.isdigit())
    window_submits = [s for t, s, _ in submitted if w.t0 <= t < w.t_end]
    return {
        "submitted": len(window_submits),
        "submit_rejected": sum(1 for s in window_submits if s != 201),
        "status_reports": st.status_reports,
        "heartbeats": st.heartbeats,
        "run_reports": st.run_reports,
        "stale_reports": st.stale,
        "long_polls": st.long_polls,
        "long_polls_woken": st.long_polls_woken,
        "requests_per_s": round(sum(st.codes.values()) / w.wall, 1),
        "errors_5xx": five,
        "errors_5xx_whole_run": sum(
            n for (_, s), n in st.codes_all.items() if s.isdigit() and s.startswith("5")
        ),
        "errors_no_answer": failed,
        "answers_by_route": _by_route(st.codes),
        "latency_s_by_route": _latency_by_route(st.latency),
    }


def _bring_up(sim: Sim, join_s: float, bring_up_s: float | None) -> dict[str, Any]:
    """The joins, and the bring-up burst: its seconds, its answers, its latencies."""
    st = sim.stats
    return {
        "join_s": round(join_s, 1),
        # The bring-up burst (before the window, or into it if it lasts): every agent joins,
        # sends its inventory and reports its burn-in while heartbeats, long polls and
        # submissions run. None: not every burn-in report was taken by the end.
        "bring_up_s": round(bring_up_s, 1) if bring_up_s is not None else None,
        "bring_up_burned_in": sim.burned_in,
        "bring_up_5xx": sum(
            n for (_, s), n in st.codes_bring_up.items() if s.isdigit() and s.startswith("5")
        ),
        "bring_up_answers_by_route": _by_route(st.codes_bring_up),
        "bring_up_latency_s_by_route": _latency_by_route(st.latency_bring_up),
    }


def _latency_by_route(latency: dict[str, list[float]]) -> dict[str, dict[str, float | None]]:
    """p50 and p99 per route; long polls left out (they wait by design)."""
    return {
        route: {"p50": _pct(xs, 0.5), "p99": _pct(xs, 0.99)}
        for route, xs in sorted(latency.items())
        if route != "assignments"
    }


def _by_route(counts: Counter) -> dict[str, dict[str, int]]:
    codes: dict[str, dict[str, int]] = defaultdict(dict)
    for (route, status), n in sorted(counts.items()):
        codes[route][status] = n
    return dict(codes)
