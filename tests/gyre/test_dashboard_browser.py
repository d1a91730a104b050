"""The dashboard in a real browser: `gyre dashboard` serves a recorded run from the event store and headless
Chromium (Debian's, driven through its chromedriver by Selenium) loads it: the curves and the cell timeline
render, an execution's tree opens, a box of it leads to its recorded call.

GYRE_DASHBOARD_SCREENSHOTS=<folder> also writes the screenshots docs/operating.md shows.

tests/recorded/elastic_run.jsonl is a real run on this machine, `gyre run --config configs/elastic.yaml
--steps 10 --cells 3 --set scheduling.group_size=4 --set scheduling.queries_per_step=1 --set budgets.calls=4`,
exported with `gyre events export FILE --run <id> --with-blobs`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from services.trajectory.replay import LoadedLog, import_text
from shared.ports import free_port
from shared.store import EventStore
from tests.conftest import Infra, database_url_for
from tests.gyre.test_dashboard import load_into

RECORDED = Path(__file__).resolve().parents[1] / "recorded" / "elastic_run.jsonl"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no Chromium and chromedriver on this machine: `make browser` installs Debian's (as root)",
)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for a driver on the network
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # The flags Chromium needs as root on this machine's closed network (no sandbox, no background fetches).
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-quic", "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
async def served(store: EventStore, infra: Infra, tmp_path: Path) -> AsyncIterator[tuple[str, LoadedLog]]:
    """`gyre dashboard` over a store holding the recorded run up to its last step's end: (its URL, the log).
    The test appends the rest, as the live run did."""
    log = import_text(RECORDED.read_text())
    await load_into(store, LoadedLog(log.events[:_last_step(log)], log.blobs))
    port = free_port()
    env = {**os.environ, "GYRE_DATABASE_URL": database_url_for(store, infra.database_url)}
    proc = subprocess.Popen([sys.executable, "-m", "gyre", "dashboard", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(url + "api/runs", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the dashboard did not answer within 60 s"
        time.sleep(0.2)
    try:
        yield url, log
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _last_step(log: LoadedLog) -> int:
    return max(i for i, e in enumerate(log.events) if e.type == "step.completed")


def _wait(driver, what: str, check, timeout: float = 60.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: check(d), message=what)


def _shot(driver, tmp_path: Path, name: str) -> None:
    folder = Path(os.environ.get("GYRE_DASHBOARD_SCREENSHOTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(folder / f"{name}.png"))
    assert (folder / f"{name}.png").stat().st_size > 10_000


async def test_a_recorded_run_loads_its_curves_and_timeline_render_a_tree_opens_and_it_updates_live(
        browser, served, store: EventStore, tmp_path: Path):
    from selenium.webdriver.common.by import By

    url, log = served
    run_id = log.events[0].run_id
    runs = httpx.get(url + "api/runs").json()
    view = httpx.get(url + f"api/runs/{run_id}").json()
    branched = [r for r in view["executions"] if r["branches"]]
    assert [r["run_id"] for r in runs] == [run_id] and branched, "the recorded run has a branching execution"
    d = browser
    d.get(url)

    # The curves: one line per series with a point per step; the timeline: a bar per cell and role segment.
    _wait(d, "the page shows the run", lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-position"))
    _wait(d, "curves drawn", lambda d: len(d.find_elements(By.CSS_SELECTOR, "#curves .scatterlayer .trace")) >= 3)
    reward = d.find_elements(By.CSS_SELECTOR, "#curves .scatterlayer .trace")[0]
    assert len(reward.find_elements(By.CSS_SELECTOR, ".point")) == view["summary"]["steps"] > 0
    _wait(d, "timeline drawn", lambda d: d.find_elements(By.CSS_SELECTOR, "#timeline .barlayer .point"))
    cells = {c for s in view["timeline"]["data"] if s["type"] == "bar" for c in s["y"]}
    ticks = {t.text for t in d.find_elements(By.CSS_SELECTOR, "#timeline .yaxislayer-above .ytick text")}
    assert cells and cells <= ticks
    assert len(d.find_elements(By.CSS_SELECTOR, "#executions tbody tr")) == len(view["executions"])
    _shot(d, tmp_path, "dashboard-run")

    # An execution with branches: its tree opens, with a box per node.
    execution = max(branched, key=lambda r: sum(r["branches"].values()))["execution_id"]
    row = d.find_element(By.CSS_SELECTOR, f"#executions tr[data-execution='{execution}']")
    d.execute_script("arguments[0].scrollIntoView({block: 'center'})", row)
    row.click()
    _wait(d, "the tree opens", lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-tree") == execution)
    tree = httpx.get(url + f"api/runs/{run_id}/executions/{execution}/tree").json()
    slices = _wait(d, "tree boxes drawn", lambda d: d.find_elements(By.CSS_SELECTOR, "#tree g.slice"))
    assert len(slices) == tree["stats"]["nodes"]
    kinds = {e.text for e in d.find_elements(By.CSS_SELECTOR, "#tree-legend .kind")}
    assert set(tree["kinds"]) <= kinds and any(k != "root" for k in tree["kinds"])
    assert len(d.find_elements(By.CSS_SELECTOR, "#calls tbody tr")) == tree["stats"]["calls"]

    d.execute_script("document.getElementById('tree-panel').scrollIntoView()")
    _shot(d, tmp_path, "dashboard-tree")

    # A box leads to the call that made it, and that call's record opens.
    slices[-1].click()
    link = _wait(d, "node details", lambda d: d.find_elements(By.ID, "node-call-link"))[0]
    link.click()
    _wait(d, "the recorded call", lambda d: "recorded call" in d.find_element(By.ID, "call").text)
    assert "completion" in d.find_element(By.ID, "call").text
    assert d.find_elements(By.CSS_SELECTOR, "#calls tr.selected")
    _shot(d, tmp_path, "dashboard-call")

    # The run goes on: its last step's end and what followed reach the page on its next poll.
    before = int(d.find_element(By.TAG_NAME, "body").get_attribute("data-position"))
    await store.append(log.events[_last_step(log):])
    final = httpx.get(url + "api/runs").json()[0]["position"]
    assert final > before
    _wait(d, "the page follows the log",
          lambda d: int(d.find_element(By.TAG_NAME, "body").get_attribute("data-position")) == final, timeout=30)
    cards = {c.find_element(By.CLASS_NAME, "label").text: c.find_element(By.CLASS_NAME, "value").text
             for c in d.find_elements(By.CSS_SELECTOR, "#summary .card")}
    assert cards["events"] == f"{len(log.events):,}"
