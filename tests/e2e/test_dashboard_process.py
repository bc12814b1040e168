"""The KV pool dashboard in a real browser (Debian's headless Chromium, driven by selenium), over a real
stack of two workers on the tiny model, during traffic; its screenshot is kept under out/."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.api_cluster import cluster_fixture, get, poll
from tests.support.cluster import MODEL_NAME, Cluster

SCREENSHOT = Path(__file__).resolve().parents[2] / "out" / "dashboard.png"

cluster = cluster_fixture("tiny_model_path", workers=("w1", "w2"))


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("Debian's chromium and chromium-driver are not installed (make test installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1400"):
        options.add_argument(arg)
    browser = webdriver.Chrome(options=options, service=Service(driver))
    try:
        yield browser
    finally:
        browser.quit()


def cards(browser: object) -> dict[str, dict[str, int]]:
    """Per worker card on the page: the counts drawn into its grid, and the heartbeat's free and total."""
    script = """
      return [...document.querySelectorAll('[data-worker-id]')].map(card => {
        const grid = card.querySelector('canvas').dataset;
        const text = key => card.querySelector(`[data-stat="${key}"]`).textContent.replace(/,/g, '');
        return [card.dataset.workerId, {free: +grid.free, used: +grid.used, shared: +grid.shared,
          cached: +grid.cached, blocks: +grid.blocks, hb_free: +text('free_blocks'),
          hb_total: +text('total_blocks')}];
      });"""
    return dict(browser.execute_script(script))  # type: ignore[attr-defined]


def assert_shows(browser: object, workers: set[str]) -> None:
    assert set(cards(browser)) == workers


def test_the_dashboard_draws_every_worker_s_blocks_and_sees_a_long_request_finish(
    cluster: Cluster, browser: object
) -> None:
    assert "text/html" in get(cluster, "/dashboard").headers["Content-Type"]
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    done = threading.Event()

    def long_request() -> None:
        client.completions.create(
            model=MODEL_NAME, prompt="a long request " * 40, max_tokens=1500, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        done.set()

    browser.get(f"{cluster.base_url}/dashboard")  # type: ignore[attr-defined]
    poll(lambda: assert_shows(browser, {"w1", "w2"}), timeout=30)
    threading.Thread(target=long_request, daemon=True).start()

    def busy() -> dict[str, dict[str, int]]:
        shown = cards(browser)
        assert any(c["used"] + c["shared"] > 0 for c in shown.values())
        return shown

    during = poll(busy, timeout=60)
    assert set(during) == set(cluster.worker_ids()) == {"w1", "w2"}
    beats = cluster.heartbeats()
    for wid, shown in during.items():
        # The map and the heartbeat are written in one MULTI: the grid's free + cached blocks are its free.
        assert shown["blocks"] == shown["hb_total"] == beats[wid].total_blocks
        assert shown["free"] + shown["cached"] == shown["hb_free"]
        assert shown["free"] + shown["used"] + shown["shared"] + shown["cached"] == shown["blocks"]
    SCREENSHOT.parent.mkdir(exist_ok=True)
    browser.save_screenshot(str(SCREENSHOT))  # type: ignore[attr-defined]
    assert done.wait(120)
    holder = next(wid for wid, c in during.items() if c["used"] + c["shared"] > 0)

    def finished() -> dict[str, int]:
        shown = cards(browser)[holder]
        assert shown["used"] + shown["shared"] == 0
        return shown

    after = poll(finished, timeout=30)
    # Its blocks went back: the prompt's full blocks stay cached, the rest are free again.
    assert after["cached"] > during[holder]["cached"]
    assert after["free"] + after["cached"] == after["hb_free"] == after["blocks"]
