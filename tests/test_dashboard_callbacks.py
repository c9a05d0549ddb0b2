"""The dashboard's page layouts and callbacks called directly (inside the app's request
context) on a real store: what each returns, without a browser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import dash
import pytest

from ranktrace.analysis.store import open_reader
from ranktrace.app import dash_data
from ranktrace.app.cli import DASH_REFRESH_S
from ranktrace.app.dashboard import create_app
from tests.conftest import DASH_STRAGGLER_FROM, DASH_STRAGGLER_RANK
from tests.margins import above_its_peers_from, only_findings

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)


@pytest.fixture(scope="module")
def app(dash_runs_dir):
    app = create_app(dash_runs_dir, refresh_s=DASH_REFRESH_S)
    with app.server.test_request_context():
        yield app


@pytest.fixture(scope="module")
def run_ids(dash_runs_dir) -> dict:
    con = open_reader(dash_runs_dir)
    try:
        return dict(con.execute("SELECT name, run_id FROM runs").fetchall())
    finally:
        con.close()


def page(name: str):
    """The module of page `name` as Dash Pages imported it."""
    import sys

    return sys.modules[dash.page_registry[f"pages.{name}"]["module"]]


@pytest.mark.timing
def test_runs_rows_count_the_straggler(app, run_ids):
    """The runs list counts each run's findings as its report does: `slow`, rank 2's compute
    (a wait for a core of another rank, where another job shares these cores, besides)."""
    rows = {row["name"]: row for row in page("runs").runs_rows({})}
    for name in ("slow", "other"):
        report = dash_data.run_report(run_ids[name])
        assert rows[name]["stragglers"] == len(report["stragglers"]), (rows, report)
        only_findings(report["stragglers"], [(DASH_STRAGGLER_RANK, "compute")] * (name == "slow"))
    assert rows["slow"]["pp"] == 2 and rows["other"]["tp"] == 2


def test_compare_link_needs_two_runs(app, run_ids):
    data = [{"run_id": run_ids["slow"]}, {"run_id": run_ids["other"]}]
    assert "Select two" in str(page("runs").compare_link([0], data))
    link = page("runs").compare_link([0, 1], data)
    assert link.href == f"/compare?a={run_ids['slow']}&b={run_ids['other']}"


def test_run_content_names_the_straggler(app, run_ids):
    content = str(page("run").run_content(run_ids["slow"]))
    assert f"rank {DASH_STRAGGLER_RANK} (pp=1" in content
    assert "No data" in str(page("run").run_content("no-such-run"))
    assert "Fault tolerance" not in content


def test_run_content_shows_checkpoints_and_their_cost(app, run_ids):
    content = str(page("run").run_content(run_ids["other"]))
    assert "checkpoints (async, every 3 steps): 2 complete, 0 failed" in content
    assert "expected work lost per failure" in content


def test_heatmap_has_one_row_per_rank(app, run_ids):
    figure = page("ranks").heatmap_figure(run_ids["slow"], "own_s")
    (heat,) = figure.data
    assert len(heat.y) == 4 and heat.y[DASH_STRAGGLER_RANK].startswith("r2 pp1")
    assert len(heat.x) == 19  # steps 1..19 (the warm-up step is left out)


def test_timeline_export_is_a_trace(app, run_ids):
    download = page("timeline").export(1, 5, run_ids["slow"])
    trace = json.loads(download["content"])
    ranks = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert ranks == {0, 1, 2, 3}
    assert download["filename"].endswith("step5.trace.json")


def test_compare_warns_on_two_axes_and_sweep_plots_only_like_with_like(app, run_ids):
    """`other` is `slow` at tp=2, but also at pp=1, with 6 steps and no fault (`slow`: 20 steps,
    a compute fault): the tp sweep through `slow` plots `slow` alone, on an integer axis, and
    lists `other` beside it with what differs; the compare table speaks in words and units.
    (The demo's tp1/tp2 pair, two points and its straggler run listed: tests/test_dashboard.py.)"""
    result = str(page("compare").on_pick(run_ids["slow"], run_ids["other"]))
    assert "confounded" in result and "'step time'" in result and "'MFU'" in result
    assert re.search(r"'\d+\.\d+%'", result) and re.search(r"'\d+(\.\d+)? (ms|s)'", result)
    figure, excluded = page("compare").sweep_view(run_ids["slow"], "tp", "step_time_s")
    (line,) = figure.data
    assert list(line.x) == [1] and all(y > 0 for y in line.y)  # nothing differs in tp alone
    assert list(figure.layout.xaxis.tickvals) == [1]
    listed = str(excluded)
    assert "other" in listed and "pp 2 → 1" in listed and "steps 20 → 6" in listed
    assert "faults compute:rank=2" in listed
    mfu, _ = page("compare").sweep_view(run_ids["slow"], "dp", "mfu")
    assert 0 < mfu.data[0].y[0] < 100 and mfu.layout.yaxis.title.text == "MFU (%)"


def test_sql_callback_limits_and_refuses(app):
    table, message = page("sql").on_run(1, "SELECT * FROM steps")
    assert message == "104 row(s)" and len(table.data) == 104  # 4 x (20 + 6) rank-steps
    _, refused = page("sql").on_run(1, "DELETE FROM steps")
    assert "only SELECT" in str(refused)


def _component(component, component_id: str):
    """The component `component_id` inside a page's component tree, or None."""
    if getattr(component, "id", None) == component_id:
        return component
    children = getattr(component, "children", None)
    for child in children if isinstance(children, list) else [children]:
        if child is not None and not isinstance(child, str):
            found = _component(child, component_id)
            if found is not None:
                return found
    return None


def _graph(component, graph_id: str):
    """The figure of the dcc.Graph `graph_id` inside a page's component tree."""
    graph = _component(component, graph_id)
    return None if graph is None else graph.figure


@pytest.mark.timing
def test_run_page_shows_the_straggler_against_its_peers_median(app, run_ids):
    """`slow`: rank 2 computes 3x from step 4. The breakdown draws rank 2's step above its
    peers' median (not the mean of all ranks, which hides it), its compute above theirs from
    step 4; the series shade the finding's steps and show MFU in %."""
    content = page("run").run_content(run_ids["slow"])
    findings = dash_data.run_report(run_ids["slow"])["stragglers"]
    only_findings(findings, [(DASH_STRAGGLER_RANK, "compute")])
    breakdown = _graph(content, "run-breakdown")
    assert breakdown.layout.annotations[0].text == f"rank {DASH_STRAGGLER_RANK}", findings
    compute = [trace for trace in breakdown.data if trace.name == "compute"]
    own, peers = compute  # row 1: the rank, row 2: its peers' median
    # a peer's wait for a core is drawn as such, not as compute (CPU ranks sharing 2 cores)
    waits = [trace for trace in breakdown.data if trace.name == "wait for a core"]
    assert len(waits) == 2, waits
    if Path("/proc/thread-self/schedstat").exists():  # where the kernel counts the waits
        assert any(y > 0 for trace in waits for y in trace.y), waits
    # from the fault's first step: with 5 here, its faulty step 4 (2.4x) counted as a step
    # "before" it, and one noisy step 3 (1.7x, two timing-loop runs) made two of the one allowed
    above_its_peers_from(dict(zip(own.x, own.y, strict=True)),
                         dict(zip(peers.x, peers.y, strict=True)), DASH_STRAGGLER_FROM)  # fmt: skip
    series = _graph(content, "run-series")
    assert series.layout.yaxis2.title.text == "MFU (%)"
    assert all(0 < y < 100 for y in series.data[1].y if y == y)
    causes = _component(content, "run-causes").data  # S's causes as a table, not raw text
    (cause,) = [c for c in causes if c["cause"] == f"rank {DASH_STRAGGLER_RANK} compute"]
    assert cause["saves"].endswith("%") and causes[-1]["cause"] == "what the causes leave"
    remedies = _component(content, "run-remedies").data
    assert any(r["for"].startswith(f"rank {DASH_STRAGGLER_RANK}") for r in remedies), remedies
    shaded = [shape for shape in series.layout.shapes if shape.fillcolor == "crimson"]
    top = dash_data.run_report(run_ids["slow"])["stragglers"][0]  # the shaded finding's steps
    assert len(shaded) == 3, shaded  # one per panel
    assert all(s.x0 == top["first_step"] - 0.5 for s in shaded), (shaded, findings)


def test_timeline_opens_on_the_top_finding_titled_with_the_ranks_it_shows(app, run_ids):
    """Without `?step=`, the timeline opens on the first step of `slow`'s straggler (its
    evidence), not step 1; its title names the 4 ranks drawn, not a window of 64."""
    first = dash_data.run_report(run_ids["slow"])["stragglers"][0]["first_step"]
    assert page("timeline").opening_step(run_ids["slow"]) == first
    figure = _graph(page("timeline").layout(run_ids["slow"]), "timeline-gantt")
    assert figure.layout.title.text == f"step {first}, ranks 0-3"
    colours = {trace.name: trace.marker.color for trace in figure.data}
    assert colours["forward"] != colours["tp comm" if "tp comm" in colours else "pp comm"]
    assert len(set(colours.values())) == len(colours)


def test_the_runs_list_and_the_report_give_one_median_step_time(app, run_ids, dash_runs_dir):
    """The runs page's median step time is the report's (both leave the warm-up step out: the
    runs list once kept it, 1.4728 s against the CLI's 1.4735 s)."""
    from ranktrace.analysis.views import runs_overview

    con = open_reader(dash_runs_dir)
    try:
        overview = runs_overview(con).set_index("name")
    finally:
        con.close()
    for name in ("slow", "other"):
        report = dash_data.run_report(run_ids[name])
        assert overview.loc[name, "median_step_time_s"] == pytest.approx(report["step_time_s"])
