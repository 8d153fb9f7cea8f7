"""The portal in a real browser (headless Debian chromium via Playwright) against a real API
process on PostgreSQL and a real Celery worker: sign in, submit a gang and watch it reach
running without a reload, find it on the dashboard with its usage on the chart, terminate it,
sign out and be refused; manage API keys, SSH keys, the budget and its alerts, and past
bills with their export. Operators: the fleet heatmap, and each of their actions once, confirmed and
audited (tenants, prices, a node's and its GPUs' states, chaos experiments, health)."""

from __future__ import annotations

import csv
import io
import re
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from rackplane_bench.seed import seed_big_fleet
from tests.fixtures.browser import portal_page, shot
from tests.fixtures.workloads import ALL, fleet
from tests.fixtures.world import SMALL_FLEET, auth, wait_until

pytestmark = pytest.mark.usefixtures("celery_worker_process")


def _ssh_key_pair() -> tuple[str, str, str]:
    """An ed25519 key pair as `ssh-keygen` writes it: the public line, the private file's
    text, and the public key's SHA256 fingerprint (as `ssh-keygen -l` prints it)."""
    import base64
    import hashlib

    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ed25519

    k = ed25519.Ed25519PrivateKey.generate()
    pub = k.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH).decode()
    secret = k.private_bytes(
        ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption()
    ).decode()
    digest = hashlib.sha256(base64.b64decode(pub.split()[1])).digest()
    return pub, secret, "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def sign_in(page, key: str) -> None:
    page.goto("/portal/")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("button", name="Sign out").wait_for()
    # The page forgot the key: it is in no field, and the cookie holding the session is
    # HttpOnly (not readable by the page's scripts).
    assert key not in page.content()
    assert "rp_session" not in page.evaluate("document.cookie")


# A dry run's outcome, in words and in a colour that means it (the box's left border).
VERDICT_COLOUR = {
    "now": "rgb(46, 125, 50)",  # green: it starts now
    "preempts": "rgb(179, 89, 0)",  # amber: it starts once the workloads it preempts stop
    "waits": "rgb(0, 114, 178)",  # blue: it queues, to start when running work ends
    "never": "rgb(164, 0, 0)",  # red: it does not fit the fleet
}


def state_of(api: str, key: str, wid: str) -> str:
    return httpx.get(f"{api}/v1/workloads/{wid}", headers=auth(key)).json()["state"]


def previewed(page, verdict: str) -> str:
    """The dry run's box once it shows `verdict`: its colour checked, its text returned."""
    box = page.locator(f"[data-testid=dry-run][data-verdict={verdict}]")
    box.wait_for()
    colour = box.evaluate("e => getComputedStyle(e).borderLeftColor")
    assert colour == VERDICT_COLOUR[verdict], (verdict, colour)
    return box.inner_text()


def created_by_api(api: str, key: str, wid: str) -> dict:
    return httpx.get(f"{api}/v1/workloads/{wid}", headers=auth(key)).json()


def _ship_output(api: str, op: str, workload: dict, text: str, replica: int = 1) -> None:
    """What a node agent does with a run's output: join as the replica's node, post a chunk."""
    node = next(p["node"] for p in workload["placement"] if p["replica"] == replica)
    nodes = httpx.get(f"{api}/v1/admin/nodes", params={"limit": 50}, headers=auth(op)).json()
    nid = next(n["id"] for n in nodes["items"] if n["name"] == node)
    token = httpx.post(f"{api}/v1/admin/nodes/{nid}/join-tokens", headers=auth(op)).json()
    cred = httpx.post(f"{api}/v1/agent/join", json={"token": token["token"]}).json()["credential"]
    chunk = {
        "workload_id": workload["id"],
        "attempt": workload["attempts"],
        "replica": replica,
        "offset": 0,
        "data": text,
        "at": datetime.now(UTC).isoformat(),
    }
    r = httpx.post(f"{api}/v1/agent/logs", json={"chunks": [chunk]}, headers=auth(cred))
    assert r.status_code == 200 and r.json() == {"accepted": 1, "stale": 0}, r.text


