"""The dashboard in a real headless Chromium (Debian's, driven by Playwright) against a real store:
two small runs, one with an injected compute straggler on rank 2, and an imported per-op trace in
a store of its own. Every page is visited; no console errors and no request leaves the
machine."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
from playwright import sync_api as playwright

from ranktrace.app.dash_ingest import OWN_INGEST_GRACE_S
from ranktrace.app.demo import STRAGGLER_FROM
from ranktrace.app.demo import STRAGGLER_RANK as DEMO_STRAGGLER_RANK
from ranktrace.importers.importing import import_ops
from ranktrace.importers.perop import REPLAY_MODEL, read_perop
from ranktrace.telemetry.run_record import read_run_json, write_run_json
from tests.browser import CHROMIUM, LAUNCH_ARGS, start_dashboard
from tests.conftest import DASH_STRAGGLER_RANK, ranktrace, start_training, wait_for
from tests.margins import above_its_peers_from, at_most
from tests.perop_traces import Job, simulate, write_trace

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

STRAGGLER_RANK = DASH_STRAGGLER_RANK


@pytest.fixture(scope="module")
def runs_dir(dash_runs_dir):
    return dash_runs_dir


@pytest.fixture(scope="module")
def dashboard(runs_dir):
    proc, base = start_dashboard(runs_dir)
    yield base
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        yield browser
        browser.close()


class Visit:
    """One browser page that records console errors and every request it makes."""

    def __init__(self, browser, base: str) -> None:
        self.page = browser.new_page()
        self.base = base
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else 0)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def open(self, path: str, ready: str):
        self.page.goto(self.base + path)
        self.page.wait_for_selector(ready, timeout=30_000)
        return self.page

    def check_clean(self) -> None:
        assert self.errors == [], self.errors
        outside = [u for u in self.requests if not u.startswith(self.base)]
        assert outside == [], outside
        self.page.close()


@pytest.fixture(scope="module")
def demo_dashboard(demo_run):
    """`ranktrace dash` over the demo's three runs (tests/conftest.py `demo_run`)."""
    proc, base = start_dashboard(demo_run.runs_dir)
    yield base
    proc.terminate()
    proc.wait(timeout=10)


WIDE_ELEMENTS_JS = """() => [...document.querySelectorAll('body *')]
    .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1
                 && getComputedStyle(e).display !== 'none'
                 && !e.closest('.dash-spreadsheet-container'))
    .map(e => `${e.tagName}#${e.id}.${e.className}`.slice(0, 80))"""
"""Elements reaching past the window's right edge (a table scrolls inside its own box)."""
UNFIT_TABLES_JS = """() => [...document.querySelectorAll('table')].flatMap(t => {
    const id = (t.closest('[id]') || {}).id;
    const box = t.closest('.dash-table-container') || t.parentElement;
    const around = [];
    for (let e = t.parentElement; e && e !== document.body; e = e.parentElement) around.push(e);
    const hiding = [...around, ...t.querySelectorAll('*')].filter(e => e.scrollWidth >
        e.clientWidth && ['hidden', 'clip'].includes(getComputedStyle(e).overflowX));
    const wide = t.scrollWidth > box.clientWidth;
    return [...(wide ? [`${id}: ${t.scrollWidth} px wide in ${box.clientWidth}`] : []),
            ...hiding.map(e => `${id}: ${e.tagName}.${e.className} hides ${e.scrollWidth -
                                e.clientWidth} px`)];
})"""
"""Tables wider than their box (a scrollbar hides their last columns) or with content an
`overflow: hidden` element cuts off, on a page or inside the table."""


def _run_id(runs_dir, name: str) -> str:
    result = ranktrace("sql", f"SELECT run_id FROM runs WHERE name = '{name}'", "--format",
                       "csv", "--runs-dir", str(runs_dir), runs_dir=runs_dir)  # fmt: skip
    return result.stdout.splitlines()[1]


def test_runs_page_lists_the_runs(browser, dashboard):
    visit = Visit(browser, dashboard)
    page = visit.open("/", "#runs-table")
    text = page.inner_text("#runs-table")
    assert "slow" in text and "other" in text
    visit.check_clean()


