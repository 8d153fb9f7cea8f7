"""The Philly replay: every job finishes once, the figures are consistent, the CLI prints them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from app.cli import cli
from rackplane_bench.sim import philly

pytestmark = pytest.mark.no_db

HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"


def _trace(tmp_path, rows):
    p = tmp_path / "jobs.csv"
    p.write_text(
        HEADER + "".join(f"2017-10-01 00:{m:02d}:00,{d},{g},{d * g},{c}\n" for m, d, g, c in rows)
    )
    return p


def _contended(tmp_path):
    rows = [
        (m % 60, 600 + 37 * m, 1 + (m % 3 == 0) * 7, "ta" if m % 2 else "tb") for m in range(40)
    ]
    rows += [(5, 1200, 16, "tc"), (6, 300, 32, "tc")]
    return _trace(tmp_path, rows)


def test_every_job_finishes_exactly_once_under_every_policy(tmp_path):
    jobs = philly.load_jobs(_contended(tmp_path))
    tenants = philly.quotas(jobs, 4 * philly.GPUS_PER_NODE)
    for policy in ("fifo", "priority", "default", "strict-share"):
        r = philly.replay(jobs, 4, policy, tenants)
        out = r.as_dict()
        assert out["finished"] == out["jobs"] == len(jobs), policy
        # A job never completes faster than it runs, and waits are never negative.
        runtimes = sorted(j.duration for j in jobs)
        assert min(out["p50_jct_s"], *r.jct) >= runtimes[0]
        assert min(r.waits) >= 0
        assert 0 < out["utilisation"] <= 1
        assert out["big_gangs"] == 1  # the 32-GPU job
        assert out["gpu_hours_lost_to_preemption"] >= 0


def test_preempted_jobs_resume_from_their_checkpoint(tmp_path):
    # One long research-or-lower job fills the fleet; a production job arrives later.
    jobs = philly.load_jobs(_trace(tmp_path, [(0, 50_000, 8, "ta"), (30, 600, 8, "tb")]))
    jobs[0].priority, jobs[1].priority = "preemptible", "production"
    r = philly.replay(jobs, 1, "default", philly.quotas(jobs, 8))
    assert r.preemptions == 1 and r.finished == 2
    long_jct = max(r.jct)
    # It loses at most one checkpoint interval plus the grace period, not its 30 minutes of work.
    assert long_jct <= 50_000 + 600 + jobs[0].checkpoint_every + 120 + 30 * 60


def test_trace_loading_windows_and_scale(tmp_path):
    path = _trace(tmp_path, [(0, 60, 1, "a"), (10, 60, 2, "b"), (20, 60, 4, "a")])
    assert [j.gpus for j in philly.load_jobs(path, philly.parse_window("0:0.01"))] == [1, 2]
    assert [j.submit for j in philly.load_jobs(path, scale=2)] == [0, 300, 600]
    gang = philly.request_of(philly.load_jobs(_trace(tmp_path, [(0, 9, 24, "a")]))[0])
    assert (gang.replicas, gang.shape.gpus) == (3, 8)


def test_cli_prints_the_figures_and_the_comparison(tmp_path):
    res = CliRunner().invoke(
        cli, ["sim", "philly", "--jobs", str(_contended(tmp_path)), "--nodes", "4", "--json"]
    )
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    assert [x.get("policy") for x in lines[:3]] == ["fifo", "priority", "default"]
    for key in (
        "mean_jct_s",
        "p50_jct_s",
        "p95_jct_s",
        "p99_jct_s",
        "mean_queue_s",
        "p99_queue_s",
        "max_big_gang_wait_over_runtime",
        "utilisation",
        "tenant_share_vs_entitlement",
        "preemptions",
        "gpu_hours_lost_to_preemption",
        "seconds",
    ):
        assert key in lines[2], key
    summary = lines[3]
    assert summary["summary"] == "default vs fifo"
    assert summary["jct_ratio"] == round(lines[2]["mean_jct_s"] / lines[0]["mean_jct_s"], 4)
    res = CliRunner().invoke(
        cli,
        ["sim", "philly", "--jobs", str(_contended(tmp_path)), "--nodes", "4", "--json"]
        + ["--policy", "fifo,default,strict-share"],
    )
    lines = [json.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    assert [x.get("summary") for x in lines[3:]] == ["default vs fifo", "strict-share vs fifo"]
    assert lines[4]["jct_ratio"] == round(lines[2]["mean_jct_s"] / lines[0]["mean_jct_s"], 4)
    bad = CliRunner().invoke(cli, ["sim", "philly", "--policy", "nope"])
    assert bad.exit_code == 2


def test_cli_share_cap_sets_the_ceiling_of_every_policy_but_the_references(tmp_path):
    trace = str(_contended(tmp_path))

    def run(*extra):
        res = CliRunner().invoke(
            cli, ["sim", "philly", "--jobs", trace, "--nodes", "4", "--json", *extra]
        )
        assert res.exit_code == 0, res.output
        return {x["policy"]: x for x in map(json.loads, res.output.splitlines()) if x.get("policy")}

    names = ("fifo", "priority", "default", "strict-share")
    plain = run("--policy", ",".join(names))
    capped = run("--policy", ",".join(names), "--share-cap", "1.0")
    lifted = run("--policy", "strict-share", "--share-cap", "none")
    assert [plain[p]["share_cap"] for p in names] == [None, None, None, 1.1]
    assert [capped[p]["share_cap"] for p in names] == [None, None, 1.0, 1.0]
    assert lifted["strict-share"]["share_cap"] is None
    # Only the ceiling changes: strict-share keeps its priority scoped to the tenant.
    assert capped["strict-share"]["priority_across_tenants"] is False
    assert lifted["strict-share"]["priority_across_tenants"] is False
    for ref in ("fifo", "priority"):
        assert capped[ref]["mean_jct_s"] == plain[ref]["mean_jct_s"], ref
    # The ceiling holds the over-served tenant back: the default's figures change with it.
    assert capped["default"]["max_share_deviation"] < plain["default"]["max_share_deviation"]
    for bad in ("0.5", "many", "nan", "inf"):
        res = CliRunner().invoke(cli, ["sim", "philly", "--jobs", trace, "--share-cap", bad])
        assert res.exit_code == 2, bad
