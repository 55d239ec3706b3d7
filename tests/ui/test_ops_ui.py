"""The Ops UI in a real browser (Debian's chromium, driven through chromedriver) against a
real local cluster running a real job."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import psutil
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from tests.conftest import leader_process, start_agent
from tests.helpers import wait_for
from tests.integration.test_jobs import tiny, wait_ready, wait_steps

pytestmark = pytest.mark.timeout(240)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture
def browser(tmp_path: Path):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.fail("chromium and chromium-driver are missing; .ci/run installs them (apt-get)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,800",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        pid = driver.service.process.pid if driver.service.process else None
        driver.quit()
        if pid is not None:  # chromedriver's chromium children, should quit have missed any
            children = []
            with contextlib.suppress(psutil.NoSuchProcess):
                children = psutil.Process(pid).children(recursive=True)
            for child in children:
                child.kill()


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def count(driver, css: str) -> int:
    return len(driver.find_elements(By.CSS_SELECTOR, css))


def click(driver, css: str) -> None:
    """Click ``css``; the page redraws its tables every 2 s, so retry a stale element."""

    def attempt() -> bool:
        driver.find_element(By.CSS_SELECTOR, css).click()
        return True

    wait_for(attempt, timeout=10, what=f"a click on {css}")


def text(driver, element_id: str) -> str:
    # Read in the page: an element fetched first could be redrawn before it is read.
    return driver.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.innerText : ''",
        element_id,
    )


def chart_points(driver, css: str = "#chart path.train-loss") -> int:
    return driver.execute_script(
        "const l = document.querySelector(arguments[0]);"
        "return l ? Number(l.getAttribute('data-points')) : 0",
        css,
    )


def validation_points(driver) -> int:
    return chart_points(driver, "#chart g.val-points")


# Installed before the page's own scripts: every text the detail pane ever shows (a flash
# that a poll could miss included), kept in window.detailTexts.
RECORD_DETAIL_TEXTS = """
window.detailTexts = [];
window.detailObserver = new MutationObserver((records) => {
  for (const record of records) {
    for (const node of record.addedNodes) window.detailTexts.push(node.textContent || "");
  }
  const pane = document.getElementById("detail");
  if (pane) window.detailTexts.push(pane.textContent);
});
window.detailObserver.observe(document, { childList: true, subtree: true, characterData: true });
"""


CHART_SNAPSHOT = """
const chart = document.getElementById("chart");
const texts = (css) => [...chart.querySelectorAll(css)].map((e) => e.textContent);
const path = chart.querySelector("path.train-loss");
return {
  x_ticks: texts(".x-tick"), y_ticks: texts(".y-tick"), titles: texts(".axis-title"),
  axes: chart.querySelectorAll("line.x-axis").length + chart.querySelectorAll("line.y-axis").length,
  path: path ? path.getAttribute("d") || "" : "",
  val_points: chart.querySelectorAll("circle.val-point").length,
  legend: texts(".legend text"),
  label: chart.getAttribute("aria-label"), title: texts(":scope > title"),
};
"""


def check_loss_chart(driver) -> None:
    """The chart has axes with round tick labels, a training path, validation points and a
    legend naming both, and says its latest values to assistive technology."""
    chart = driver.execute_script(CHART_SNAPSHOT)  # one drawing: it is redrawn with each step
    x_ticks, y_ticks = chart["x_ticks"], chart["y_ticks"]
    assert len(x_ticks) >= 2 and len(y_ticks) >= 2, chart
    assert all(t.isdigit() for t in x_ticks), x_ticks  # steps: whole numbers
    assert len({len(t.partition(".")[2]) for t in y_ticks}) == 1, y_ticks  # one precision
    assert all(len(t.partition(".")[2]) <= 4 for t in y_ticks), y_ticks
    values = [float(t) for t in y_ticks]
    assert values == sorted(values) and len(set(values)) == len(values), y_ticks
    assert chart["axes"] == 2 and chart["titles"] == ["step", "loss"], chart
    assert chart["path"].startswith("M") and chart["path"].count("L") >= 1, chart
    assert chart["val_points"] >= 2, chart  # the legend's is one, the curve's the others
    assert chart["legend"] == ["training loss", "validation loss"], chart
    label = chart["label"]
    assert "training loss" in label and "validation loss" in label and "step" in label, label
    assert chart["title"] == [label], chart


def test_ops_ui_shows_fellows_logs_loss_and_the_cluster(
    procs, nats_server, leader, browser, tmp_path
):
    shots = tmp_path / "screenshots"
    shots.mkdir()
    start_agent(procs, nats_server.url, "ui-1", SWARM_FELLOW_LABELS="zone=eu")
    start_agent(procs, nats_server.url, "ui-2")
    wait_ready(leader, "ui-1", "ui-2")
    job = tiny(name="ui", steps=100_000, stages=2, val_every=4, val_batches=1)
    job_id = leader.submit(**job)["job_id"]
    leader.wait_job(job_id, "RUNNING", timeout=20)
    wait_steps(leader, job_id, 3)

    # Straight to a registered fellow's page: a loading state until the registry answers,
    # never "Not in the registry" (which the page once showed before its first answer).
    recorder = browser.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_DETAIL_TEXTS}
    )
    browser.get(f"{leader.url}/ops/join-v2#fellow=ui-2")
    wait_for(lambda: text(browser, "fellow-status"), timeout=15, what="the fellow's status")
    seen = browser.execute_script("window.detailObserver.disconnect(); return window.detailTexts")
    browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", recorder)
    assert not any("Not in the registry" in t for t in seen), seen
    assert any("Loading" in t for t in seen), seen  # the observer saw the pane being drawn

    # The network column says what its bars and numbers are.
    legend = browser.find_element(By.ID, "net-legend")
    assert legend.is_displayed()
    assert count(browser, "#net-legend .swatch.sent") == 1
    assert count(browser, "#net-legend .swatch.recv") == 1
    for words in ("sent", "received", "bytes per second"):
        assert words in legend.text, legend.text

    # A fellow the registry does not know: that message, once the registry said so.
    browser.get(f"{leader.url}/ops/join-v2#fellow=nobody")
    wait_for(
        lambda: "Not in the registry" in text(browser, "detail"),
        timeout=15,
        what="the unknown fellow's notice",
    )
    # Its 404 is the one refused request so far (reading the log drains it).
    assert [e for e in console_errors(browser) if "/workers/nobody" not in e] == []

    browser.get(f"{leader.url}/ops/join-v2")
    wait_for(
        lambda: (
            count(browser, '#fellows tr[data-fellow="ui-1"]')
            and count(browser, '#fellows tr[data-fellow="ui-2"]')
        ),
        timeout=15,
        what="both fellows in the table",
    )
    assert count(browser, "#graph line.link") == 1, "one pipeline link between the two stages"
    assert console_errors(browser) == []
    browser.save_screenshot(str(shots / "overview.png"))

    # A fellow: its logs at once, then lines that arrive after the click.
    click(browser, '#fellows tr[data-fellow="ui-1"]')
    wait_for(lambda: count(browser, "#logs .line") > 0, timeout=15, what="log lines")
    before = count(browser, "#logs .line")
    checkpoint = leader.request("POST", f"/api/v1/jobs/{job_id}/checkpoint")
    assert checkpoint.status_code == 202
    wait_for(
        lambda: (
            count(browser, "#logs .line") > before
            and "signal CHECKPOINT" in browser.find_element(By.ID, "logs").text
        ),
        timeout=20,
        what="a log line that arrived after the click",
    )
    assert "#fellow=ui-1" in browser.current_url
    # Its pool (none set: the default pool) and labels, in the view and in the table.
    assert (text(browser, "fellow-pool"), text(browser, "fellow-labels")) == ("default", "zone=eu")
    assert count(browser, '#fellows tr[data-fellow="ui-1"] td.pool .labels') == 1
    # The link its boundary measured with ui-2 (whichever end ui-1 is): rate and round trip.
    wait_for(
        lambda: count(browser, '#fellow-links tr[data-peer="ui-2"]') == 1,
        timeout=20,
        what="the measured link to ui-2",
    )
    row = browser.find_element(By.CSS_SELECTOR, '#fellow-links tr[data-peer="ui-2"]').text
    assert " ms" in row and float(row.split()[1]) > 0, row
    browser.save_screenshot(str(shots / "fellow.png"))

    # The job: its loss curve grows while it trains; a reload redraws the stored curve.
    click(browser, f'#jobs tr[data-job="{job_id}"]')
    wait_for(lambda: chart_points(browser) >= 2, timeout=15, what="the loss curve")
    first = chart_points(browser)
    wait_for(lambda: chart_points(browser) > first + 3, timeout=30, what="live points")
    # Validation every 4 steps: points on the curve, live and from the history.
    wait_for(lambda: validation_points(browser) >= 2, timeout=60, what="validation points")
    check_loss_chart(browser)
    browser.save_screenshot(str(shots / "job.png"))
    if os.environ.get("OPS_UI_SCREENSHOT"):  # exp/screenshot_ops_ui.py: the README's picture
        wait_for(lambda: validation_points(browser) >= 12, timeout=120, what="a longer curve")
        browser.save_screenshot(os.environ["OPS_UI_SCREENSHOT"])
    grown, validated = chart_points(browser), validation_points(browser)
    browser.refresh()
    wait_for(lambda: chart_points(browser) >= grown, timeout=15, what="the curve after reload")
    wait_for(
        lambda: validation_points(browser) >= validated,
        timeout=15,
        what="the validation points after reload",
    )
    check_loss_chart(browser)
    wait_for(lambda: text(browser, "job-state") == "RUNNING", timeout=10, what="the job state")

    # Step and loss are the leader's view of the job (the slowest stage's, the last stage's).
    def shown_step() -> bool:
        step, _, total = text(browser, "job-step").partition(" of ")
        return step.isdigit() and int(step) >= 3 and total == "100000"

    wait_for(shown_step, timeout=10, what="the job's step")
    assert text(browser, "job-pool") == "default"
    assert float(text(browser, "job-loss")) > 0

    # The leader: aggregate CPU and RAM, and the placement plan.
    click(browser, '#graph g[data-node="leader"]')
    cores = str(psutil.cpu_count(logical=True))
    wait_for(
        lambda: text(browser, "cluster-cpu") == cores,
        timeout=10,
        what="the leader view",
    )
    assert "GiB free of" in text(browser, "cluster-ram")
    wait_for(
        lambda: count(browser, "table.placement tbody tr") == 2, timeout=10, what="the placement"
    )
    browser.save_screenshot(str(shots / "leader.png"))

    # A narrow screen still shows everything (one column).
    browser.set_window_size(420, 900)
    assert browser.find_element(By.ID, "fellows").is_displayed()
    browser.save_screenshot(str(shots / "narrow.png"))
    assert console_errors(browser) == []
    assert sorted(p.name for p in shots.iterdir()) == [
        "fellow.png",
        "job.png",
        "leader.png",
        "narrow.png",
        "overview.png",
    ]


def test_with_private_reads_the_ui_streams_over_read_tickets_never_the_token(
    procs, nats_server, browser, tmp_path
):
    started = leader_process(procs, nats_server, tmp_path, SWARM_API_PUBLIC_READS="0")
    leader = next(started)
    start_agent(procs, nats_server.url, "tk-1")
    wait_ready(leader, "tk-1")
    job_id = leader.submit(**tiny(name="tickets", steps=100_000, stages=1))["job_id"]
    leader.wait_job(job_id, "RUNNING", timeout=20)
    wait_steps(leader, job_id, 3)

    # The operator's token in this tab's sessionStorage, as the join panel keeps it.
    browser.get(f"{leader.url}/health")
    browser.execute_script("sessionStorage.setItem('swarm-token', arguments[0])", leader.token)
    browser.get(f"{leader.url}/ops/join-v2")
    # Every request is looked at below (a stream's entry appears once it closes).
    browser.execute_script("performance.setResourceTimingBufferSize(100000)")
    wait_for(
        lambda: count(browser, '#fellows tr[data-fellow="tk-1"]'), timeout=15, what="the fellow"
    )
    click(browser, '#fellows tr[data-fellow="tk-1"]')
    wait_for(lambda: count(browser, "#logs .line") > 0, timeout=15, what="log lines")
    checkpoint = leader.request("POST", f"/api/v1/jobs/{job_id}/checkpoint")
    assert checkpoint.status_code == 202
    wait_for(
        lambda: "signal CHECKPOINT" in browser.find_element(By.ID, "logs").text,
        timeout=20,
        what="a log line over the ticketed stream",
    )
    click(browser, f'#jobs tr[data-job="{job_id}"]')
    first = wait_for(lambda: chart_points(browser), timeout=15, what="the loss curve")
    wait_for(lambda: chart_points(browser) > first + 3, timeout=30, what="live points")
    click(browser, '#graph g[data-node="leader"]')  # closes the job's stream

    urls = browser.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name)"
    )
    streams = [u for u in urls if "/stream" in u]
    assert any("/logs/stream" in u for u in streams), urls
    assert any("/metrics/stream" in u for u in streams), urls
    assert all("ticket=" in u for u in streams), streams
    assert not any("access_token" in u or leader.token in u for u in urls)
    # No request was refused (the /health page above has no favicon: not the UI's).
    assert [e for e in console_errors(browser) if "favicon.ico" not in e] == []
    started.close()


# A job of two replicas of a two-stage pipeline, drawn from a record the page is handed (the
# runtime's replicas are tested apart; here only the drawing of the graph).
DRAW_REPLICAS = """
const stage = (replica, stage, id) => ({ replica, stage, fellow_id: id, layer_start: stage,
  layer_end: stage + 1, gpu_slots: [] });