@pytest.mark.timing
def test_run_page_names_the_injected_straggler(browser, dashboard, runs_dir):
    visit = Visit(browser, dashboard)
    page = visit.open(f"/run/{_run_id(runs_dir, 'slow')}", "#run-stragglers")
    assert f"rank {STRAGGLER_RANK} (pp=1" in page.inner_text("#run-stragglers")
    page.wait_for_selector("#run-series .main-svg")
    page.wait_for_selector("#run-breakdown .main-svg")
    visit.check_clean()


def test_ranks_heatmap_renders(browser, dashboard, runs_dir):
    visit = Visit(browser, dashboard)
    page = visit.open(f"/ranks/{_run_id(runs_dir, 'slow')}", "#ranks-heatmap .heatmaplayer")
    page.wait_for_selector("#ranks-collectives .boxlayer")
    page.click("text=blocking: waiting for late peers (s)")
    page.wait_for_selector("#ranks-heatmap .gtitle:has-text('blocking')")
    visit.check_clean()


def test_timeline_shows_the_pipeline_and_exports_a_trace(browser, dashboard, runs_dir):
    visit = Visit(browser, dashboard)
    page = visit.open(f"/timeline/{_run_id(runs_dir, 'slow')}?step=5", "#timeline-gantt .bars")
    assert "forward" in page.inner_text("#timeline-gantt")
    with page.expect_download() as download:
        page.click("#timeline-export")
    trace = download.value.path().read_text()
    assert '"traceEvents"' in trace and '"ph": "X"' in trace
    visit.check_clean()


def test_compare_page_warns_on_a_two_axis_pair(browser, dashboard, runs_dir):
    a, b = _run_id(runs_dir, "slow"), _run_id(runs_dir, "other")
    visit = Visit(browser, dashboard)
    page = visit.open(f"/compare?a={a}&b={b}", "#compare-warning")
    warning = page.inner_text("#compare-warning")
    assert "confounded" in warning and "tp" in warning and "pp" in warning
    visit.check_clean()


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT count(*) AS n FROM steps", None),
        ("COPY steps TO 'out.csv'", "only SELECT"),
        ("ATTACH '/tmp/other.duckdb' AS other", "only SELECT"),
        ("SELECT * FROM read_csv('/etc/passwd')", "query failed"),
        ("SELECT 1; SELECT 2", "exactly one SQL statement"),
    ],
)
def test_sql_page_answers_selects_and_refuses_the_rest(browser, dashboard, sql, expected):
    visit = Visit(browser, dashboard)
    page = visit.open("/sql", "#sql-query")
    page.fill("#sql-query", sql)
    page.click("#sql-run")
    if expected is None:
        page.wait_for_selector("#sql-table")
        assert "n" in page.inner_text("#sql-table")
    else:
        page.wait_for_selector("#sql-error")
        assert expected in page.inner_text("#sql-error")
    visit.check_clean()


def test_empty_runs_dir_shows_how_to_start(browser, tmp_path):
    proc, base = start_dashboard(tmp_path / "nothing-here")
    try:
        visit = Visit(browser, base)
        page = visit.open("/", ".empty-state")
        assert "No runs in" in page.inner_text(".empty-state")
        assert "ranktrace train" in page.inner_text(".empty-state")
        visit.check_clean()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _live_run_id(runs_dir) -> str | None:
    for path in runs_dir.glob("*/run.json"):
        record = json.loads(path.read_text() or "{}")
        if record.get("status") == "running" and record.get("losses"):
            return path.parent.name
    return None


def _shown_steps(page) -> tuple[str, int]:
    """(status, steps) from the run page's summary line."""
    match = re.search(r"(\w+) · (\d+) steps", page.inner_text("#run-content .summary"))
    return match.group(1), int(match.group(2))


def _grey_steps(page) -> list[int]:
    """The steps the run page's series shades grey (every rank slow at once: host noise)."""
    return page.evaluate(
        "() => [...new Set(document.querySelector('#run-series .js-plotly-plot').layout.shapes"
        ".filter(s => s.fillcolor === 'grey').map(s => s.x0 + 0.5))].sort((a, b) => a - b)"
    )


LONGER_PAUSE_STEPS = [4, 10, 16]
LONGER_PAUSE = "every=6,duration=0.6,from=4"
"""Both ranks pause 0.6 s more at LONGER_PAUSE_STEPS: 2-3x a step paused 0.25 s (0.3-0.6 s on
this 2-core machine, idle or under a load of 6)."""