def test_a_tenant_signs_in_runs_a_gang_watches_it_live_and_signs_out(api, world, browser):  # noqa: F811
    world.fleet(fleet(2))
    tenant = world.tenant("acme", policy=ALL)
    key = world.key(tenant)
    # A quota row for A100s only: the tenant's H100s (no row) must be on its quota chart too.
    r = httpx.put(
        f"{api}/v1/admin/tenants/{tenant.id}/quotas",
        json={"quotas": [{"gpu_model": "A100-80GB", "limit_milli": 8000}]},
        headers=auth(world.key()),
    )
    assert r.status_code == 200, r.text
    r = httpx.post(  # $3 an H100-hour: the preview prices what it shows
        f"{api}/v1/admin/prices",
        json={
            "gpu_model": "H100-80GB",
            "shape": "whole",
            "plan": "preemptible",
            "currency": "usd",
            "unit_amount": 300,
            "effective_from": _month_start(1).isoformat(),
        },
        headers=auth(world.key()),
    )
    assert r.status_code == 201, r.text
    # Higher-priority work holds one of the two 8-GPU nodes all along.
    serving = httpx.post(
        f"{api}/v1/workloads",
        json={"name": "serving", "kind": "instance", "gpus": 8, "priority": "production"},
        headers=auth(key),
    ).json()["id"]
    refused = "the server responded with a status of 401"  # the browser's line for the 401
    with portal_page(browser, api, "sign-in", expected=(refused,)) as page:
        page.goto("/portal/")
        page.get_by_label("API key").fill("rp_" + "x" * 48)
        page.get_by_role("button", name="Sign in").click()
        page.get_by_role("alert").filter(has_text="invalid_api_key").wait_for()

    with portal_page(browser, api, "workload") as page:
        sign_in(page, key)
        page.get_by_role("heading", name=re.compile("Acme")).wait_for()
        wait_until(lambda: state_of(api, key, serving) == "running", timeout=60)
        page.get_by_role("navigation").get_by_role("link", name="Submit").click()
        # A gang; the preview says whether, when and where it would start, as the API does.
        page.get_by_label("Name").fill("train-llm")
        page.get_by_label("Kind").select_option("job")
        page.get_by_label("Keep the replicas within").select_option("rack")
        page.get_by_label("GPU model", exact=True).select_option("H100-80GB")
        page.get_by_label("Priority").select_option("preemptible")
        gpus = page.get_by_label("GPUs per replica")
        replicas = page.get_by_label("Replicas", exact=True)
        gpus.fill("8")
        replicas.fill("3")  # three 8-GPU replicas: the fleet has two such nodes
        page.get_by_role("button", name="Preview (dry run)").click()
        assert "does not fit the fleet" in previewed(page, "never")
        replicas.fill("2")  # both nodes: one waits for the production work to end
        page.get_by_role("button", name="Preview (dry run)").click()
        assert "It would queue, expected to start at" in previewed(page, "waits")
        gpus.fill("4")  # two of 4: the free node holds both
        page.get_by_role("button", name="Preview (dry run)").click()
        assert "It would start now" in previewed(page, "now")
        # Its price (issue 45 item 15): 2 x 4 H100s at the preemptible $3.
        price = page.get_by_test_id("dry-run-price").inner_text()
        assert price.startswith("$24.00 an hour (preemptible list price)"), price
        preview = page.get_by_test_id("dry-run")
        assert preview.locator("tbody tr").count() == 2
        # The form still holds what was previewed.
        assert (gpus.input_value(), replicas.input_value()) == ("4", "2")
        shot(page, "submit")
        # The API's own validation message, shown as it gives it.
        replicas.fill("5000")
        page.get_by_role("button", name="Submit", exact=True).click()
        problem = page.locator("#form-problem")
        problem.filter(has_text="validation_error").wait_for()
        assert "replicas" in problem.inner_text()
        replicas.fill("2")
        # Its restart policy: restarted after its own failure too, at most 4 times.
        page.get_by_label("Restart after its own failure").check()
        page.get_by_label("At most this many restarts").fill("4")
        page.evaluate("window.__sameDocument = true")  # gone if the page reloads
        page.get_by_role("button", name="Submit", exact=True).click()
        page.wait_for_url(re.compile(r"/portal/workloads/[0-9a-f-]{36}$"))
        wid = page.url.rsplit("/", 1)[1]
        # What was submitted is what was previewed.
        created = httpx.get(f"{api}/v1/workloads/{wid}", headers=auth(key)).json()
        assert (created["replicas"], created["shape"]["gpus"]) == (2, 4), created
        assert created["shape"]["gpu_models"] == ["H100-80GB"]
        assert created["restart_policy"]["on"] == ["failure", "infrastructure", "preemption"]
        assert created["restart_policy"]["max_restarts"] == 4
        restarts = page.get_by_test_id("restarts")
        restarts.filter(has_text="none; 0 of 4 counted").wait_for()
        assert "restarts after failure, infrastructure, preemption" in restarts.inner_text()
        # Its states arrive over the subscription as they change: no reload.
        state = page.get_by_test_id("workload-state")
        timeline = page.get_by_test_id("timeline")
        timeline.locator("li[data-state=running]").wait_for(timeout=60_000)
        wait_until(lambda: state.inner_text() == "running", timeout=20)
        assert page.evaluate("window.__sameDocument") is True
        seen = [li.get_attribute("data-state") for li in timeline.locator("li").all()]
        assert seen[: seen.index("running") + 1][-1] == "running" and "queued" in seen
        placement = page.get_by_test_id("placement")
        assert placement.locator("tbody tr").count() == 2
        assert "hgx-1" in placement.inner_text()
        shot(page, "workload-running")
        # Its node's agent ships a line of replica 1's output: the log pane shows it live,
        # and the replica selector narrows the pane to one replica.
        _ship_output(api, world.key(), created_by_api(api, key, wid), "epoch 1: loss 0.42\n")
        pane = page.get_by_test_id("log-pane")
        wait_until(lambda: "[1] epoch 1: loss 0.42" in pane.inner_text(), timeout=20)
        page.get_by_test_id("log-replica").select_option("0")
        wait_until(lambda: "epoch 1" not in pane.inner_text(), timeout=10)
        page.get_by_test_id("log-replica").select_option("all")
        wait_until(lambda: "[1] epoch 1: loss 0.42" in pane.inner_text(), timeout=20)
        # The fleet is full now: a copy of it would be accepted and queue, not "fit now".
        page.get_by_role("button", name="Dry-run a copy").click()
        assert "It would queue, expected to start at" in previewed(page, "waits")

        # Production work would start by preempting it (preemptible): the preview names it.
        page.get_by_role("navigation").get_by_role("link", name="Submit").click()
        page.get_by_label("GPUs per replica").fill("4")
        page.get_by_label("GPU model", exact=True).select_option("H100-80GB")
        page.get_by_label("Priority").select_option("production")
        page.get_by_role("button", name="Preview (dry run)").click()
        text = previewed(page, "preempts")
        assert "It would start after preempting others" in text
        victims = page.get_by_test_id("dry-run-victims")
        assert victims.get_by_role("link", name=wid[:8]).get_attribute("href").endswith(wid)

        # The dashboard lists it and its usage reaches the chart.
        page.get_by_role("navigation").get_by_role("link", name="Dashboard").click()
        row = page.get_by_test_id("workloads").locator("tr", has_text="train-llm")
        row.wait_for()
        assert "running" in row.inner_text() and "2 × (4× GPU" in row.inner_text()
        # Its quota chart has every model it has a quota for or runs on.
        quota_chart = page.get_by_test_id("quota-chart")
        assert quota_chart.get_attribute("data-labels") == "A100-80GB|H100-80GB"
        h100 = page.locator("tr", has=page.get_by_role("rowheader", name="H100-80GB"))
        assert h100.locator("td").first.inner_text() == "16"  # serving's 8 and train-llm's 8

        def charted() -> bool:
            page.get_by_label("Daily, last 30 days").check()
            page.get_by_label("Hourly, last 24 h").check()
            return page.get_by_test_id("usage-chart").count() == 1

        wait_until(charted, timeout=60, interval=2)
        assert float(page.get_by_test_id("usage-total").inner_text()) > 0
        # The month's bill names each line's region and plan (issue 45 item 16: two rows of
        # the same SKU and tier looked the same).
        lines = page.get_by_test_id("upcoming-lines").locator("tbody tr")
        assert any(
            "r1" in t and "preemptible" in t and "$" in t for t in lines.all_inner_texts()
        ), lines.all_inner_texts()
        assert int(page.get_by_test_id("usage-chart").get_attribute("data-points")) >= 1
        shot(page, "dashboard")

        # Terminate it from its page: it asks first; cancelled, nothing happens.
        page.get_by_role("link", name="train-llm").click()
        page.get_by_role("button", name="Terminate").click()
        dialog = page.get_by_role("dialog", name="Terminate train-llm?")
        dialog.wait_for()
        cancel = dialog.get_by_role("button", name="Cancel")
        assert cancel.evaluate("e => e === document.activeElement")  # the safe choice first
        shot(page, "terminate-confirm")
        cancel.click()
        dialog.wait_for(state="hidden")
        page.wait_for_timeout(1000)  # time enough for a terminate to land, had one been sent
        assert state_of(api, key, wid) == "running" and state.inner_text() == "running"
        # Escape closes it too; then confirmed, it terminates.
        page.get_by_role("button", name="Terminate").click()
        dialog.wait_for()
        page.keyboard.press("Escape")
        dialog.wait_for(state="hidden")
        page.get_by_role("button", name="Terminate").click()
        dialog.get_by_role("button", name="Terminate it").click()
        timeline.locator("li[data-state=terminated]").wait_for(timeout=30_000)
        wait_until(lambda: state.inner_text() == "terminated", timeout=20)
        assert page.evaluate("window.__sameDocument") is True
        assert state_of(api, key, wid) == "terminated"
        assert state_of(api, key, serving) == "running"

        # Sign out: back to the sign-in page, and the old session's cookie is refused.
        cookie = next(c for c in page.context.cookies() if c["name"] == "rp_session")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        page.get_by_role("button", name="Sign out").click()
        page.get_by_role("button", name="Sign in").wait_for()
        assert not [c for c in page.context.cookies() if c["name"] == "rp_session"]
        page.reload()
        page.get_by_role("button", name="Sign in").wait_for()
        replay = httpx.get(f"{api}/v1/workloads", cookies={"rp_session": cookie["value"]})
        assert replay.status_code == 401 and replay.json()["code"] == "session_ended"


def test_a_queued_workload_says_why_it_waits_on_its_page(api, world, browser):  # noqa: F811
    """Issue 45 item 12: a queued workload's page says why it waits (REST's `pending`)."""
    world.fleet(fleet(1))
    tenant = world.tenant("acme", policy=ALL)
    key = world.key(tenant)

    def submit(name: str) -> str:
        r = httpx.post(
            f"{api}/v1/workloads",
            json={"kind": "job", "name": name, "gpus": 8, "run_for_s": 3600},
            headers=auth(key),
        )
        assert r.status_code == 201, r.text
        return r.json()["id"]

    holder = submit("holder")
    wait_until(lambda: state_of(api, key, holder) == "running", timeout=60)
    waiting = submit("waiting")

    def reason() -> str | None:
        got = httpx.get(f"{api}/v1/workloads/{waiting}", headers=auth(key)).json()
        return (got.get("pending") or {}).get("reason")

    wait_until(reason, timeout=30)
    with portal_page(browser, api, "pending") as page:
        sign_in(page, key)
        page.goto(f"/portal/workloads/{waiting}")
        why = page.get_by_test_id("pending-reason")
        why.wait_for()
        assert why.get_attribute("data-reason") == reason() == "Resources"
        assert why.inner_text().startswith("Waits: Resources, ")
        shot(page, "workload-pending")

        # Issue 45 item 14: an array of three, one at a time, after the holder succeeds,
        # submitted from the form; its page says it waits for the holder and lists its
        # elements.
        page.goto("/portal/submit")
        page.get_by_label(re.compile("^Name")).fill("sweep")
        page.get_by_label("GPUs per replica").fill("1")
        page.get_by_label("Replicas", exact=True).fill("1")
        page.get_by_label("Elements (each gets RACKPLANE_ARRAY_INDEX)").fill("3")
        page.get_by_label("Elements under way at once").fill("1")
        page.get_by_label("Start after these succeed").fill(holder)
        page.get_by_role("button", name="Submit", exact=True).click()
        page.wait_for_url(re.compile(r"/portal/workloads/[0-9a-f-]{36}$"))
        first = httpx.get(f"{api}/v1{page.url.split('/portal')[1]}", headers=auth(key)).json()
        assert first["depends_on"] == [holder] and first["array"]["count"] == 3, first
        assert first["array"]["max_parallel"] == 1
        page.get_by_test_id("depends-on").filter(has_text=holder[:8]).wait_for()
        elements = page.get_by_test_id("array-elements")
        elements.locator("li").nth(2).wait_for()
        assert elements.locator("li").count() == 3
        assert page.get_by_test_id("pending-reason").get_attribute("data-reason") == "Dependency"
        shot(page, "workload-array")

        # Issue 46: an elastic gang from the form; its page shows its size now and its floor.
        page.goto("/portal/submit")
        page.get_by_label(re.compile("^Name")).fill("stretchy")
        page.get_by_label("GPUs per replica").fill("1")
        page.get_by_label("Replicas", exact=True).fill("3")
        page.get_by_label("Losing a host, go on with no fewer than").fill("2")
        page.get_by_role("button", name="Submit", exact=True).click()
        page.wait_for_url(re.compile(r"/portal/workloads/[0-9a-f-]{36}$"))
        made = httpx.get(f"{api}/v1{page.url.split('/portal')[1]}", headers=auth(key)).json()
        assert made["elastic"] == {"min_replicas": 2, "current_replicas": 3}, made
        shown = page.get_by_test_id("elastic")
        shown.wait_for()
        assert shown.inner_text() == "3 of 3 replicas now (goes on with at least 2)"


