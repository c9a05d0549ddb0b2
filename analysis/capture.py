"""How complete a run's capture is: the ranks of its world that recorded no step, and the ranks
whose steps stop before the others' (a rank that died, hung or lost its telemetry). Said before
any finding (the findings are about the ranks and steps that were recorded); a run still
running is not judged on where its ranks are now.

An imported per-op trace folds each (dp, stage)'s tensor-parallel ranks into one worker (its
run.json `folded`, importers/perop.py `folding`): there the capture is judged per worker, and a
worker the trace has no rows of is named by the job's ranks it stood for."""

from __future__ import annotations

import duckdb


def partial_capture(con: duckdb.DuckDBPyConnection, run_id: str, world_size: int | None,
                    status: str | None, folded: dict | None = None) -> dict | None:  # fmt: skip
    """{"ranks_without_steps", "stopped_early" [{rank, last_step}], "last_step", "lines"}, or
    None when every rank of the world recorded up to the run's last step (or nothing was
    recorded at all: the verdict says that). `folded`: the run's folded workers (module
    docstring); `ranks_without_steps` then holds the job's ranks of the workers without rows,
    and `workers_without_steps` those workers."""
    rows = con.execute("SELECT rank, max(step) AS last FROM steps WHERE run_id = ? GROUP BY rank",
                       [run_id]).fetchall()  # fmt: skip
    if not rows:
        return None
    last = {int(rank): int(step) for rank, step in rows}
    run_last = max(last.values())
    early = [] if status == "running" else [
        {"rank": rank, "last_step": step} for rank, step in sorted(last.items())
        if step < run_last]  # fmt: skip
    if folded:
        return _folded_capture(folded, last, early, run_last)
    world = int(world_size) if world_size else max(last) + 1
    missing = [rank for rank in range(world) if rank not in last]
    if not missing and not early:
        return None
    lines = []
    if missing:
        lines.append(f"capture: {_ranks(missing)} of {world} recorded no step: the findings are "
                     "about the others (see the run's events and its ranks' output)")  # fmt: skip
    lines += [_stopped_line(f"rank {stop['rank']}", stop, run_last) for stop in early]
    return {"ranks_without_steps": missing, "stopped_early": early, "last_step": run_last,
            "lines": lines}  # fmt: skip


def _folded_capture(folded: dict, last: dict[int, int], early: list[dict],
                    run_last: int) -> dict | None:  # fmt: skip
    """partial_capture of a run whose workers each stand for `ranks_per_worker` job ranks."""
    positions = {int(w["worker"]): w for w in folded["workers"]}
    lost = [w for worker, w in sorted(positions.items()) if worker not in last]
    if not lost and not early:
        return None
    job_ranks = [rank for w in lost for rank in range(w["ranks"][0], w["ranks"][1] + 1)]
    lines = []
    if lost:
        workers = "; ".join(f"worker {w['worker']}: dp {w['dp']}, stage {w['pp']}" for w in lost)
        lines.append(f"capture: {_ranks(job_ranks)} of {folded['world']} recorded no step (the "
                     f"trace has no rows of {workers}): the findings are about the "
                     "others")  # fmt: skip
    lines += [_stopped_line(_worker(positions[stop["rank"]]), stop, run_last) for stop in early]
    return {"ranks_without_steps": job_ranks, "workers_without_steps": [w["worker"] for w in lost],
            "stopped_early": early, "last_step": run_last, "lines": lines}  # fmt: skip


def folded_note(folded: dict | None) -> list[str]:
    """The note of a run whose workers stand for several ranks each (module docstring)."""
    if not folded or folded["ranks_per_worker"] <= 1:
        return []
    return [f"the trace records one worker per (dp, stage) with its {folded['axis']} ranks "
            f"folded in: its {len(folded['workers'])} workers stand for the job's "
            f"{folded['world']} ranks ({folded['axis']} {folded['ranks_per_worker']}); findings "
            "name a worker by its rank in the trace"]  # fmt: skip


def unreplayed_note(partial: dict | None, slowdown: float | None) -> list[str]:
    """Why a run with ranks that recorded nothing has no what-if replay, where it has none."""
    if slowdown is not None or not partial or not partial["ranks_without_steps"]:
        return []
    return [
        "no what-if replay: the others' steps wait on the ranks that recorded nothing "
        "(capture), so there is no slowdown S, and costs are estimated from the ranks' own "
        "times, not replayed"
    ]


def _worker(worker: dict) -> str:
    first, last = worker["ranks"]
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    return f"worker {worker['worker']} (dp {worker['dp']}, stage {worker['pp']}: the job's {ranks})"


def _stopped_line(who: str, stop: dict, run_last: int) -> str:
    return (f"capture: {who} recorded no step after step {stop['last_step']} (the others up to "
            f"step {run_last}): from step {stop['last_step'] + 1} the findings are about the "
            "others")  # fmt: skip


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
