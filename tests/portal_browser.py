"""Headless Chromium for the portal's tests: Debian's /usr/bin/chromium (scripts/ensure-chromium.sh
installs it; never a downloaded browser) driven by Playwright. Every page a test opens fails the
test on a console error or an uncaught exception, and leaves a screenshot in artifacts/portal."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rackplane_bench.portal import CHROMIUM as BENCH_CHROMIUM
from rackplane_bench.portal import FLAGS
from tests.conftest import ROOT

CHROMIUM = os.environ.get("RACKPLANE_CHROMIUM", BENCH_CHROMIUM)
ARTIFACTS = Path(os.environ.get("RACKPLANE_TEST_ARTIFACTS", ROOT / "artifacts")) / "portal"


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (scripts/ensure-chromium.sh)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


class Console:
    """What the page said that it should not have."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def attach(self, page) -> None:
        page.on(
            "console",
            lambda m: (
                self.errors.append(f"console.{m.type}: {m.text}")
                if m.type in ("error", "assert")
                else None
            ),
        )
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))


@contextmanager
def portal_page(
    browser, base: str, name: str, viewport=(1400, 1000), expected: tuple[str, ...] = ()
) -> Iterator:
    """A fresh browser context (no cookies) and page; on exit its screenshot is saved and any
    console error fails the test, but for those the test provokes on purpose (`expected`:
    substrings, each to be seen exactly once, such as the browser's own line for a refused
    request)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(
        base_url=base, viewport={"width": viewport[0], "height": viewport[1]}
    )
    page = context.new_page()
    page.set_default_timeout(20_000)
    console = Console()
    console.attach(page)
    page.console = console  # type: ignore[attr-defined]
    try:
        yield page
    finally:
        try:
            page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
        finally:
            context.close()
    left = list(console.errors)
    for text in expected:
        hits = [e for e in left if text in e]
        assert len(hits) == 1, (text, console.errors)
        left.remove(hits[0])
    assert not left, left


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