def test_a_tenant_launches_an_instance_with_an_ssh_key_and_sees_how_to_log_in(api, world, browser):  # noqa: F811
    from app.core.db import session_scope, utcnow
    from app.models.workloads import Workload

    world.fleet(fleet(1))
    key = world.key(world.tenant("acme", policy=ALL))
    pub, _, _ = _ssh_key_pair()
    for name, text in (("laptop", pub), ("old", _ssh_key_pair()[0])):
        r = httpx.post(
            f"{api}/v1/ssh-keys", json={"name": name, "public_key": text}, headers=auth(key)
        )
        assert r.status_code == 201, r.text
    with portal_page(browser, api, "ssh-instance") as page:
        page.context.grant_permissions(["clipboard-read", "clipboard-write"])
        sign_in(page, key)
        page.get_by_role("navigation").get_by_role("link", name="Submit").click()
        page.get_by_label("Name").fill("box")
        page.get_by_label("Kind").select_option("instance")
        page.get_by_label("GPUs per replica").fill("1")
        # The tenant's keys are offered by name; both chosen, one deleted meanwhile (another
        # tab): the API's typed refusal names it.
        choice = page.get_by_test_id("ssh-keys-choice")
        choice.get_by_role("checkbox", name=re.compile("^laptop")).check()
        choice.get_by_role("checkbox", name=re.compile("^old")).check()
        page.get_by_label("Runtime").select_option("podman")
        page.get_by_label("Image").fill("docker.io/library/ubuntu:24.04")
        [old] = [
            k
            for k in httpx.get(f"{api}/v1/ssh-keys", headers=auth(key)).json()["items"]
            if k["name"] == "old"
        ]
        assert httpx.delete(f"{api}/v1/ssh-keys/{old['id']}", headers=auth(key)).is_success
        submit = page.get_by_role("button", name="Submit", exact=True)
        submit.click()
        problem = page.locator("#form-problem")
        problem.filter(has_text="unknown_ssh_key").wait_for()
        assert "'old'" in problem.inner_text()
        assert choice.get_attribute("aria-invalid") == "true"
        shot(page, "submit-ssh-keys")
        choice.get_by_role("checkbox", name=re.compile("^old")).uncheck()
        # A process has no SSH server of its own: refused too, saying why.
        page.get_by_label("Runtime").select_option("process")
        submit.click()
        problem.filter(has_text="podman runtime").wait_for()
        assert "validation_error" in problem.inner_text()
        page.get_by_label("Runtime").select_option("podman")
        submit.click()
        page.wait_for_url(re.compile(r"/portal/workloads/[0-9a-f-]{36}$"))
        wid = page.url.rsplit("/", 1)[1]
        # What the form sent reached the API: the key's public text, copied at launch.
        created = created_by_api(api, key, wid)
        assert (created["runtime"], created["image"]) == (
            "podman",
            "docker.io/library/ubuntu:24.04",
        )
        assert created["ssh_keys"] == [pub] and created["connect"] is None, created
        page.get_by_test_id("connect-pending").wait_for()
        wait_until(lambda: state_of(api, key, wid) == "running", timeout=60)

        def report(**columns) -> None:  # what the node agent's report sets
            with session_scope() as s:
                w = s.get(Workload, uuid.UUID(wid))
                for k, v in columns.items():
                    setattr(w, k, v)

        # Its agent started it on port 22001: the command shows, booting until SSH answers.
        report(ssh_host="10.0.0.7", ssh_port=22001)
        page.reload()
        command = page.get_by_test_id("connect-command")
        command.wait_for()
        assert command.inner_text() == "ssh -p 22001 root@10.0.0.7"
        assert page.get_by_test_id("connect-state").inner_text() == "booting"
        report(ssh_ready_at=utcnow())
        page.reload()
        page.locator("[data-testid=connect][data-ready=true]").wait_for()
        assert page.get_by_test_id("connect-state").inner_text() == "ready"
        page.get_by_role("button", name="Copy the command").click()
        page.get_by_role("status").filter(has_text="Copied").wait_for()
        assert page.evaluate("navigator.clipboard.readText()") == "ssh -p 22001 root@10.0.0.7"
        shot(page, "ssh-instance")


# --- a tenant's account: API keys, budget, bills -------------------------------------------------


def _month_start(back: int = 0) -> datetime:
    now = datetime.now(UTC)
    y, m = divmod(now.year * 12 + now.month - 1 - back, 12)
    return datetime(y, m + 1, 1, tzinfo=UTC)


def _usage(api: str, op: str, tenant, at: datetime) -> None:
    """One H100 GPU-hour for `tenant` at `at` (60 GPUs for a minute), as the meter reports it."""
    alloc = str(uuid.uuid4())
    base = {
        "allocation_id": alloc,
        "workload_id": alloc,
        "tenant_id": str(tenant.id),
        "region": "r1",
        "gpu_model": "H100-80GB",
        "shape": "whole",
        "tier": "dedicated-gpu",
        "priority": "training",
        "gpu_milli": 60_000,
    }
    events = [
        {**base, "event_key": f"{alloc}:start", "kind": "start", "occurred_at": at.isoformat()},
        {
            **base,
            "event_key": f"{alloc}:stop",
            "kind": "stop",
            "occurred_at": (at + timedelta(minutes=1)).isoformat(),
        },
    ]
    r = httpx.post(f"{api}/v1/admin/usage/events", json={"events": events}, headers=auth(op))
    assert r.status_code == 200, r.text


