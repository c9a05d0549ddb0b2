"""A window of steps of one run as a Chrome / Perfetto trace (the Trace Event Format's JSON
object form): one process per rank, with threads `step`, `phases` and `collectives`; every
span a complete ("X") event with its timestamp and duration in microseconds.

Timestamps are the ranks' epoch clocks corrected by their measured offset to rank 0 (only for
ranks on another host, as in the store's transfer/blocking split), relative to the window's
first event.
"""

from __future__ import annotations

import duckdb

THREADS = {"ranktrace.step": (0, "step"), "ranktrace.phase": (1, "phases"),
           "ranktrace.collective": (2, "collectives")}  # fmt: skip


SPAN_COLUMNS = ("rank", "pp", "dp", "tp", "host", "step", "name", "phase", "micro_batch", "op",
                "axis", "group_size", "bytes", "peer", "start_ns", "end_ns")  # fmt: skip


def span_rows(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    first_step: int,
    last_step: int,
    ranks: tuple[int, int] | None = None,
) -> list[dict]:
    """Every span of steps first_step..last_step (of ranks ranks[0]..ranks[1], both included,
    or all), with SPAN_COLUMNS; times corrected by the rank's clock offset to rank 0 when it
    is on another host."""
    low, high = ranks if ranks is not None else (0, 2**31 - 1)
    rows = con.execute(
        """
        WITH rank0 AS (SELECT host FROM ranks WHERE run_id = $1 AND rank = 0),
        offsets AS (
            SELECT r.rank, r.pp, r.dp, r.tp, r.host,
                   CASE WHEN r.host IS DISTINCT FROM (SELECT host FROM rank0)
                        THEN coalesce(r.clock_offset_ns, 0) ELSE 0 END AS offset_ns
            FROM ranks r WHERE r.run_id = $1
        )
        SELECT s.rank, o.pp, o.dp, o.tp, o.host, s.step, s.name, s.phase, s.micro_batch, s.op,
               s.axis, s.group_size, s.bytes, s.peer,
               s.start_ns - coalesce(o.offset_ns, 0) AS start_ns,
               s.end_ns - coalesce(o.offset_ns, 0) AS end_ns
        FROM spans s LEFT JOIN offsets o USING (rank)
        WHERE s.run_id = $1 AND s.step BETWEEN $2 AND $3 AND s.rank BETWEEN $4 AND $5
        ORDER BY s.rank, start_ns
        """,
        [run_id, first_step, last_step, low, high],
    ).fetchall()
    return [dict(zip(SPAN_COLUMNS, row, strict=True)) for row in rows]


def event_name(row: dict) -> str:
    """`step`, a phase (`forward mb1`), or a collective (`all_reduce tp`)."""
    if row["name"] == "ranktrace.step":
        return "step"
    if row["name"] == "ranktrace.phase":
        mb = row["micro_batch"]
        return row["phase"] if mb is None or mb < 0 else f"{row['phase']} mb{mb}"
    return f"{row['op']} {row['axis']}"


def chrome_trace(
    con: duckdb.DuckDBPyConnection, run_id: str, first_step: int, last_step: int
) -> dict:
    """The trace of steps first_step..last_step (both included) of all ranks."""
    rows = span_rows(con, run_id, first_step, last_step)
    if not rows:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {"run_id": run_id}}
    origin = min(row["start_ns"] for row in rows)
    events: list[dict] = []
    seen_ranks = set()
    for row in rows:
        rank, name = row["rank"], row["name"]
        if rank not in seen_ranks:
            seen_ranks.add(rank)
            label = (
                f"rank {rank} (pp={row['pp']} dp={row['dp']} tp={row['tp']}) {row['host'] or ''}"
            )
            events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                           "args": {"name": label.strip()}})  # fmt: skip
            events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                           "args": {"sort_index": rank}})  # fmt: skip
            for tid, thread in THREADS.values():
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                               "args": {"name": thread}})  # fmt: skip
        tid, category = THREADS[name]
        args = {"step": row["step"]}
        if name == "ranktrace.collective":
            args.update({k: row[k] for k in ("op", "axis", "group_size", "bytes")})
            if row["peer"] is not None and row["peer"] >= 0:
                args["peer"] = row["peer"]
        events.append({
            "ph": "X", "name": event_name(row), "cat": category, "pid": rank, "tid": tid,
            "ts": (row["start_ns"] - origin) / 1e3,
            "dur": max(row["end_ns"] - row["start_ns"], 0) / 1e3, "args": args,
        })  # fmt: skip
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"run_id": run_id, "steps": f"{first_step}-{last_step}"},
    }
