"""`rackplane bench portal`: the fleet heatmap of a 100,000-GPU fleet in headless Chromium
against a real API process on a scratch PostgreSQL database. Reports the page's own measures:
request to the first frame with every GPU drawn (`render_ms`, target < 2000 ms), and the time
to draw one frame while zooming and panning (`frame_ms`, smooth: < 16 ms for 60 frames/s).
Then the fleet page's utilisation chart's query over the same fleet, answered by the API
(`utilisation_ms`: the last day by hour, request to answer, target < 300 ms)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from rackplane_bench.deploy import ROOT, ScratchDeployment, pct

CHROMIUM = "/usr/bin/chromium"  # Debian's (scripts/ensure-chromium.sh), never a downloaded one
# As the machine's probe runs it: no sandbox as root, and nothing that reaches for the network.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]

# Seeds the scratch database in a child process: the fleet, some of every state, an operator.
_SEED = r"""
import json
from sqlalchemy import text
import app.models
from app.core.db import session_scope
from app.keys.service import create_key
from rackplane_bench.seed import seed_big_fleet
with session_scope() as s:
    seed_big_fleet(s)
    s.execute(text("UPDATE gpus SET health = 'quarantined' WHERE index = 3 AND random() < 0.02"))
    s.execute(text("UPDATE gpus SET health = 'suspect' WHERE index = 5 AND random() < 0.02"))
    s.execute(text("UPDATE gpus SET mig_mode = true WHERE index = 0 AND random() < 0.05"))
    s.execute(text("UPDATE nodes SET state = 'cordoned' WHERE random() < 0.01"))
    gpus = s.execute(text("SELECT count(*) FROM gpus")).scalar_one()
    print(json.dumps({"operator": create_key(s, tenant_id=None, name="bench",
                                             scopes=["platform"]).key, "gpus": gpus}))
"""

# Waits two frames (the zoom behaviour draws in the next one), then reads the last frame's time.
_FRAME = """() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() =>
  r(parseFloat(document.querySelector('[data-testid=heatmap]').dataset.frameMs)))))"""


def run(runs: int = 7, frames: int = 60) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    dep = ScratchDeployment(workers=0)
    try:
        seeded = subprocess.run(
            [sys.executable, "-c", _SEED], cwd=ROOT, env=dep.env, capture_output=True, text=True
        )
        if seeded.returncode:
            raise RuntimeError(seeded.stderr[-2000:])
        out = json.loads(seeded.stdout.strip().splitlines()[-1])
        import sqlalchemy as sa

        engine = sa.create_engine(dep.env["DATABASE_URL"], isolation_level="AUTOCOMMIT")
        with engine.connect() as c:
            c.execute(sa.text("VACUUM ANALYZE"))
        engine.dispose()
        url = dep.start(api_processes=1)
        renders: list[float] = []
        frame_ms: list[float] = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
            page = browser.new_page(base_url=url, viewport={"width": 1400, "height": 1000})
            page.goto("/portal/")
            page.get_by_label("API key").fill(out["operator"])
            page.get_by_role("button", name="Sign in").click()
            for i in range(runs + 1):  # the first is a warm-up (the API's first query)
                if i:
                    page.reload()
                page.wait_for_selector("[data-testid=heatmap][data-render-ms]", timeout=60_000)
                ms = float(page.get_attribute("[data-testid=heatmap]", "data-render-ms") or "nan")
                if i:
                    renders.append(ms)
                # The page's other charts load after the map: let them finish, so the next
                # load does not share the API with them.
                page.wait_for_selector("[data-testid=util-chart]", timeout=60_000)
            canvas = page.locator("[data-testid=heatmap] canvas")
            canvas.focus()
            # Zoom in step by step (aggregated racks, then every GPU, then letters), panning.
            keys = ["+", "ArrowRight", "ArrowDown", "+", "ArrowLeft", "+", "ArrowUp", "-"]
            for i in range(frames):
                page.keyboard.press(keys[i % len(keys)] if i < frames // 2 else "-+"[i % 2])
                frame_ms.append(page.evaluate(_FRAME))
            browser.close()
        util_ms = _utilisation(url, out["operator"], runs)
        render_median = round(statistics.median(renders))
        frame_p95 = round(pct(frame_ms, 0.95), 2)
        render = {
            "median": render_median,
            "p95": round(pct(renders, 0.95)),
            "all": [round(x) for x in renders],
        }
        frame = {
            "median": round(statistics.median(frame_ms), 2),
            "p95": frame_p95,
            "max": round(max(frame_ms), 2),
        }
        return {
            "gpus": out["gpus"],
            "runs": runs,
            "render_ms": render,
            "frame_ms": frame,
            "utilisation_ms": {
                "median": round(statistics.median(util_ms)),
                "p95": round(pct(util_ms, 0.95)),
                "all": [round(x) for x in util_ms],
            },
            "targets": {
                "render_under_2s": render_median < 2000,
                "frames_under_16ms": frame_p95 < 16,
                "utilisation_under_300ms": statistics.median(util_ms) < 300,
            },
        }
    finally:
        dep.close()


_UTILISATION = """query($from: DateTime!, $to: DateTime!) { utilisation(from: $from, to: $to,
  granularity: HOUR) { rows { start gpuModel utilisationPct } capacityGpuHours } }"""


def _utilisation(url: str, operator: str, runs: int) -> list[float]:
    """The utilisation chart's query, timed from request to answer (after one warm-up)."""
    # The page's window: the last 24 hours up to the end of this one (Fleet.tsx), so the fleet
    # the seed registered this hour is in it (a window ending at this hour's start had none).
    to = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    window = {"from": (to - timedelta(days=1)).isoformat(), "to": to.isoformat()}
    times: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(runs + 1):
            t = time.perf_counter()
            r = client.post(
                "/graphql",
                json={"query": _UTILISATION, "variables": window},
                headers={"Authorization": f"Bearer {operator}"},
            )
            elapsed = (time.perf_counter() - t) * 1000
            body = r.json()
            if r.status_code != 200 or body.get("errors"):
                raise RuntimeError(f"utilisation failed: {r.status_code} {r.text[:500]}")
            if i:
                times.append(elapsed)
    return times