def test_a_tenant_manages_its_keys_budget_and_bills(api, world, browser):  # noqa: F811
    op = world.key()
    tenant = world.tenant("acme", policy=ALL)
    key = world.key(tenant, name="laptop")
    r = httpx.post(
        f"{api}/v1/admin/prices",
        json={
            "gpu_model": "H100-80GB",
            "shape": "whole",
            "plan": "on_demand",
            "currency": "usd",
            "unit_amount": 300,  # $3 a GPU-hour
            "effective_from": (_month_start(3)).isoformat(),
        },
        headers=auth(op),
    )
    assert r.status_code == 201, r.text
    last_month = _month_start(1).strftime("%Y-%m")
    _usage(api, op, tenant, _month_start(1) + timedelta(days=2))  # last month: 2 GPU-hours
    _usage(api, op, tenant, _month_start(1) + timedelta(days=3))
    _usage(api, op, tenant, _month_start() + timedelta(minutes=1))  # this month: $3 spent

    with portal_page(browser, api, "account") as page:
        page.context.grant_permissions(["clipboard-read", "clipboard-write"])
        sign_in(page, key)
        nav = page.get_by_role("navigation", name="Main")

        # Keys: this session's own is listed and marked.
        nav.get_by_role("link", name="API keys").click()
        keys = page.get_by_test_id("keys")
        mine = keys.locator("tr", has_text="laptop")
        mine.wait_for()
        assert "this session" in mine.inner_text() and "read, write, admin" in mine.inner_text()
        # A key with the read scope only; an expiry in the past is refused next to its field.
        page.get_by_label("Name").fill("ci-reader")
        page.get_by_label(re.compile("^write:")).uncheck()
        page.get_by_label(re.compile("^Expires")).fill("2001-01-01T00:00")
        page.get_by_role("button", name="Create key").click()
        expiry_error = page.get_by_test_id("key-expires-error")
        expiry_error.filter(has_text="in the future").wait_for()
        assert page.get_by_label(re.compile("^Expires")).get_attribute("aria-invalid") == "true"
        assert page.get_by_test_id("new-key").count() == 0
        page.get_by_label(re.compile("^Expires")).fill("")
        page.get_by_role("button", name="Create key").click()
        # Its secret, once, with a warning and a copy button.
        panel = page.get_by_test_id("new-key")
        panel.wait_for()
        assert "only time it is shown" in panel.inner_text()
        secret = page.get_by_test_id("new-key-secret").inner_text().strip()
        assert secret.startswith("rp_") and len(secret) == 51
        assert expiry_error.inner_text() == ""
        panel.get_by_role("button", name="Copy the key").click()
        panel.get_by_role("status").filter(has_text="Copied").wait_for()
        assert page.evaluate("navigator.clipboard.readText()") == secret
        shot(page, "keys-created")
        # It is a working key with the scopes chosen: it reads, and may not write.
        assert httpx.get(f"{api}/v1/workloads", headers=auth(secret)).status_code == 200
        w = httpx.post(
            f"{api}/v1/workloads", json={"kind": "instance", "gpus": 1}, headers=auth(secret)
        )
        assert w.status_code == 403 and w.json()["code"] == "insufficient_scope", w.text
        row = keys.locator("tr", has_text="ci-reader")
        row.wait_for()
        assert (
            row.get_attribute("data-status") == "active"
            and "read" == row.locator("td").nth(1).inner_text()
        )
        # Reloaded, the secret is nowhere in the page.
        page.reload()
        row.wait_for()
        assert secret not in page.content() and page.get_by_test_id("new-key").count() == 0
        # Revoke it: asked first (Cancel focused; Esc keeps the key), then refused with it.
        revoke = row.get_by_role("button", name=re.compile("^Revoke ci-reader"))
        revoke.click()
        dialog = page.get_by_role("dialog", name="Revoke ci-reader?")
        dialog.wait_for()
        assert dialog.get_by_role("button", name="Cancel").evaluate(
            "e => e === document.activeElement"
        )
        shot(page, "keys-revoke-confirm")
        page.keyboard.press("Escape")
        dialog.wait_for(state="hidden")
        assert httpx.get(f"{api}/v1/workloads", headers=auth(secret)).status_code == 200
        revoke.click()
        dialog.get_by_role("button", name="Revoke it").click()
        dialog.wait_for(state="hidden")
        page.locator("tr[data-status=revoked]", has_text="ci-reader").wait_for()
        refused = httpx.get(f"{api}/v1/workloads", headers=auth(secret))
        assert refused.status_code == 401 and refused.json()["code"] == "revoked_api_key", (
            refused.text
        )
        assert mine.get_attribute("data-status") == "active"

        # SSH keys: one added shows ssh-keygen's fingerprint; a pasted private key is refused
        # under the field (and cleared from it); deleted after confirming.
        nav.get_by_role("link", name="SSH keys").click()
        page.get_by_test_id("no-ssh-keys").wait_for()
        pub, secret_key, print_ = _ssh_key_pair()
        page.get_by_label("Name").fill("workstation")
        page.get_by_label(re.compile("^Public key")).fill(pub + "\n")
        page.get_by_role("button", name="Add key").click()
        page.get_by_test_id("ssh-key-fingerprint").filter(has_text=print_).wait_for()
        page.get_by_label("Name").fill("oops")
        page.get_by_label(re.compile("^Public key")).fill(secret_key)
        page.get_by_role("button", name="Add key").click()
        page.get_by_test_id("ssh-key-public-error").filter(has_text="private key").wait_for()
        assert page.get_by_label(re.compile("^Public key")).input_value() == ""
        shot(page, "ssh-keys")
        stored = httpx.get(f"{api}/v1/ssh-keys", headers=auth(key)).json()["items"]
        assert [(k["name"], k["fingerprint"]) for k in stored] == [("workstation", print_)]
        page.get_by_role("button", name="Delete workstation").click()
        page.get_by_role("dialog", name="Delete workstation?").get_by_role(
            "button", name="Delete it"
        ).click()
        page.get_by_test_id("no-ssh-keys").wait_for()
        assert httpx.get(f"{api}/v1/ssh-keys", headers=auth(key)).json()["items"] == []

        # Secrets: a value goes in and is shown nowhere after (not even in its field); a bad
        # name is refused under its field; one in use by a workload is not deleted, and says
        # which; the workload's page names the secret, never the value.
        nav.get_by_role("link", name="Secrets").click()
        page.get_by_test_id("no-secrets").wait_for()
        token = "hf_portal_" + "x" * 20
        page.get_by_label(re.compile("^Name")).fill("bad name")
        page.get_by_label("Value", exact=True).fill(token)
        page.get_by_role("button", name="Save secret").click()
        page.get_by_test_id("secret-name-error").filter(has_text="pattern").wait_for()
        assert page.get_by_label("Value", exact=True).input_value() == ""
        page.get_by_label(re.compile("^Name")).fill("hf-token")
        page.get_by_label("Value", exact=True).fill(token)
        page.get_by_role("button", name="Save secret").click()
        page.get_by_test_id("secret-saved").filter(has_text="Saved hf-token").wait_for()
        page.locator("tr[data-secret=hf-token]").wait_for()
        assert token not in page.content()
        shot(page, "secrets")
        world.fleet(SMALL_FLEET)
        used = httpx.post(
            f"{api}/v1/workloads",
            json={
                "kind": "instance",
                "gpus": 1,
                "secret_env": {"HF_TOKEN": "hf-token"},
                "workdir": "src",
            },
            headers=auth(key),
        )
        assert used.status_code == 201, used.text
        page.get_by_role("button", name="Delete hf-token").click()
        page.get_by_role("dialog", name="Delete hf-token?").get_by_role(
            "button", name="Delete it"
        ).click()
        page.locator("tr[data-secret=hf-token] .error").filter(has_text="secret_in_use").wait_for()
        page.goto(f"{api}/portal/workloads/{used.json()['id']}")
        page.get_by_test_id("secret-env").filter(has_text="HF_TOKEN from hf-token").wait_for()
        assert page.get_by_test_id("workdir").inner_text() == "src"
        assert token not in page.content()
        httpx.delete(f"{api}/v1/workloads/{used.json()['id']}", headers=auth(key))
        page.goto(f"{api}/portal/secrets")
        page.get_by_role("button", name="Delete hf-token").click()
        page.get_by_role("dialog", name="Delete hf-token?").get_by_role(
            "button", name="Delete it"
        ).click()
        page.get_by_test_id("no-secrets").wait_for()

        # Volumes (issue 45 item 13): made from the page, a bad name refused under its field;
        # a workload mounts it (its page says where); in use, it is not deleted.
        nav.get_by_role("link", name="Volumes").click()
        page.get_by_test_id("no-volumes").wait_for()
        page.get_by_label("Volume (letters").fill("bad name")
        page.get_by_role("button", name="Make volume").click()
        page.get_by_test_id("volume-name-error").filter(has_text="pattern").wait_for()
        page.get_by_label("Volume (letters").fill("ckpt")
        page.get_by_label("Where its files live").select_option("shared")
        page.get_by_role("button", name="Make volume").click()
        page.get_by_test_id("volume-made").filter(
            has_text="ckpt is ready (shared storage)"
        ).wait_for()
        page.locator("tr[data-volume=ckpt]").wait_for()
        mounted = httpx.post(
            f"{api}/v1/workloads",
            json={
                "kind": "instance",
                "gpus": 1,
                "volumes": [{"name": "ckpt", "mount_path": "ckpt"}],
            },
            headers=auth(key),
        )
        assert mounted.status_code == 201, mounted.text
        page.get_by_role("button", name="Delete ckpt").click()
        page.get_by_role("dialog", name="Delete ckpt?").get_by_role(
            "button", name="Delete it"
        ).click()
        page.locator("tr[data-volume=ckpt] .error").filter(has_text="volume_in_use").wait_for()
        page.goto(f"{api}/portal/workloads/{mounted.json()['id']}")
        page.get_by_test_id("volumes").filter(has_text="ckpt (shared) at ckpt").wait_for()
        httpx.delete(f"{api}/v1/workloads/{mounted.json()['id']}", headers=auth(key))
        page.goto(f"{api}/portal/volumes")
        page.get_by_role("button", name="Delete ckpt").click()
        page.get_by_role("dialog", name="Delete ckpt?").get_by_role(
            "button", name="Delete it"
        ).click()
        page.get_by_test_id("no-volumes").wait_for()

        # Endpoints (issue 47): made from the page, a bad name refused under its field; its row
        # shows its replicas and target, its decisions what they were made from.
        nav.get_by_role("link", name="Endpoints").click()
        page.get_by_test_id("no-endpoints").wait_for()
        page.get_by_label("Endpoint (letters").fill("bad name")
        page.get_by_role("button", name="Make endpoint").click()
        page.get_by_test_id("endpoint-name-error").filter(has_text="pattern").wait_for()
        page.get_by_label("Endpoint (letters").fill("chat")
        page.get_by_label("Server command").fill("python3\nserve.py")
        page.get_by_label("Copies kept when idle").fill("1")
        page.get_by_role("button", name="Make endpoint").click()
        page.get_by_test_id("endpoint-made").filter(
            has_text="chat is at /e/chat/ on the gateway, 1 replica(s) to start"
        ).wait_for()
        row = page.locator("tr[data-endpoint=chat]")
        row.get_by_test_id("endpoint-target").filter(has_text="1 (1–2)").wait_for()
        row.filter(has_text="chat-1").wait_for()
        row.get_by_role("button", name="Decisions").click()
        page.get_by_test_id("endpoint-events").filter(has_text="created (set)").wait_for()
        page.get_by_role("button", name="Delete chat").click()
        page.get_by_role("dialog", name="Delete chat?").get_by_role(
            "button", name="Delete it"
        ).click()
        page.get_by_test_id("no-endpoints").wait_for()

        # Budget: none yet; a negative limit is refused next to its field.
        nav.get_by_role("link", name="Budget").click()
        page.get_by_test_id("no-budget").wait_for()
        spend = page.get_by_label(re.compile("^Spend limit"))
        spend.fill("-1")
        page.get_by_role("button", name="Set budget").click()
        page.get_by_test_id("b-spend-error").filter(
            has_text="greater than or equal to 0"
        ).wait_for()
        assert spend.get_attribute("aria-invalid") == "true"
        # Set: $5 a month; the $3 spent crosses 50 %.
        spend.fill("5")
        page.get_by_role("button", name="Set budget").click()
        page.get_by_test_id("budget-saved").filter(has_text="Budget set.").wait_for()
        status = page.get_by_test_id("budget-status")
        assert "$3.00 of $5.00" in status.inner_text()
        alerts = page.get_by_test_id("budget-alerts")
        assert [a.get_attribute("data-pct") for a in alerts.locator("li").all()] == ["50"]
        # Changed to $3.50 and 10 GPU-hours: 80 % of the spend is passed too.
        spend = page.get_by_label(re.compile("^Spend limit"))
        assert spend.input_value() == "5.00"
        spend.fill("3.50")
        page.get_by_label(re.compile("^GPU-hour limit")).fill("10")
        page.get_by_role("button", name="Save changes").click()
        page.get_by_test_id("budget-saved").filter(has_text="Budget changed.").wait_for()
        assert "$3.00 of $3.50" in status.inner_text() and "of 10" in status.inner_text()
        wait_until(lambda: alerts.locator("li").count() == 2, timeout=5)
        assert "Spend passed 80%: $3.00 of $3.50" in alerts.inner_text()
        mine_now = httpx.get(f"{api}/v1/budget", headers=auth(key)).json()
        assert (mine_now["spend_limit"], mine_now["gpu_hour_limit"]) == (350, 10)
        shot(page, "budget")
        # Removed, after confirming.
        page.get_by_role("button", name="Remove budget").click()
        dialog = page.get_by_role("dialog", name="Remove the budget?")
        dialog.get_by_role("button", name="Remove it").click()
        page.get_by_test_id("no-budget").wait_for()
        assert httpx.get(f"{api}/v1/budget", headers=auth(key)).status_code == 404

        # Billing: last month in the history, its bill, and its export downloaded.
        nav.get_by_role("link", name="Billing").click()
        # It opens on the month in progress (issue 45 item 16: it opened on last month).
        this_month = datetime.now(UTC).strftime("%Y-%m")
        page.locator(f"[data-testid=bill][data-period='{this_month}']").wait_for()
        history = page.get_by_test_id("bill-history")
        month = history.locator(f"tr[data-period='{last_month}']")
        month.wait_for()
        assert "$6.00" in month.inner_text() and "2.000" in month.inner_text()
        month.get_by_role("link").click()
        page.wait_for_url(re.compile(f"/portal/billing/{last_month}$"))
        bill = page.locator(f"[data-testid=bill][data-period='{last_month}']")
        bill.get_by_test_id("bill-lines").wait_for()
        assert bill.get_by_test_id("bill-total").inner_text() == "$6.00"
        line = bill.get_by_test_id("bill-lines").locator("tbody tr")
        assert line.count() == 1 and "H100-80GB/whole" in line.inner_text()
        assert "$3.00 (v1)" in line.inner_text()
        shot(page, "billing")
        with page.expect_download() as got:
            bill.get_by_role("button", name="Download CSV").click()
        assert got.value.suggested_filename == f"rackplane-usage-{last_month}.csv"
        rows = list(csv.DictReader(io.StringIO(open(got.value.path()).read())))
        assert [(r["day"][:7], r["sku"], r["gpu_hours"]) for r in rows] == [
            (last_month, "H100-80GB/whole", "1.0")
        ] * 2
        assert sum(int(r["amount"]) for r in rows) == 600 and {r["tenant_slug"] for r in rows} == {
            "acme"
        }
        page.get_by_test_id("export-status").filter(has_text="2 rows").wait_for()

    # A read-only session is told why it may not change anything, beside the form.
    reader = world.key(tenant, scopes=("read",), name="viewer")
    with portal_page(browser, api, "account-read-only") as page:
        sign_in(page, reader)
        page.get_by_role("navigation").get_by_role("link", name="Budget").click()
        page.get_by_label(re.compile("^Spend limit")).fill("5")
        page.get_by_role("button", name="Set budget").click()
        page.get_by_test_id("budget-problem").filter(has_text="insufficient_scope").wait_for()
        page.get_by_role("navigation").get_by_role("link", name="API keys").click()
        page.get_by_label("Name").fill("nope")
        page.get_by_role("button", name="Create key").click()
        page.get_by_test_id("key-problem").filter(has_text="insufficient_scope").wait_for()
    assert httpx.get(f"{api}/v1/budget", headers=auth(key)).status_code == 404


