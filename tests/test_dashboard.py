"""The dashboard in a real browser: Debian's Chromium driven by Playwright against the real
server. Needs `apt-get install chromium` (/usr/bin/chromium); without it this test fails."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from playwright.sync_api import expect, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
TENANTS = ("loadgen-0", "loadgen-1")
NUMBER = re.compile(r"\d")


def _bar_width(page, tenant: str, kind: str) -> float:
    return page.locator(f'[data-tenant="{tenant}"] .{kind}').evaluate(
        "el => el.getBoundingClientRect().width"
    )


def test_dashboard_shows_live_metrics_and_drives_the_load_generator(server, tmp_path) -> None:
    assert CHROMIUM.exists(), "Chromium is missing: apt-get install -y chromium"
    page_errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh profile
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1100},
        )
        try:
            page = browser.new_page()
            page.on("pageerror", lambda exc: page_errors.append(str(exc)))
            page.goto(server.base_url + "/")

            # The panels fill with numbers from /api/metrics.
            expect(page.locator("#live")).to_have_text("live", timeout=10_000)
            expect(page.locator("#model")).to_have_text("gemma-3-270m")
            for panel in (
                "running", "waiting", "throughput", "finished", "kv-usage", "prefix-hit-rate",
                "ttft-p50", "ttft-p99", "tpot-p95", "e2e-p50", "prefix-tokens",
            ):  # fmt: skip
                expect(page.locator(f"#{panel}")).to_have_text(NUMBER)
            expect(page.locator("#kv-groups .kv-group")).not_to_have_count(0)

            # Drive a run from the form.
            page.fill("#lg-users", "2")
            page.fill("#lg-tenants", "2")
            page.fill("#lg-prompt-words", "8")
            page.fill("#lg-max-tokens", "4")
            page.select_option("#lg-stop-kind", "duration_s")
            page.fill("#lg-stop-value", "120")
            page.check("#lg-shared")
            page.click("#lg-start")
            expect(page.locator("#lg-state")).to_have_text("running")

            page.wait_for_function(
                "Number(document.getElementById('lg-completed').textContent) >= 4",
                timeout=45_000,
            )
            for tenant in TENANTS:
                expect(page.locator(f'[data-tenant="{tenant}"]')).to_be_visible()
                assert _bar_width(page, tenant, "tokens") > 0
                assert _bar_width(page, tenant, "service") > 0  # weighted tokens
                assert _bar_width(page, tenant, "counter") > 0  # the default policy is vtc
                expect(page.locator(f'[data-tenant="{tenant}"] .ttft-p95')).to_have_text(
                    re.compile(r"TTFT p95 \d")
                )
            # The fairness numbers come from /api/metrics: the page shows the current gap.
            fairness = httpx.get(server.base_url + "/api/metrics", timeout=10).json()["fairness"]
            for tenant in TENANTS:
                assert fairness["tenants"][tenant]["service"] > 0
                assert fairness["tenants"][tenant]["ttft_s"]["count"] > 0
            expect(page.locator("#service-gap")).to_have_text(NUMBER)
            expect(page.locator("#service-gap-max")).to_have_text(NUMBER)
            expect(page.locator("#prefix-hit-rate")).not_to_have_text("0.0 %")  # shared prompt
            # Where step time goes: one bar per phase, the forward pass always above zero.
            expect(page.locator("#step-phases .step-phase")).to_have_count(6)
            expect(page.locator('[data-phase="forward"] .num')).not_to_have_text("0.00 ms · 0.0 %")
            expect(page.locator("#lg-ttft")).not_to_have_text("0 ms / 0 ms")
            assert page.locator("#lg-failed").text_content() == "0"

            page.click("#lg-stop")
            expect(page.locator("#lg-state")).to_have_text("stopped")
            expect(page.locator("#lg-inflight")).to_have_text("0")
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            print("screenshot:", tmp_path / "dashboard.png")
        finally:
            browser.close()
            httpx.post(server.base_url + "/api/loadgen/stop", timeout=30)
    assert page_errors == []
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
