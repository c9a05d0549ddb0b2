"""How complete a run's capture is: the ranks of its world that recorded no step, and the ranks
whose steps stop before the others' (a rank that died, hung or lost its telemetry). Said before
any finding (the findings are about the ranks and steps that were recorded); a run still
running is not judged on where its ranks are now."""

from __future__ import annotations

import duckdb


def partial_capture(con: duckdb.DuckDBPyConnection, run_id: str, world_size: int | None,
                    status: str | None) -> dict | None:  # fmt: skip
    """{"ranks_without_steps", "stopped_early" [{rank, last_step}], "last_step", "lines"}, or
    None when every rank of the world recorded up to the run's last step (or nothing was
    recorded at all: the verdict says that)."""
    rows = con.execute("SELECT rank, max(step) AS last FROM steps WHERE run_id = ? GROUP BY rank",
                       [run_id]).fetchall()  # fmt: skip
    if not rows:
        return None
    last = {int(rank): int(step) for rank, step in rows}
    run_last = max(last.values())
    world = int(world_size) if world_size else max(last) + 1
    missing = [rank for rank in range(world) if rank not in last]
    early = [] if status == "running" else [
        {"rank": rank, "last_step": step} for rank, step in sorted(last.items())
        if step < run_last]  # fmt: skip
    if not missing and not early:
        return None
    lines = []
    if missing:
        lines.append(f"capture: {_ranks(missing)} of {world} recorded no step: the findings are "
                     "about the others (see the run's events and its ranks' output)")  # fmt: skip
    for stop in early:
        lines.append(f"capture: rank {stop['rank']} recorded no step after step "
                     f"{stop['last_step']} (the others up to step {run_last}): from step "
                     f"{stop['last_step'] + 1} the findings are about the others")  # fmt: skip
    return {"ranks_without_steps": missing, "stopped_early": early, "last_step": run_last,
            "lines": lines}  # fmt: skip


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