# --- the operators' fleet heatmap ---------------------------------------------------------------


def test_the_operator_heatmap_draws_100k_gpus(api, world, browser):  # noqa: F811
    from sqlalchemy import text

    from app.core.db import session_scope

    with session_scope() as s:
        seed_big_fleet(s)  # 100,000 GPUs: 700 NVL72 racks and 620 HGX racks of ten nodes
    with session_scope() as s:  # some of everything the map shows
        s.execute(
            text("UPDATE gpus SET health = 'quarantined' WHERE index = 3 AND random() < 0.02")
        )
        s.execute(text("UPDATE gpus SET health = 'suspect' WHERE index = 5 AND random() < 0.02"))
        s.execute(text("UPDATE gpus SET health = 'validating' WHERE index = 6 AND random() < 0.02"))
        s.execute(text("UPDATE nodes SET state = 'cordoned' WHERE name LIKE 'h000%'"))
        s.execute(text("UPDATE gpus SET mig_mode = true WHERE index = 0 AND random() < 0.05"))
        quarantined = s.execute(text("SELECT count(*) FROM gpus WHERE health = 'quarantined'"))
        quarantined = quarantined.scalar_one()
        validating = s.execute(text("SELECT count(*) FROM gpus WHERE health = 'validating'"))
        validating = validating.scalar_one()
        total = s.execute(text("SELECT count(*) FROM gpus")).scalar_one()
    assert total == 100_000 and quarantined > 0 and validating > 0
    with portal_page(browser, api, "fleet-100k") as page:
        sign_in(page, world.key())
        page.wait_for_url(re.compile(r"/portal/fleet$"))  # operators land on the fleet
        heatmap = page.get_by_test_id("heatmap")
        page.wait_for_selector("[data-testid=heatmap][data-render-ms]", timeout=30_000)
        render_ms = int(heatmap.get_attribute("data-render-ms"))
        # The page's own measure, request to the first frame with every GPU on it. Its bound
        # (2 s) is a benchmark's to show on a quiet machine (BENCHMARKS.md §9), not a pass/fail
        # line on a shared one; here it must draw them all, and in a time a person would wait.
        print(f"heatmap of {total} GPUs: request to first full frame {render_ms} ms")
        assert heatmap.get_attribute("data-gpus") == "100000"
        assert render_ms < 5_000, render_ms  # a tenfold regression fails here; 2 s: the bench
        summary = page.get_by_test_id("map-summary").inner_text()
        assert "100,000 GPUs" in summary and "1,320 racks" in summary
        legend = page.get_by_role("list", name="Legend")
        # Validating GPUs (repaired, on their way back) are told apart from quarantined ones.
        assert f"quarantined {quarantined:,}" in legend.inner_text()
        assert f"validating {validating:,}" in legend.inner_text()
        swatch = legend.locator("li", has_text="validating").locator(".swatch")
        quarantine_swatch = legend.locator("li", has_text="quarantined").locator(".swatch")
        colour = "e => getComputedStyle(e).backgroundColor"
        assert swatch.evaluate(colour) != quarantine_swatch.evaluate(colour)
        shot(page, "fleet")
        # Zoomed out, a rack tells its counts; a click zooms into it; then a GPU, and its node.
        canvas = page.locator("[data-testid=heatmap] canvas")
        tip = hover_until(page, canvas, lambda t: t.get_attribute("data-kind") == "rack")
        rack = tip.locator("strong").inner_text()
        counted = sum(int(n) for n in re.findall(r": (\d+)", tip.inner_text()))
        assert counted in (72, 80)  # an NVL72 rack, or ten 8-GPU nodes
        page.mouse.down()
        page.mouse.up()
        box = canvas.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        tip = page.get_by_test_id("map-tip")
        tip.wait_for()
        assert tip.get_attribute("data-kind") == "gpu"
        assert rack in tip.inner_text()  # the rack clicked is the one now under the pointer
        node = tip.locator("strong").inner_text()
        page.mouse.down()
        page.mouse.up()
        detail = page.get_by_test_id("node-detail")
        detail.wait_for()
        assert node in detail.inner_text()
        assert detail.locator("tbody tr").count() in (4, 8)  # an NVL72 tray or an HGX node
        shot(page, "fleet-zoomed")
        # The keyboard zooms and pans too (the canvas takes focus).
        heatmap = page.get_by_test_id("heatmap")
        zoomed = float(heatmap.get_attribute("data-zoom"))
        canvas.focus()
        page.keyboard.press("-")
        page.keyboard.press("-")
        wait_until(lambda: float(heatmap.get_attribute("data-zoom")) < zoomed / 2, timeout=5)