@pytest.mark.timing
def test_pages_refresh_while_a_run_trains_then_shade_its_longer_pauses(browser, tmp_path):
    """While a run trains, the runs page lists it as live and its run page re-reads it on an
    interval, no reload (its segments, or the windows the dashboard stores as they complete:
    tests/test_dash_live.py); once ingested, the page shows the stored run, the steps where
    every rank paused longer shaded grey: slow on every rank at once (host noise)."""
    runs_dir = tmp_path / "runs"
    proc, base = start_dashboard(runs_dir)
    pause = "every=1,duration=0.25"  # both ranks: about 6 s of training, no straggler
    both_ranks = [f"pause:rank={rank},{spec}" for spec in (pause, LONGER_PAUSE) for rank in (0, 1)]
    training = start_training("--dp", "2", "--steps", "20", "--run-name", "live",
                              *(arg for spec in both_ranks for arg in ("--inject", spec)),
                              runs_dir=runs_dir)  # fmt: skip
    try:
        run_id = wait_for(lambda: _live_run_id(runs_dir), 120, "the run to start training")
        visit = Visit(browser, base)
        page = visit.open("/", "#runs-table")
        page.wait_for_selector("#runs-table :text('running (live)')", timeout=30_000)
        page.goto(f"{base}/run/{run_id}")
        page.wait_for_selector("#run-content .summary", timeout=30_000)
        status, first_steps = _shown_steps(page)
        assert status == "running"
        page.wait_for_function(
            "() => /completed · /.test(document.querySelector('#run-content .summary')"
            "?.innerText || '')",
            timeout=120_000,
        )
        status, last_steps = _shown_steps(page)
        assert (status, last_steps) == ("completed", 19)  # steps 1..19: warm-up left out
        assert first_steps < last_steps
        noise = wait_for(lambda: _grey_steps(page), 10, "the longer pauses to be shaded")
        # other steps may be grey too: a busy machine slows every rank in them (host noise)
        assert set(LONGER_PAUSE_STEPS) <= set(noise), noise
        assert training.wait(timeout=60) == 0
        visit.check_clean()
    finally:
        training.kill()
        training.communicate()
        proc.terminate()
        proc.wait(timeout=10)


def test_a_run_page_follows_its_run_into_the_store_though_each_read_outlasts_its_refresh(
    browser, runs_dir, tmp_path
):
    """A run page re-read every 0.05 s, less than any of its reads takes, still follows its run:
    shown training, then stored once finished. A free-running interval made Dash drop every
    read's result (each fired again before it returned): a timing-loop run's page still said
    "running" 120 s after its run was stored. Here `other`'s run directory, copied to a runs
    directory without a store, is marked training, then finished: the dashboard ingests it
    (as it does a finished run nobody ingested) and the page shows the stored run."""
    run_id = _run_id(runs_dir, "other")
    copied = tmp_path / "runs"
    shutil.copytree(runs_dir / run_id, copied / run_id)
    finished = read_run_json(copied / run_id)
    training = {key: value for key, value in finished.items() if key != "finished_at"}
    write_run_json(copied / run_id, {**training, "status": "running"})
    proc, base = start_dashboard(copied, "--refresh-s", "0.05")
    try:
        visit = Visit(browser, base)
        page = visit.open(f"/run/{run_id}", "#run-content .summary")
        assert _shown_steps(page) == ("running", 5)
        # finished OWN_INGEST_GRACE_S ago: the dashboard's next scan ingests it
        ended = time.time() - OWN_INGEST_GRACE_S
        write_run_json(copied / run_id, {**finished, "finished_at": ended})
        page.wait_for_function(
            "() => /completed · /.test(document.querySelector('#run-content .summary')"
            "?.innerText || '')",
            timeout=60_000,
        )
        # the page reads the finished run's segments until the dashboard's ingest (a child
        # process) has stored it: the page showed "completed" before the store held it (CI, stop 53)
        wait_for(lambda: run_id in _stored_ids(copied), 60, "the dashboard to store the run")
        assert _shown_steps(page) == ("completed", 5)  # steps 1..5: warm-up left out
        stored = visit.open(f"/run/{run_id}", "#run-content .summary")  # read from the store
        assert _shown_steps(stored) == ("completed", 5)
        visit.check_clean()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _stored_ids(runs_dir) -> set[str]:
    result = ranktrace("sql", "SELECT run_id FROM runs", "--format", "csv", "--runs-dir",
                       str(runs_dir), runs_dir=runs_dir)  # fmt: skip
    return set(result.stdout.splitlines()[1:])


