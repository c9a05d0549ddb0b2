"""The dashboard's page layouts and callbacks called directly (inside the app's request
context) on a real store: what each returns, without a browser."""

from __future__ import annotations

import json

import dash
import pytest

from ranktrace.analysis.store import open_reader
from ranktrace.app.dashboard import create_app
from tests.conftest import DASH_STRAGGLER_RANK

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)


@pytest.fixture(scope="module")
def app(dash_runs_dir):
    app = create_app(dash_runs_dir)
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


def test_runs_rows_count_the_straggler(app, run_ids):
    rows = {row["name"]: row for row in page("runs").runs_rows({})}
    assert rows["slow"]["stragglers"] == 1 and rows["other"]["stragglers"] == 0, rows
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
    """`narrow` is `slow` at dp=1, but with 6 steps and no fault (`slow`: 20 steps, a compute
    fault): the dp sweep through `slow` plots `slow` alone, on an integer axis, and lists
    `narrow` beside it with what differs; the compare table speaks in words and units."""
    result = str(page("compare").on_pick(run_ids["slow"], run_ids["other"]))
    assert "confounded" in result and "step time (s)" in result and "MFU (%)" in result
    figure, excluded = page("compare").sweep_view(run_ids["slow"], "tp", "step_time_s")
    assert list(figure.data[0].x) == [1]  # nothing differs from `slow` in tp alone
    assert "other" in str(excluded) and "pp 2 → 1" in str(excluded)  # tp=2, and pp, steps...
    figure, excluded = page("compare").sweep_view(run_ids["slow"], "dp", "step_time_s")
    (line,) = figure.data
    assert list(line.x) == [2] and all(y > 0 for y in line.y)
    assert list(figure.layout.xaxis.tickvals) == [2]
    listed = str(excluded)
    assert "narrow" in listed and "steps 20 → 6" in listed and "faults compute:rank=2" in listed
    mfu, _ = page("compare").sweep_view(run_ids["slow"], "dp", "mfu")
    assert 0 < mfu.data[0].y[0] < 100 and mfu.layout.yaxis.title.text == "MFU (%)"


def test_sql_callback_limits_and_refuses(app):
    table, message = page("sql").on_run(1, "SELECT * FROM steps")
    assert message == "116 row(s)" and len(table.data) == 116  # 4 x (20 + 6) + 2 x 6 rank-steps
    _, refused = page("sql").on_run(1, "DELETE FROM steps")
    assert "only SELECT" in str(refused)