def hover_until(page, canvas, wanted, steps: int = 20):
    """Walk the pointer over the canvas until the tooltip shows something `wanted`."""
    box = canvas.bounding_box()
    tip = page.get_by_test_id("map-tip")
    for fy in range(1, steps):
        for fx in range(1, steps):
            page.mouse.move(
                box["x"] + box["width"] * fx / steps, box["y"] + box["height"] * fy / steps
            )
            page.wait_for_timeout(25)  # a frame for the page to show it
            if tip.count() and wanted(tip):
                return tip
    raise AssertionError("nothing wanted under the pointer")


def test_the_heatmap_shows_work_where_it_runs(api, world, browser):  # noqa: F811
    world.fleet(fleet(2))
    key = world.key(world.tenant("acme", policy=ALL))
    wid = httpx.post(
        f"{api}/v1/workloads", json={"kind": "instance", "gpus": 8}, headers=auth(key)
    ).json()["id"]
    wait_until(
        lambda: (
            httpx.get(f"{api}/v1/workloads/{wid}", headers=auth(key)).json()["state"] == "running"
        ),
        timeout=60,
    )
    with portal_page(browser, api, "fleet-small") as page:
        sign_in(page, world.key())
        page.wait_for_selector("[data-testid=heatmap][data-render-ms]")
        legend = page.get_by_role("list", name="Legend").inner_text()
        assert "dedicated 8" in legend and "idle 8" in legend
        canvas = page.locator("[data-testid=heatmap] canvas")
        hover_until(page, canvas, lambda t: "dedicated" in t.inner_text())
        page.mouse.down()
        page.mouse.up()
        detail = page.get_by_test_id("node-detail")
        detail.wait_for()
        assert wid[:8] in detail.inner_text() and "dedicated" in detail.inner_text()
        # Beside the map: the health sweep's record of why GPUs stood idle (h2's 8 GPUs:
        # nothing waits for them) and utilisation per model.
        page.get_by_test_id("util-chart").wait_for()

        def idle_counted() -> bool:
            page.reload()
            cell = page.locator("[data-testid=idle-totals] [data-cause=no_demand]")
            cell.wait_for()
            return float(cell.inner_text()) > 0

        wait_until(idle_counted, timeout=60, interval=3)
        assert page.get_by_test_id("idle-chart").get_attribute("data-points") != "0"
        shot(page, "fleet-small")


# --- the operators' pages: tenants, prices, a node's actions, chaos, health ----------------------


def _node(api: str, op: str, name: str) -> dict:
    """A node and its GPUs, as REST reads them."""
    [n] = httpx.get(f"{api}/v1/admin/nodes", params={"name": name}, headers=auth(op)).json()[
        "items"
    ]
    return httpx.get(f"{api}/v1/admin/nodes/{n['id']}", headers=auth(op)).json()


def _confirm(page, title: str, action: str, reason: str | None = None) -> None:
    """The confirmation `title` (it says what it will do), answered with `action`."""
    dialog = page.get_by_role("dialog", name=title)
    dialog.wait_for()
    assert dialog.get_by_role("button", name="Cancel").evaluate("e => e === document.activeElement")
    if reason is not None:
        dialog.get_by_label(re.compile("^Reason")).fill(reason)
    dialog.get_by_role("button", name=action, exact=True).click()
    dialog.wait_for(state="hidden")


