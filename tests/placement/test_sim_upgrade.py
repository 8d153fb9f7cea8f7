"""`rackplane sim upgrade`: the rolling upgrade's rollout, drains and figures
(rackplane_bench/sim/upgrade.py), on tiny traces that replay in seconds."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from app.cli import cli
from rackplane_bench.sim import philly
from rackplane_bench.sim import upgrade as U

pytestmark = pytest.mark.no_db

HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"
UNIT_S = 900.0 + 2400.0  # apply + burn-in


def _trace(tmp_path, rows, name="jobs.csv"):
    """rows: (minute, duration s, GPUs, tenant)."""
    p = tmp_path / name
    p.write_text(
        HEADER
        + "".join(
            f"2017-10-01 {m // 60:02d}:{m % 60:02d}:00,{d},{g},{d * g},{c}\n" for m, d, g, c in rows
        )
    )
    return p


def _load(tmp_path, rows, priority="training"):
    jobs = U.with_checkpoints(philly.load_jobs(_trace(tmp_path, rows)))
    for j in jobs:
        j.priority = priority
    return jobs


def _busy(tmp_path):
    """A loaded 8-node fleet for ten hours: jobs of 1-8 GPUs, some long (they checkpoint)."""
    rows = [
        (m, 1200 + 97 * (m % 13) * (1 + 5 * (m % 4 == 0)), 1 + (m % 3 == 0) * 3 + (m % 7 == 0) * 4)
        for m in range(0, 600, 2)
    ]
    return U.with_checkpoints(
        philly.load_jobs(_trace(tmp_path, [(m, d, g, "ta" if m % 4 else "tb") for m, d, g in rows]))
    )


def _run(jobs, nodes, p, **kw):
    return U.replay(jobs, nodes, philly.quotas(jobs, nodes * 8), p, **kw)


def test_batch_sizes_and_shares():
    assert U.parse_count("1", 64) == 1
    assert U.parse_count("1%", 64) == 1  # at least one
    assert U.parse_count("10%", 64) == 6  # rounds down
    assert U.parse_count("25%", 512) == 128
    assert U.parse_share("10%") == pytest.approx(0.1)
    for bad in ("0", "0%", "101%", "-1"):
        with pytest.raises(ValueError):
            U.parse_count(bad, 64)


def test_units_are_nodes_or_whole_nvlink_domains_by_rack_then_name():
    from tests.fixtures.snapshots import hgx, nvl72

    nodes = hgx("b", 2, rack="r2") + nvl72("r1") + hgx("a", 2, rack="r3")
    units = U.units_of(nodes)
    assert [len(u) for u in units] == [18, 1, 1, 1, 1]
    assert [nodes[u[0]].name for u in units] == ["r1-t00", "b000", "b001", "a000", "a001"]


def test_checkpointing_assumption():
    jobs = [
        philly.Job(i, 0.0, d, 1, "t", "training", d, 900.0, 60.0)
        for i, d in enumerate((600.0, 3600.0, 3601.0, 50_000.0))
    ]
    assert [j.checkpoint_every for j in U.with_checkpoints(jobs)] == [0.0, 0.0, 1800.0, 1800.0]
    none = U.with_checkpoints(jobs, U.Checkpoints(share=1e-9))
    assert all(j.checkpoint_every == 0.0 for j in none)


def test_every_unit_finishes_and_bigger_batches_finish_sooner(tmp_path):
    jobs = _busy(tmp_path)
    base = _run(jobs, 8, None)
    hours, out = [], []
    for batch in ("1", "2", "50%", "100%"):
        r = _run(jobs, 8, U.Params(batch=batch, start_s=3600.0))
        assert all(u.state == "done" and u.back_at is not None for u in r.unit_log), batch
        assert r.finished == r.jobs == len(jobs)  # every job finishes, moved or not
        s = U.summary(r, base)
        hours.append(s["hours_to_finish"])
        out.append(s["gpu_hours_out_of_service"])
        # Out of service: each node's apply and burn-in at least, at most with the longest
        # drain (capped at drain_wait, then the grace period) on top.
        lo = 8 * 8 * UNIT_S / 3600
        hi = 8 * 8 * (UNIT_S + 1800 + 30) / 3600
        assert lo <= s["gpu_hours_out_of_service"] <= hi, (batch, s)
        assert s["units_at_once"] == {"1": 1, "2": 2, "50%": 4, "100%": 8}[batch]
        # One after another, the time to finish is the sum of the units' times.
        assert s["hours_to_finish"] >= 8 * UNIT_S / 3600 / s["units_at_once"] - 1e-9
    assert hours == sorted(hours, reverse=True) and hours[0] > 2 * hours[-1], hours
    assert hours[-1] < (UNIT_S + 1830) / 3600 + 0.01  # all at once: one unit's time


def test_max_unavailable_is_never_exceeded(tmp_path):
    jobs = _busy(tmp_path)
    # 25 % of 64 GPUs: two 8-GPU nodes at once whatever the batch; failed units in repair
    # count as out too.
    p = U.Params(batch="100%", max_unavailable="25%", start_s=3600.0, fail_rate=0.5)
    r = _run(jobs, 8, p)
    assert r.units_at_once == 2 and r.limit_gpus == 16
    assert r.failures > 0 and all(u.state == "done" for u in r.unit_log)
    assert r.timeline and max(out for _, out, _ in r.timeline) <= r.limit_gpus
    assert max(n for _, _, n in r.timeline) <= 2
    # A failed unit is out for its repair: the upgrade takes longer than without failures.
    ok = _run(jobs, 8, replace(p, fail_rate=0.0))
    assert r.finish_s > ok.finish_s
    # Below one unit's GPUs a unit may still start when nothing else is out: one at a time.
    tiny = _run(jobs, 8, replace(p, max_unavailable="5%", fail_rate=0.0))
    assert tiny.units_at_once == 1 and max(o for _, o, _ in tiny.timeline) == 8


def test_a_checkpointing_job_moves_at_its_checkpoint_when_there_is_room(tmp_path):
    # One long job (checkpoints every 1,800 s) on the first node; the second node is free.
    jobs = _load(tmp_path, [(0, 20_000, 8, "ta")])
    r = _run(jobs, 2, U.Params(batch="1", start_s=1000.0))
    # It moves to the second node at its first checkpoint after the cordon, and back again
    # when the second node's turn comes: twice, losing nothing.
    assert r.moved_at_checkpoint == 2 and r.drained == 0 and r.lost_gpu_s == 0
    first, second = r.moves
    assert first["at"] == first["saved"] == 1800.0
    assert second["at"] == second["saved"] == 1800.0 + 2 * 1800.0  # the 2nd unit cordons at 5,100
    # It resumed from its checkpoints: it ran its 20,000 s once, and never waited.
    base = _run(jobs, 2, None)
    assert r.queued[0] == 0 and base.finished == r.finished == 1
    assert r.busy_gpu_s(0, 1e9) == pytest.approx(base.busy_gpu_s(0, 1e9)) == 20_000 * 8


def test_a_checkpointing_job_with_no_room_drains_and_loses_at_most_its_interval(tmp_path):
    jobs = _load(tmp_path, [(0, 20_000, 8, "ta")])
    p = U.Params(batch="1", start_s=1000.0)
    r = _run(jobs, 1, p)
    assert r.moved_at_checkpoint == 0 and r.drained == 1
    (move,) = r.moves
    # The deadline is its interval after the cordon; it loses the work since 1,800 s, and the
    # grace period: less than one interval (plus the grace).
    assert move["at"] == 1000.0 + 1800.0 and move["saved"] == 1800.0
    assert 0 < r.lost_gpu_s <= (1800.0 + p.grace_s) * 8
    (unit,) = r.unit_log
    assert unit.empty_at == 1000.0 + 1800.0 + p.grace_s
    assert unit.back_at == unit.empty_at + UNIT_S
    # It resumes once the node is back and runs only what its checkpoint had not saved.
    busy = r.busy_gpu_s(0, 1e9) / 8
    assert busy == pytest.approx(20_000 + (2830.0 - 1800.0))
    assert r.queued[0] == pytest.approx(unit.back_at - 2830.0)


def test_work_without_checkpoints_drains_at_once_and_loses_everything(tmp_path):
    jobs = _load(tmp_path, [(0, 3000, 4, "ta")])  # under an hour: no checkpoints
    p = U.Params(batch="1", start_s=1000.0)
    r = _run(jobs, 1, p)
    (move,) = r.moves
    assert move["how"] == "drain" and move["at"] == 1000.0 and move["saved"] == 0.0
    assert r.lost_gpu_s == pytest.approx((1000.0 + p.grace_s) * 4)
    assert r.unit_log[0].empty_at == 1000.0 + p.grace_s
    assert r.busy_gpu_s(0, 1e9) / 4 == pytest.approx(3000 + 1030)


def test_the_baseline_is_the_philly_replay_of_the_same_jobs(tmp_path):
    jobs = _busy(tmp_path)
    for nodes in (4, 8):
        tenants = philly.quotas(jobs, nodes * 8)
        ours = U.replay(jobs, nodes, tenants, None)
        theirs = philly.replay(jobs, nodes, "default", tenants)
        assert ours.finished == theirs.finished == len(jobs)
        assert ours.preemptions == theirs.preemptions
        assert ours.cycles == theirs.cycles
        assert ours.busy_gpu_s(0, theirs.horizon_s) == pytest.approx(theirs.busy_gpu_s)
        assert sorted(ours.queued.values()) == pytest.approx(sorted(theirs.waits))
    # An upgrade that starts after everything has finished changes nothing.
    late = _run(jobs, 8, U.Params(batch="1", start_s=10 * U.DAY))
    base = _run(jobs, 8, None)
    assert late.queued == base.queued and late.moves == []


def test_cli_json_rows_and_errors(tmp_path):
    rows = [(m, 1200 + 300 * (m % 5), 1 + (m % 3) * 3, "ta" if m % 2 else "tb") for m in range(90)]
    trace = str(_trace(tmp_path, rows))
    args = ["sim", "upgrade", "--jobs", trace, "--nodes", "4", "--window", "0:1", "--scale", "1"]
    args += ["--start-day", "0.02", "--batch", "1,50%,4", "--parallel", "1", "--json"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert [x["batch"] for x in lines[:3]] == ["1", "50%", "4"]
    for key in (
        "units_at_once",
        "hours_to_finish",
        "gpu_hours_out_of_service",
        "work_moved",
        "lost_work_gpu_hours",
        "utilisation",
        "baseline_utilisation",
        "utilisation_drop",
        "mean_queue_wait_s",
        "baseline_mean_queue_wait_s",
    ):
        assert key in lines[0], key
    assert [x["units_at_once"] for x in lines[:3]] == [1, 2, 4]
    assert lines[3]["summary"] == "sim upgrade" and set(lines[3]["hours_to_finish"]) == {
        "1",
        "50%",
        "4",
    }
    table = CliRunner().invoke(cli, args[:-1])
    assert table.exit_code == 0 and "rolling upgrade" in table.stdout, table.output
    for bad in (["--batch", "0"], ["--max-unavailable", "150%"], ["--window", "3:1"]):
        res = CliRunner().invoke(cli, ["sim", "upgrade", "--jobs", trace, *bad])
        assert res.exit_code == 2, (bad, res.output)