@pytest.mark.timing
def test_html_report_opens_offline_and_names_the_straggler(browser, runs_dir, tmp_path):
    """`ranktrace report --html`: one file that renders with the network off (Plotly inlined)."""
    out = tmp_path / "report.html"
    result = ranktrace("report", "slow", "--html", str(out), "--runs-dir", str(runs_dir),
                       runs_dir=runs_dir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    context = browser.new_context(offline=True)
    page = context.new_page()
    errors, requests = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else 0)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(out.as_uri())
    page.wait_for_selector(".plotly-graph-div .main-svg", timeout=30_000)
    assert f"rank {STRAGGLER_RANK} (pp=1" in page.inner_text("#stragglers")
    assert page.locator(".plotly-graph-div").count() == 4  # heatmap, breakdown, series, memory
    assert page.evaluate("typeof Plotly") == "object"
    assert errors == [] and all(u.startswith("file://") for u in requests), (errors, requests)
    context.close()


def test_an_imported_trace_has_its_run_page_ranks_and_timeline(browser, tmp_path):
    """A per-op trace (worker dp 2, stage 1 computing 1.5x) imported into a store of its own is a
    run like any other: its straggler, slowdown and causes on the run page, heatmap, timeline."""
    job = Job(slow_worker=(2, 1), slow_factor=1.5)
    path = write_trace(simulate(job), tmp_path / "trace.parquet")
    ops, workers = read_perop(path, job.pp, job.dp)
    runs_dir = tmp_path / "runs"
    layout = {"tp": 1, "pp": job.pp, "dp": job.dp}
    imported = {"format": "per-op", "replay_model": REPLAY_MODEL}  # as `ranktrace import` says
    run_id = import_ops(runs_dir, ops, workers, "imported", layout, imported).run_id
    slow = job.worker(2, 1)
    proc, base = start_dashboard(runs_dir)
    try:
        visit = Visit(browser, base)
        page = visit.open(f"/run/{run_id}", "#run-stragglers")
        assert f"rank {slow} (pp=1 dp=2" in page.inner_text("#run-stragglers")
        causes = page.inner_text("#run-causes")  # S, causes and remedies as tables
        assert f"rank {slow} compute" in causes and "share of S - 1" in causes
        page = visit.open(f"/ranks/{run_id}", "#ranks-heatmap .heatmaplayer")
        page = visit.open(f"/timeline/{run_id}?step=4", "#timeline-gantt .bars")
        assert "forward" in page.inner_text("#timeline-gantt")
        visit.check_clean()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _fits_the_window(page) -> None:
    """Nothing reaches past the window and every table fits its box, nothing hidden."""
    assert page.evaluate(WIDE_ELEMENTS_JS) == []
    assert page.evaluate(UNFIT_TABLES_JS) == []


def _plotted(page, graph: str) -> list[dict]:
    """The traces a dcc.Graph draws: name, subplot axis, x and y (Plotly's decoded copy: the
    figure's own arrays may be base64 typed arrays)."""
    return page.evaluate(
        f"() => document.querySelector('#{graph} .js-plotly-plot')._fullData.map("
        "t => ({name: t.name, xaxis: t.xaxis || 'x', x: Array.from(t.x || []), "
        "y: Array.from(t.y || [])}))"
    )