def test_an_operator_runs_tenants_prices_nodes_chaos_and_health(api, world, browser):  # noqa: F811
    world.fleet(fleet(3))  # h1, h2, h3: 8 H100s each, nothing running
    op = world.key()
    newco = world.tenant("newco", status="pending")
    world.tenant("acme", policy=ALL)
    v1 = {
        "gpu_model": "H100-80GB",
        "shape": "whole",
        "plan": "on_demand",
        "currency": "usd",
        "unit_amount": 300,
        "effective_from": _month_start(1).isoformat(),
    }
    r = httpx.post(f"{api}/v1/admin/prices", json=v1, headers=auth(op))
    assert r.status_code == 201, r.text
    # A game day: Xid 64 (memory row remap failed: out of service) on GPU 6 of h2; the health
    # loop opens an incident and takes the GPU out.
    r = httpx.post(
        f"{api}/v1/admin/chaos/experiments",
        json={
            "name": "game day",
            "faults": [{"kind": "xid", "code": 64, "target": {"node": "h2", "gpu": 6}}],
            "blast_radius": {"max_gpus": 8, "max_region_share": 0.5},
        },
        headers=auth(op),
    )
    assert r.status_code == 201, r.text
    exp = r.json()["id"]

    def tenant() -> dict:
        return httpx.get(f"{api}/v1/admin/tenants/{newco.id}", headers=auth(op)).json()

    with portal_page(browser, api, "operator") as page:
        sign_in(page, op)
        page.wait_for_url(re.compile(r"/portal/fleet$"))
        nav = page.get_by_role("navigation", name="Main")

        # Tenants: the pending one, by the status filter; approved from its page.
        nav.get_by_role("link", name="Tenants").click()
        page.get_by_test_id("tenants").locator("tr[data-slug=acme]").wait_for()
        page.get_by_label("Status").select_option("pending")
        page.get_by_test_id("tenants").locator("tr[data-slug=acme]").wait_for(state="detached")
        shot(page, "operator-tenants")
        page.get_by_test_id("tenants").get_by_role("link", name="Newco").click()
        page.wait_for_url(re.compile(f"/portal/tenants/{newco.id}$"))
        status = page.get_by_test_id("tenant-status")
        status.get_by_role("button", name="Approve").click()
        assert "submit workloads" in page.get_by_role("dialog", name="Approve Newco?").inner_text()
        _confirm(page, "Approve Newco?", "Approve")
        page.get_by_test_id("status-outcome").filter(has_text="approved").wait_for()
        assert tenant()["status"] == "active"
        # Suspend: cancelled once, nothing changes; then confirmed, and reactivated.
        status.get_by_role("button", name="Suspend").click()
        dialog = page.get_by_role("dialog", name="Suspend Newco?")
        dialog.get_by_role("button", name="Cancel").click()
        dialog.wait_for(state="hidden")
        page.wait_for_timeout(500)  # time enough for a suspension to land, had one been sent
        assert tenant()["status"] == "active" and status.get_attribute("data-status") == "active"
        status.get_by_role("button", name="Suspend").click()
        _confirm(page, "Suspend Newco?", "Suspend")
        page.locator("[data-testid=tenant-status][data-status=suspended]").wait_for()
        assert tenant()["status"] == "suspended"
        status.get_by_role("button", name="Reactivate").click()
        _confirm(page, "Reactivate Newco?", "Reactivate")
        page.locator("[data-testid=tenant-status][data-status=active]").wait_for()
        assert tenant()["status"] == "active"
        # Its isolation policy: no time-slicing, confidential VMs allowed.
        page.get_by_label(re.compile("^shared-timeslice:")).uncheck()
        page.get_by_label(re.compile("^confidential-vm:")).check()
        page.get_by_role("button", name="Save isolation policy").click()
        dialog = page.get_by_role("dialog", name="Change Newco's isolation policy?")
        assert "No longer allowed: shared-timeslice" in dialog.inner_text()
        _confirm(page, "Change Newco's isolation policy?", "Save policy")
        page.get_by_test_id("policy-saved").filter(has_text="saved").wait_for()
        assert set(tenant()["isolation_policy"]) == {
            "shared-fractional",
            "shared-mig",
            "dedicated-gpu",
            "vm",
            "confidential-vm",
        }
        # Its quotas: a limit under the guarantee is refused next to its row; then saved.
        page.get_by_label("Add a quota for").select_option("H100-80GB")
        page.get_by_role("button", name="Add row").click()
        page.get_by_label("Guaranteed GPUs for H100-80GB").fill("2")
        page.get_by_label("Limit in GPUs for H100-80GB").fill("1")
        page.get_by_role("button", name="Save quotas").click()
        _confirm(page, "Replace Newco's quotas?", "Save quotas")
        page.get_by_test_id("q-0-error").filter(has_text="at least guaranteed").wait_for()
        page.get_by_label("Limit in GPUs for H100-80GB").fill("8.5")
        page.get_by_role("button", name="Save quotas").click()
        _confirm(page, "Replace Newco's quotas?", "Save quotas")
        page.get_by_test_id("quotas-saved").filter(has_text="H100-80GB").wait_for()
        assert page.get_by_test_id("q-0-error").inner_text() == ""
        quotas = httpx.get(f"{api}/v1/admin/tenants/{newco.id}/quotas", headers=auth(op)).json()
        assert [
            (q["gpu_model"], q["guaranteed_milli"], q["limit_milli"]) for q in quotas["items"]
        ] == [("H100-80GB", 2000, 8500)]
        shot(page, "operator-tenant")

        # Prices: a new version of the H100 price, typed in dollars, sent in cents exactly.
        nav.get_by_role("link", name="Prices").click()
        book = page.get_by_test_id("prices")
        book.locator("tr[data-version='1'][data-status='in effect']").wait_for()
        book.get_by_role(
            "button", name="New version of H100-80GB whole on_demand (tier *, region *)"
        ).click()
        amount = page.get_by_label(re.compile("^Price per GPU-hour"))
        assert amount.input_value() == "3.00"
        amount.fill("3.255")  # a tenth of a cent: refused before anything is sent
        page.get_by_label(re.compile("^Effective from")).fill("2030-01-01T00:00")
        page.get_by_role("button", name="Add price version").click()
        page.get_by_test_id("p-amount-error").filter(has_text="such as 3.25").wait_for()
        amount.fill("3.25")
        page.get_by_role("button", name="Add price version").click()
        dialog = page.get_by_role("dialog", name="Add a price version?")
        assert "$3.25 per GPU-hour (325 minor units)" in dialog.inner_text()
        assert "version 2" in dialog.inner_text()
        _confirm(page, "Add a price version?", "Add version")
        page.get_by_test_id("price-added").filter(has_text="Added version 2").wait_for()
        book.locator("tr[data-version='2'][data-status=scheduled]").wait_for()
        sent = page.evaluate("new Date('2030-01-01T00:00').toISOString()")
        prices = httpx.get(f"{api}/v1/admin/prices", headers=auth(op)).json()["items"]
        [v2] = [p for p in prices if p["version"] == 2]
        assert (v2["unit_amount"], v2["currency"], v2["gpu_model"], v2["plan"]) == (
            325,
            "usd",
            "H100-80GB",
            "on_demand",
        )
        assert datetime.fromisoformat(v2["effective_from"]) == datetime.fromisoformat(
            sent.replace("Z", "+00:00")
        )
        shot(page, "operator-prices")

        # A node's detail: quarantine then release a GPU, cordon then ready the node.
        nav.get_by_role("link", name="Fleet").click()
        page.wait_for_selector("[data-testid=heatmap][data-render-ms]")

        def open_node(name: str):
            page.get_by_label("Node name").fill(name)
            page.get_by_role("button", name="Open node").click()
            detail = page.locator(f"[data-testid=node-detail][data-node={name}]")
            detail.wait_for()
            return detail

        detail = open_node("h1")
        # Opened by name (the keyboard's way in), its detail has the focus.
        wait_until(lambda: page.evaluate("document.activeElement.id") == "node-detail-h", timeout=5)
        detail.get_by_role("button", name="Quarantine GPU 2").click()
        _confirm(page, "Quarantine GPU 2 of h1?", "Quarantine", reason="fan noise")
        detail.locator("tr[data-gpu='2'][data-health=quarantined]").wait_for()
        page.get_by_test_id("node-outcome").filter(has_text="GPU 2 of h1 is quarantined").wait_for()
        gpu2 = _node(api, op, "h1")["gpus"][2]
        assert gpu2["health"] == "quarantined" and "fan noise" in gpu2["health_reason"]
        detail.get_by_role("button", name="Release GPU 2").click()
        _confirm(page, "Release GPU 2 of h1?", "Release", reason="fan replaced")
        detail.locator("tr[data-gpu='2'][data-health=healthy]").wait_for()
        assert _node(api, op, "h1")["gpus"][2]["health"] == "healthy"
        detail.get_by_role("button", name="Cordon").click()
        _confirm(page, "Cordon h1?", "Cordon", reason="firmware update")
        page.locator("[data-testid=node-detail][data-state=cordoned]").wait_for()
        h1 = _node(api, op, "h1")
        assert (h1["state"], h1["state_reason"]) == ("cordoned", "firmware update")
        shot(page, "operator-node")
        detail.get_by_role("button", name="Ready").click()
        _confirm(page, "Ready h1?", "Ready")
        page.locator("[data-testid=node-detail][data-state=ready]").wait_for()
        assert _node(api, op, "h1")["state"] == "ready"
        # Drain h2; mark h3 (nothing on it) down.
        detail = open_node("h2")
        detail.get_by_role("button", name="Drain").click()
        _confirm(page, "Drain h2?", "Drain")
        page.locator("[data-testid=node-detail][data-state=draining]").wait_for()
        assert _node(api, op, "h2")["state"] == "draining"
        detail = open_node("h3")
        detail.get_by_role("button", name="Mark down").click()
        assert (
            "Nothing runs on it now"
            in page.get_by_role("dialog", name="Mark down h3?").inner_text()
        )
        shot(page, "operator-node-confirm")
        _confirm(page, "Mark down h3?", "Mark down", reason="PSU failed")
        page.locator("[data-testid=node-detail][data-state=down]").wait_for()
        assert _node(api, op, "h3")["state"] == "down"
        page.get_by_label("Node name").fill("h9")
        page.get_by_role("button", name="Open node").click()
        page.locator("#node-name-error").filter(has_text="No node named h9").wait_for()

        # Chaos: the experiment, by state; its report once the loop acted; stopped.
        def experiment() -> dict:
            return httpx.get(f"{api}/v1/admin/chaos/experiments/{exp}", headers=auth(op)).json()

        wait_until(lambda: experiment()["report"][0]["quarantine_s"] is not None, timeout=30)
        nav.get_by_role("link", name="Chaos").click()
        page.get_by_label("State").select_option("running")
        listed = page.get_by_test_id("experiments").locator(f"tr[data-id='{exp}']")
        assert listed.get_attribute("data-state") == "running"
        page.get_by_label("State").select_option("stopped")
        page.get_by_test_id("no-experiments").wait_for()
        page.get_by_label("State").select_option("running")
        listed.get_by_role("link", name="game day").click()
        page.wait_for_url(re.compile(f"/portal/chaos/{exp}$"))
        report = page.get_by_test_id("report")
        assert "h2 GPU 6" in report.inner_text() and "service" in report.inner_text()
        assert page.get_by_test_id("held").inner_text() == "all held"
        assert page.get_by_test_id("injections").locator("tr[data-undone=no]").count() == 1
        page.get_by_role("button", name="Stop", exact=True).click()
        _confirm(page, "Stop game day?", "Stop experiment")
        page.locator("[data-testid=experiment][data-state=stopped]").wait_for()
        page.get_by_test_id("chaos-outcome").filter(has_text="1 of 1 injections undone").wait_for()
        assert experiment()["state"] == "stopped"
        shot(page, "operator-chaos")

        # Health: the incident, and the GPU it took out, released from there.
        nav.get_by_role("link", name="Health").click()
        incident = page.locator("[data-testid^=incidents-] tr[data-node=h2]")
        incident.first.wait_for()
        assert "Xid 64" in incident.first.inner_text()
        out = page.get_by_test_id("out").locator("tr[data-node=h2][data-gpu='6']")
        assert out.get_attribute("data-health") == "out_of_service"
        out.get_by_role("button", name="Release GPU 6 of h2").click()
        assert (
            "through validation"
            in page.get_by_role("dialog", name="Release GPU 6 of h2?").inner_text()
        )
        _confirm(page, "Release GPU 6 of h2?", "Release", reason="row remap cleared after RMA")
        page.get_by_test_id("health-outcome").filter(has_text="Released GPU 6 of h2").wait_for()
        assert _node(api, op, "h2")["gpus"][6]["health"] in ("validating", "healthy")
        shot(page, "operator-health")

    # Each change is in the audit log once, by the operator's key (the cancelled suspension is
    # not; the refused quotas are, as refused).
    entries = httpx.get(f"{api}/v1/admin/audit", params={"limit": 500}, headers=auth(op)).json()
    entries = [e for e in entries["items"] if e["action"].startswith("POST /graphql:")]
    assert {(e["principal"], e["key_prefix"]) for e in entries} == {("operator", op[3:11])}
    done = Counter(e["action"].split(":", 1)[1] for e in entries if e["status"] == 200)
    assert done == {
        "approveTenant": 1,
        "suspendTenant": 1,
        "reactivateTenant": 1,
        "updateTenant": 1,
        "setTenantQuotas": 1,
        "createPrice": 1,
        "setGpuHealth": 3,  # quarantine, release, and the release from the health page
        "setNodeState": 4,  # cordon, ready, drain, down
        "stopChaosExperiment": 1,
    }, done
    refused = [e["action"] for e in entries if e["status"] != 200]
    assert refused == ["POST /graphql:setTenantQuotas"], refused


