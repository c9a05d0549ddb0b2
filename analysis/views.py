"""The tables the dashboard draws, as DataFrames: runs at a glance, per-step series and
breakdowns, rank × step heatmaps (binned to a size a browser draws quickly), collective duration
quantiles, and one step's spans for a timeline. Per-step views leave out the warm-up step, whose
time (allocation, first touch) would flatten every colour scale. Every function takes an open
connection (`analysis.store.open_reader` or `open_live`) and reads only.
"""

from __future__ import annotations

import duckdb
import pandas as pd

from ranktrace.analysis.peers import WARMUP_STEPS
from ranktrace.analysis.trace_export import span_rows

HEATMAP_METRICS = {
    "step_time_s": "step time (s)",
    "own_s": "compute: time not waiting for peers (s)",
    "comm_blocking_s": "blocking: waiting for late peers (s)",
}
"""Heatmap metric (a step_breakdown column) -> its label."""
BREAKDOWN_PARTS = {
    "compute": "work_s - core_wait_part_s",
    "wait for a core": "core_wait_part_s",
    "tp communication": "coalesce(tp_transfer_s, 0) + coalesce(tp_blocking_s, 0)",
    "pipeline wait": "pipeline_wait_s",
    "dp communication": "coalesce(dp_transfer_s, 0) + coalesce(dp_blocking_s, 0)",
    "world communication": "coalesce(world_transfer_s, 0) + coalesce(world_blocking_s, 0)",
    "data": "data_s",
    "host": "host_s",
}
"""Parts of a rank's step in the stacked breakdown (SQL over step_breakdown). The optimizer's
own compute is in `compute`; its communication in dp/world communication. The time a rank's
compute waited for a core (CPU ranks sharing cores; 0 where not recorded) is a part of its
own, not compute: drawn as compute, the dashboard run's 3x compute straggler read 0.71x its
peers' median in one step of a loaded CI run, their waits counted as their compute."""
BREAKDOWN_SOURCE = """(
    SELECT b.*, CASE WHEN coalesce(k.device LIKE 'cpu%', false)
        THEN least(b.work_s - least(b.work_s, coalesce(b.work_cpu_s, 0)),
                   coalesce(b.work_core_wait_s, greatest(0, b.work_s - b.work_cpu_s)))
        ELSE 0 END AS core_wait_part_s
    FROM step_breakdown b LEFT JOIN ranks k USING (run_id, rank)
)"""
"""step_breakdown with `core_wait_part_s`: on CPU devices the wait for a core inside compute
(where not recorded, wall less CPU time; never the share its CPU time shows computing), as the
diagnosis splits it (analysis/peers.py `split_compute`); 0 elsewhere (a GPU rank's host thread
waiting is not its compute's)."""
MAX_STEP_COLUMNS = 300
"""Heatmaps and per-step series bin steps so that at most this many columns are drawn."""