def test_the_demo_compares_like_with_like_in_percent_at_1280_px(browser, demo_dashboard,
                                                                demo_run):  # fmt: skip
    """Issue 28 on the demo's own runs: the tp sweep through demo-tp1 plots its two points,
    tp=1 and tp=2, and lists demo-straggler (other steps, a fault) beside it, never plotted;
    MFU is a percentage in every table; at 1280 px nothing reaches past the window and every
    table fits its box."""
    tp1, tp2 = (_run_id(demo_run.runs_dir, f"demo-tp{v}") for v in (1, 2))
    visit = Visit(browser, demo_dashboard)
    visit.page.set_viewport_size({"width": 1280, "height": 800})
    page = visit.open("/", "#runs-table")
    mfu = page.evaluate("""() => { const t = document.querySelector('#runs-table');
        const heads = [...t.querySelectorAll('th')].map(h => h.innerText.trim());
        const at = heads.indexOf('MFU');
        return [...t.querySelectorAll('tbody tr')].map(r => r.querySelectorAll('td')[at])
            .filter(c => c).map(c => c.innerText.trim()); }""")
    assert len(mfu) == 3 and all(re.fullmatch(r"\d+\.\d+%", v) for v in mfu), mfu
    _fits_the_window(page)
    page = visit.open(f"/compare?a={tp1}&b={tp2}", "#compare-table")
    page.wait_for_selector("#compare-sweep .scatterlayer .point")
    (line,) = [t for t in _plotted(page, "compare-sweep") if t["x"]]
    assert line["x"] == [1, 2], line
    excluded = page.inner_text("#compare-sweep-excluded")
    assert "demo-straggler" in excluded and "steps 12 → 24" in excluded, excluded
    assert "faults none → compute:rank=" in excluded, excluded
    rows = page.inner_text("#compare-table")
    (mfu_row,) = [r for r in rows.splitlines() if r.startswith("MFU")]
    assert len(re.findall(r"\d+\.\d+%", mfu_row)) == 2, mfu_row  # A's and B's
    _fits_the_window(page)
    visit.check_clean()


@pytest.mark.timing
def test_the_demo_run_page_shows_its_straggler_against_its_peers(browser, demo_dashboard,
                                                                 demo_run):  # fmt: skip
    """The straggler run's page: rank 5's compute above its peers' median from the fault's
    first step, not before; no step before the fault shaded grey as slow on every rank (its
    peers' own time falls while they wait for it, which must not make the healthy steps look
    slow); its timeline link opens on that step with the ranks it shows in its title; at
    1280 px nothing reaches past the window and every table, the remedies too, fits its box."""
    run_id = _run_id(demo_run.runs_dir, "demo-straggler")
    visit = Visit(browser, demo_dashboard)
    visit.page.set_viewport_size({"width": 1280, "height": 800})
    page = visit.open(f"/run/{run_id}", "#run-breakdown .main-svg")
    assert f"rank {DEMO_STRAGGLER_RANK} (pp=" in page.inner_text("#run-stragglers")
    traces = _plotted(page, "run-breakdown")
    own, peers = (
        {s: y for t in traces if t["name"] == "compute" and t["xaxis"] == axis
         for s, y in zip(t["x"], t["y"], strict=True)}
        for axis in ("x", "x2")
    )  # fmt: skip
    above_its_peers_from(own, peers, STRAGGLER_FROM)
    page.wait_for_selector("#run-series .main-svg")
    noise = _grey_steps(page)  # before the fix: steps 1-7, judged against the faulty steps
    # Judged against the steps outside the finding (1-7 here), at most half of them can be
    # 1.25x their median: on a quiet machine none is; a busy one may slow every rank in a step
    # or two (that is host noise), as a run here at a load of 7 did.
    grey_before = [s for s in noise if s < STRAGGLER_FROM]
    at_most("grey steps before the fault", len(grey_before), (STRAGGLER_FROM - 1) // 2, noise)
    page.wait_for_selector("#run-remedies")
    _fits_the_window(page)
    page.click("text=timeline")
    page.wait_for_selector("#timeline-gantt .bars")
    title = page.text_content("#timeline-gantt .gtitle")
    assert title.startswith(f"step {STRAGGLER_FROM}, ranks 0-7"), title
    _fits_the_window(page)
    visit.check_clean()


def test_the_demo_sql_page_fits_at_1280_px(browser, demo_dashboard):
    """The SQL page's example query over the demo's runs at 1280 px: nothing reaches past the
    window, its table fits its box. (The runs, run, timeline and compare pages are checked
    above; the ranks page has no table.)"""
    visit = Visit(browser, demo_dashboard)
    visit.page.set_viewport_size({"width": 1280, "height": 800})
    page = visit.open("/sql", "#sql-query")
    page.click("#sql-run")
    page.wait_for_selector("#sql-table")
    _fits_the_window(page)
    visit.check_clean()