const ids = ["a0", "a1", "b0", "b1", "idle"];
state.workers = ids.map((id) => ({ fellow_id: id, status: "training" }));
state.cluster = { running_jobs: [] };
state.jobs = [{ job_id: "rj", state: "RUNNING", placement: { transport: "p2p", stages: [
  stage(0, 0, "a0"), stage(0, 1, "a1"), stage(1, 0, "b0"), stage(1, 1, "b1")] },
  progress: [{ fellow_id: "a0", sync_s: 0.25, sync_bytes_sent: 3 * 1024 * 1024 }] }];
state.selection = { kind: "job", id: "rj" };
renderGraph();
const graph = document.getElementById("graph");
const ys = (css) => [...new Set([...graph.querySelectorAll(css)].map((e) =>
  e.querySelector("rect").getAttribute("y")))];
return {
  links: [...graph.querySelectorAll("line.link")].map((e) => e.getAttribute("data-replica")),
  syncs: [...graph.querySelectorAll("line.sync")].map((e) => e.getAttribute("data-sync")),
  labels: [...graph.querySelectorAll("text.sync-label")].map((e) => e.textContent),
  nodes: [...graph.querySelectorAll("g.node")].map((e) => e.getAttribute("data-node")),
  rows: ys('g.node[data-node*="stage"]').length,
  ring: graphLayout(state.jobs[0], ids, 600).links.filter((l) => l.kind === "sync").length,
  three: graphLayout({ placement: { stages: [0, 1, 2].map((r) => stage(r, 0, `r${r}`)) } },
    [], 600).links.filter((l) => l.kind === "sync").map((l) => [l.from, l.to, l.wrap]),
  splits: graphLayout({ placement: { stages: [
    { ...stage(0, 0, "a0"), layer_end: 1 }, { ...stage(0, 1, "a1"), layer_start: 1, layer_end: 4 },
    { ...stage(1, 0, "b0"), layer_end: 2 }, { ...stage(1, 1, "b1"), layer_start: 2, layer_end: 4 },
  ] } }, [], 600).links.filter((l) => l.kind === "sync").map((l) => [l.segment, l.from, l.to]),
};
"""


def test_the_graph_draws_a_row_per_replica_and_their_sync_links(leader, browser):
    browser.get(f"{leader.url}/ops/join-v2")
    wait_for(lambda: count(browser, '#graph g[data-node="leader"]'), timeout=15, what="the graph")
    drawn = browser.execute_script(DRAW_REPLICAS)
    assert drawn["links"] == ["0", "1"], drawn  # each replica's own pipeline link
    assert drawn["syncs"] == ["0-0", "1-0"], drawn  # the rings of layer 0 and of layer 1
    assert drawn["labels"][0] == "sync 0.25 s · 3.0 MiB", drawn
    assert "a0 (r0 stage 0)" in drawn["nodes"] and "b1 (r1 stage 1)" in drawn["nodes"], drawn
    assert "idle" in drawn["nodes"], drawn
    assert drawn["rows"] == 2, drawn
    assert drawn["ring"] == 2, drawn  # two replicas: one line per stage, not two
    assert drawn["three"] == [["r0", "r1", False], ["r1", "r2", False], ["r2", "r0", True]]
    # Replicas split 1-3 and 2-2: one ring per segment ([0, 1), [1, 2), [2, 4)) between the
    # stages that hold it.
    assert drawn["splits"] == [[0, "a0", "b0"], [1, "a1", "b0"], [2, "a1", "b1"]], drawn
    assert console_errors(browser) == []