def _join_agent(api: str, op: str, name: str, gpus: int = 8) -> str:
    """A node agent's credential, and its first inventory (the agent is this test)."""
    nodes = httpx.get(f"{api}/v1/admin/nodes", params={"name": name}, headers=auth(op)).json()
    nid = nodes["items"][0]["id"]
    token = httpx.post(f"{api}/v1/admin/nodes/{nid}/join-tokens", headers=auth(op)).json()
    cred = httpx.post(f"{api}/v1/agent/join", json={"token": token["token"]}).json()["credential"]
    inventory = {
        "hostname": name,
        "address": f"{name}.test",
        "source": "file",
        "gpus": [
            {"index": i, "uuid": f"GPU-{name}-{i}", "model": "H100-80GB", "memory_mib": 81559}
            for i in range(gpus)
        ],
        "runtimes": ["process"],
        "agent_version": "test",
    }
    r = httpx.put(f"{api}/v1/agent/inventory", json=inventory, headers=auth(cred))
    assert r.status_code == 200, r.text
    return cred


def test_an_operator_follows_bring_up_and_rolls_back_an_upgrade(api, world, browser):  # noqa: F811
    world.fleet(fleet(2))  # h1, h2
    op = world.key()
    creds = {n: _join_agent(api, op, n) for n in ("h1", "h2")}
    # h1 passes its bring-up burn-in; h2's agent has not reported a step of its own yet.
    burn = httpx.get(
        f"{api}/v1/agent/assignments", params={"wait": "0s"}, headers=auth(creds["h1"])
    ).json()["burn_in"]
    results = [{"name": s["name"], "status": "passed", "seconds": 1} for s in burn["steps"]]
    r = httpx.post(
        f"{api}/v1/agent/status",
        json={"burn_in": {"id": burn["id"], "results": results, "done": True}},
        headers=auth(creds["h1"]),
    )
    assert r.status_code == 200, r.text
    for name, driver in (("h100-a", "550.54.15"), ("h100-b", "560.35.03")):
        r = httpx.post(
            f"{api}/v1/admin/stacks",
            json={"name": name, "components": {"driver": driver, "cuda": "12.6"}},
            headers=auth(op),
        )
        assert r.status_code == 201, r.text
    region = httpx.get(f"{api}/v1/admin/regions", headers=auth(op)).json()["items"][0]["name"]
    httpx.post(
        f"{api}/v1/admin/stacks/h100-a/assignments", json={"region": region}, headers=auth(op)
    )
    # The agents report no versions: nothing to install, each node only burned in again.
    r = httpx.post(
        f"{api}/v1/admin/upgrades",
        json={"stack": "h100-b", "region": region, "batch": "1", "max_unavailable_pct": 50},
        headers=auth(op),
    )
    assert r.status_code == 202, r.text
    uid = r.json()["id"]

    with portal_page(browser, api, "operator-lifecycle") as page:
        sign_in(page, op)
        page.wait_for_url(re.compile(r"/portal/fleet$"))
        page.get_by_role("navigation", name="Main").get_by_role("link", name="Lifecycle").click()
        table = page.get_by_test_id("bring-up")
        h2 = table.locator("tr[data-node=h2]")
        h2.wait_for()
        # h2, still validating, was already out: the upgrade took it first (it costs nothing of
        # the budget), and its upgrade burn-in replaced the bring-up one.
        assert "upgrade" in h2.inner_text() and "0/2: dcgm-diag" in h2.inner_text()
        assert h2.get_attribute("data-stuck") == "no"
        row = page.get_by_test_id("upgrades").locator(f"tr[data-id='{uid}']")
        assert row.get_attribute("data-state") == "running"
        assert "2" in row.inner_text()
        row.get_by_role("button", name="h100-b").click()
        detail = page.get_by_test_id("upgrade")
        detail.locator("tr[data-node=h1]").wait_for()
        assert detail.get_by_test_id("upgrade-nodes").locator("tr").count() == 3  # head + 2
        shot(page, "operator-lifecycle")
        detail.get_by_role("button", name="Roll back").click()
        _confirm(page, "Roll back the upgrade to h100-b?", "Roll back")
        page.get_by_test_id("upgrade-outcome").filter(has_text="Upgrade to h100-b").wait_for()
        page.locator(
            "[data-testid=upgrade][data-state=rolling_back], "
            "[data-testid=upgrade][data-state=rolled_back]"
        ).wait_for()
    up = httpx.get(f"{api}/v1/admin/upgrades/{uid}", headers=auth(op)).json()
    assert up["state"] in ("rolling_back", "rolled_back"), up
