"""The portal in a real browser (headless Debian chromium via Playwright) against a real API
process on PostgreSQL and a real Celery worker: sign in, submit a gang and watch it reach
running without a reload, find it on the dashboard with its usage on the chart, terminate it,
sign out and be refused."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.conftest import auth, wait_until
from tests.portal_browser import browser, portal_page, shot  # noqa: F401  (fixture)
from tests.test_placement_worker import ALL, fleet

pytestmark = pytest.mark.usefixtures("celery_worker_process")


def sign_in(page, key: str) -> None:
    page.goto("/portal/")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("button", name="Sign out").wait_for()
    # The page forgot the key: it is in no field, and the cookie holding the session is
    # HttpOnly (not readable by the page's scripts).
    assert key not in page.content()
    assert "rp_session" not in page.evaluate("document.cookie")


def test_a_tenant_signs_in_runs_a_gang_watches_it_live_and_signs_out(api, world, browser):  # noqa: F811
    world.fleet(fleet(2))
    tenant = world.tenant("acme", policy=ALL)
    key = world.key(tenant)
    refused = "the server responded with a status of 401"  # the browser's line for the 401
    with portal_page(browser, api, "sign-in", expected=(refused,)) as page:
        page.goto("/portal/")
        page.get_by_label("API key").fill("rp_" + "x" * 48)
        page.get_by_role("button", name="Sign in").click()
        page.get_by_role("alert").filter(has_text="invalid_api_key").wait_for()

    with portal_page(browser, api, "workload") as page:
        sign_in(page, key)
        page.get_by_role("heading", name=re.compile("Acme")).wait_for()
        page.get_by_role("navigation").get_by_role("link", name="Submit").click()
        # A gang of two 8-GPU replicas; the preview says where it would land first.
        page.get_by_label("Name").fill("train-llm")
        page.get_by_label("Kind").select_option("job")
        page.get_by_label("GPUs per replica").fill("8")
        page.get_by_label("Replicas", exact=True).fill("2")
        page.get_by_label("Keep the replicas within").select_option("rack")
        page.get_by_label("GPU model", exact=True).select_option("H100-80GB")
        page.get_by_role("button", name="Preview (dry run)").click()
        preview = page.get_by_test_id("dry-run")
        preview.wait_for()
        assert "It would start now" in preview.inner_text()
        assert preview.locator("tbody tr").count() == 2
        shot(page, "submit")
        # The API's own validation message, shown as it gives it.
        page.get_by_label("Replicas", exact=True).fill("5000")
        page.get_by_role("button", name="Submit", exact=True).click()
        problem = page.locator("#form-problem")
        problem.filter(has_text="validation_error").wait_for()
        assert "replicas" in problem.inner_text()
        page.get_by_label("Replicas", exact=True).fill("2")
        page.evaluate("window.__sameDocument = true")  # gone if the page reloads
        page.get_by_role("button", name="Submit", exact=True).click()
        page.wait_for_url(re.compile(r"/portal/workloads/[0-9a-f-]{36}$"))
        wid = page.url.rsplit("/", 1)[1]
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

        # The dashboard lists it and its usage reaches the chart.
        page.get_by_role("navigation").get_by_role("link", name="Dashboard").click()
        row = page.get_by_test_id("workloads").locator("tr", has_text="train-llm")
        row.wait_for()
        assert "running" in row.inner_text() and "2 × (8× GPU" in row.inner_text()

        def charted() -> bool:
            page.get_by_label("Daily, last 30 days").check()
            page.get_by_label("Hourly, last 24 h").check()
            return page.get_by_test_id("usage-chart").count() == 1

        wait_until(charted, timeout=60, interval=2)
        assert float(page.get_by_test_id("usage-total").inner_text()) > 0
        assert int(page.get_by_test_id("usage-chart").get_attribute("data-points")) >= 1
        shot(page, "dashboard")

        # Terminate it from its page.
        page.get_by_role("link", name="train-llm").click()
        page.get_by_role("button", name="Terminate").click()
        timeline.locator("li[data-state=terminated]").wait_for(timeout=30_000)
        wait_until(lambda: state.inner_text() == "terminated", timeout=20)
        assert page.evaluate("window.__sameDocument") is True
        r = httpx.get(f"{api}/v1/workloads/{wid}", headers=auth(key))
        assert r.json()["state"] == "terminated"

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