def runs_overview(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """One row per run: layout, model, status, steps, median step time, MFU and tokens/s."""
    return con.execute(
        """
        WITH per_run AS (
            SELECT run_id, median(max_step_time_s) AS median_step_time_s, median(mfu) AS mfu
            FROM step_stats WHERE step >= ? GROUP BY run_id
        ),
        final AS (
            SELECT r.run_id, r.name, r.status, r.tp, r.pp, r.dp, r.zero, r.micro_batches,
                   r.model, r.world_size, r.steps_done, p.median_step_time_s, p.mfu,
                   r.tokens_per_s, to_timestamp(r.started_at) AS started
            FROM runs r LEFT JOIN per_run p USING (run_id)
        )
        SELECT * FROM final ORDER BY started DESC
        """,
        [WARMUP_STEPS],  # the report's median leaves the warm-up step out too
    ).df()


def _step_bin(con: duckdb.DuckDBPyConnection, run_id: str) -> int:
    """Steps per column so that a run's steps fit in MAX_STEP_COLUMNS."""
    (last,) = con.execute("SELECT max(step) FROM steps WHERE run_id = ?", [run_id]).fetchone()
    return max(1, -(-((last or 0) + 1) // MAX_STEP_COLUMNS))


def step_series(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """Per step (binned): loss, MFU (mean over ranks), job step time and tokens/s."""
    size = _step_bin(con, run_id)
    return con.execute(
        f"""
        SELECT step // {size} * {size} AS step, avg(loss) AS loss, avg(mfu) AS mfu,
               avg(max_step_time_s) AS step_time_s,
               avg(tokens / max_step_time_s) AS tokens_per_s
        FROM step_stats s JOIN (
            SELECT run_id, step, any_value(tokens) AS tokens FROM steps GROUP BY ALL
        ) USING (run_id, step)
        WHERE run_id = ? AND step >= ? GROUP BY 1 ORDER BY 1
        """,
        [run_id, WARMUP_STEPS],
    ).df()


def step_breakdown_by_part(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """Per step (binned), the mean over ranks of each part of BREAKDOWN_PARTS, in seconds."""
    size = _step_bin(con, run_id)
    parts = ", ".join(f'avg({sql}) AS "{name}"' for name, sql in BREAKDOWN_PARTS.items())
    return con.execute(
        f"SELECT step // {size} * {size} AS step, {parts} FROM {BREAKDOWN_SOURCE} "
        "WHERE run_id = ? AND step >= ? GROUP BY 1 ORDER BY 1",
        [run_id, WARMUP_STEPS],
    ).df()


def rank_against_peers(con: duckdb.DuckDBPyConnection, run_id: str,
                       rank: int) -> tuple[pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """(per step, binned, each part of BREAKDOWN_PARTS of `rank`; the same, the median over the
    other ranks of each step): a straggler's step against its peers', not diluted in a mean."""
    size = _step_bin(con, run_id)
    columns = ", ".join(f'{sql} AS "{name}"' for name, sql in BREAKDOWN_PARTS.items())
    binned = ", ".join(f'avg("{name}") AS "{name}"' for name in BREAKDOWN_PARTS)
    medians = ", ".join(f'median("{name}") AS "{name}"' for name in BREAKDOWN_PARTS)
    per_rank = (f"SELECT step, rank, {columns} FROM {BREAKDOWN_SOURCE} "
                "WHERE run_id = $run AND step >= $warmup")  # fmt: skip
    values = {"run": run_id, "warmup": WARMUP_STEPS, "rank": rank}
    own = con.execute(f"WITH per AS ({per_rank}) SELECT step // {size} * {size} AS step, "
                      f"{binned} FROM per WHERE rank = $rank GROUP BY 1 ORDER BY 1",
                      values).df()  # fmt: skip
    peers = con.execute(f"WITH per AS ({per_rank}), med AS (SELECT step, {medians} FROM per "
                        f"WHERE rank != $rank GROUP BY step) SELECT step // {size} * {size} AS "
                        f"step, {binned} FROM med GROUP BY 1 ORDER BY 1", values).df()  # fmt: skip
    return own, peers


HOST_NOISE_FACTOR = 1.25
"""A step is host noise when even its fastest rank's own time is this much above the median of
that minimum over the steps no finding covers: every rank was slow at once (the host, not one
rank)."""


def _finding_steps(finding: dict) -> list[int]:
    """The steps of a report's straggler finding (a dict of `Straggler.to_dict`): a transient
    one's slow steps, a chronic one's from its first to its last step (as
    analysis/whatif.py's `finding_steps`)."""
    return finding.get("steps") or list(range(finding["first_step"], finding["last_step"] + 1))


def host_noise_steps(con: duckdb.DuckDBPyConnection, run_id: str,
                     findings: list[dict]) -> list[int]:  # fmt: skip
    """Steps slow on every rank at once (HOST_NOISE_FACTOR), after the warm-up step.

    The reference is the median, over the steps outside every one of `findings` (the report's
    stragglers), of each step's fastest own time: a straggler's steps move its peers' own time
    too, and would set the reference for the healthy ones. In the demo (rank 5 3x slow from
    step 8, 8 ranks on 2 cores) the others computed faster while they waited for it: the
    fastest rank's own time fell from 0.44-0.49 s to 0.27-0.40 s, and against the median over
    every step (0.35 s) each step before the fault read as slow on every rank. Where the
    findings cover every step, no step is free of them, and the reference is every step's."""
    per_step = con.execute(
        "SELECT step, min(own_s) AS own FROM step_breakdown WHERE run_id = ? AND step >= ? "
        "GROUP BY step ORDER BY step",
        [run_id, WARMUP_STEPS],
    ).df()
    fastest = per_step.set_index("step")["own"]
    covered = {step for finding in findings for step in _finding_steps(finding)}
    outside = fastest[~fastest.index.isin(list(covered))]
    reference = (outside if len(outside) else fastest).median()
    return [int(step) for step in fastest.index[fastest > HOST_NOISE_FACTOR * reference]]


def heatmap(
    con: duckdb.DuckDBPyConnection, run_id: str, metric: str, last_steps: int | None = None
) -> pd.DataFrame:
    """Rank × step (binned) matrix of `metric` (a HEATMAP_METRICS key): index = rank, columns
    = the first step of each bin, values = the bin's mean. `last_steps`: only the last N."""
    if metric not in HEATMAP_METRICS:
        raise ValueError(
            f"unknown heatmap metric {metric!r}; choose one of {list(HEATMAP_METRICS)}"
        )
    (last,) = con.execute("SELECT max(step) FROM steps WHERE run_id = ?", [run_id]).fetchone()
    first = WARMUP_STEPS if last_steps is None or last is None else last - last_steps + 1
    first = max(WARMUP_STEPS, first)
    span = (last or 0) - first + 1
    size = max(1, -(-span // MAX_STEP_COLUMNS))
    long = con.execute(
        f"SELECT rank, {first} + (step - {first}) // {size} * {size} AS step, avg({metric}) AS v "
        "FROM step_breakdown WHERE run_id = ? AND step >= ? GROUP BY ALL",
        [run_id, first],
    ).df()
    return long.pivot(index="rank", columns="step", values="v").sort_index()


def rank_labels(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """rank, pp, dp, tp, host of every rank of a run, in rank order."""
    return con.execute(
        "SELECT rank, pp, dp, tp, host FROM ranks WHERE run_id = ? ORDER BY rank", [run_id]
    ).df()


def collective_quantiles(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """Per axis and op: count and the 0/5/25/50/75/95/100th percentiles of duration_s,
    transfer_s and blocking_s (enough to draw box plots without shipping every call)."""
    columns = []
    for value in ("duration_s", "transfer_s", "blocking_s"):
        q = f"quantile_cont({value}, [0, 0.05, 0.25, 0.5, 0.75, 0.95, 1])"
        columns.append(f"{q} AS {value}")
    return con.execute(
        f"SELECT axis, op, count(*) AS calls, {', '.join(columns)} FROM collectives "
        "WHERE run_id = ? GROUP BY ALL ORDER BY axis, op",
        [run_id],
    ).df()


def step_spans(
    con: duckdb.DuckDBPyConnection, run_id: str, step: int, ranks: tuple[int, int]
) -> pd.DataFrame:
    """Phases and collectives of one step for ranks ranks[0]..ranks[1] (included), with start
    and end in ms from the step's earliest start (clock offsets applied as in trace export)."""
    frame = pd.DataFrame(span_rows(con, run_id, step, step, ranks))
    if frame.empty:
        return frame
    origin = frame["start_ns"].min()
    frame["start_ms"] = (frame["start_ns"] - origin) / 1e6
    frame["end_ms"] = (frame["end_ns"] - origin) / 1e6
    return frame
