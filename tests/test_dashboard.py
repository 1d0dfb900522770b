"""The dashboard in a real browser: Debian's Chromium driven by Playwright against the real
server. Needs `apt-get install chromium` (/usr/bin/chromium); without it this test fails."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from playwright.sync_api import BrowserContext, expect, sync_playwright

from tests.conftest import start_server, stop_server
from tests.gateway_helpers import chat_body

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


@contextmanager
def chromium(tmp_path: Path) -> Iterator[BrowserContext]:
    """Headless Chromium with a fresh profile."""
    assert CHROMIUM.exists(), "Chromium is missing: apt-get install -y chromium"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1100},
        )
        try:
            yield browser
        finally:
            browser.close()


def test_dashboard_shows_live_metrics_and_drives_the_load_generator(server, tmp_path) -> None:
    page_errors: list[str] = []
    with chromium(tmp_path) as browser:
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
            # The embedded model's groups share one page pool: a row per group and the free
            # pages, in pages.
            expect(page.locator("#kv-groups .kv-group")).to_have_count(3)
            expect(page.locator('[data-group="free"] .num')).to_have_text(re.compile(r"\d pages"))
            expect(page.locator("#kv-summary")).to_have_text(
                re.compile(r"pages \S 16 tokens \S pages a block: full 1, sliding 5")
            )

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
            httpx.post(server.base_url + "/api/loadgen/stop", json={}, timeout=30)
    assert page_errors == []
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


XSS_TENANT = "<img src=x onerror=window.__xss=1>"
XSS_PROMPT = "<script>window.__xss=2</script><img src=x onerror=window.__xss=3> Hello"


def test_tenant_names_and_prompts_render_as_text(server, tmp_path) -> None:
    body = chat_body(XSS_PROMPT, max_tokens=2, user=XSS_TENANT)
    assert httpx.post(server.v1 + "/chat/completions", json=body, timeout=300).status_code == 200
    with chromium(tmp_path) as browser:
        page = browser.new_page()
        page.goto(server.base_url + "/")
        page.wait_for_function(
            "name => [...document.querySelectorAll('#tenants .tenant')]"
            ".some(row => row.dataset.tenant === name)",
            arg=XSS_TENANT,
            timeout=15_000,
        )
        page.wait_for_timeout(2_500)  # a few more polls: an injected <img> would have fired
        assert page.evaluate("window.__xss") is None
        assert page.locator("#tenants img, #tenants script").count() == 0
        names = page.locator("#tenants .tenant .who b").all_text_contents()
        assert XSS_TENANT in names  # shown literally


DASHBOARD_KEY = "sk-dashboard-6a1e93c04b7d25f8"


def test_with_ops_auth_the_page_asks_for_the_key_once(tmp_path) -> None:
    keyed = start_server(tmp_path, API_KEYS=f"alice:{DASHBOARD_KEY}", OPS_AUTH="keys")
    try:
        with chromium(tmp_path) as browser:
            page = browser.new_page()
            page.goto(keyed.base_url + "/")
            expect(page.locator("#live")).to_have_text("API key needed", timeout=10_000)
            expect(page.locator("#key-form")).to_be_visible()

            page.fill("#api-key", "sk-wrong")
            page.click("#key-form button")
            expect(page.locator("#key-message")).to_have_text("Incorrect API key provided.")

            page.fill("#api-key", DASHBOARD_KEY)
            page.click("#key-form button")
            expect(page.locator("#live")).to_have_text("live", timeout=10_000)
            expect(page.locator("#key-form")).to_be_hidden()
            expect(page.locator("#model")).to_have_text("gemma-3-270m")
            # Kept for this tab, sent as a header: a reload needs no new key, and no URL has it.
            page.reload()
            expect(page.locator("#live")).to_have_text("live", timeout=10_000)
            assert DASHBOARD_KEY not in page.url
        assert DASHBOARD_KEY not in keyed.log()
    finally:
        stop_server(keyed)
