"""Fault tolerance as the telemetry shows it: restarts and the work they redid, what checkpoints
cost and how much work the chosen cadence puts at risk, and hung ranks.

Hung ranks, MegaScale-style (Jiang et al., NSDI'24): before a collective timeout ends the job,
every rank records the operation it is in (`in_flight` events). A rank that its group's other
members wait for in a collective, while it is itself in no collective, is the hung one; ranks
waiting in a different collective are its victims (they wait for someone else).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import duckdb
import numpy as np

from ranktrace.telemetry import names


def _events(con: duckdb.DuckDBPyConnection, run_id: str, kinds: tuple[str, ...]) -> list[dict]:
    marks = ", ".join("?" for _ in kinds)
    frame = con.execute(  # `*`: a store ingested by an older ranktrace has no attempt column
        f"SELECT * FROM events WHERE run_id = ? AND kind IN ({marks}) ORDER BY time_ns",
        [run_id, *kinds],
    ).df()
    if "attempt" not in frame:
        frame["attempt"] = 0
    out = []
    for rank, step, kind, detail, attempt, time_ns in frame[
        ["rank", "step", "kind", "detail", "attempt", "time_ns"]
    ].itertuples(index=False):
        try:
            parsed = json.loads(detail) if detail else {}
        except json.JSONDecodeError:
            parsed = {"text": detail}
        fields = parsed if isinstance(parsed, dict) else {}
        out.append({"rank": int(rank), "step": int(step), "kind": kind, "attempt": int(attempt),
                    "time_ns": int(time_ns), **fields})  # fmt: skip
    return out


@dataclass
class Restart:
    """One attempt after the first: where it resumed and what the interruption cost."""

    attempt: int
    how: str
    """"restart" (torch elastic, --max-restarts) or "resume" (ranktrace train --resume)."""
    resumed_from_step: int
    checkpoint: str | None
    steps_redone: int
    """Steps the earlier attempt had finished after the checkpoint: trained twice."""
    redone_s: float
    """Their time in the earlier attempt (the work lost to the failure)."""
    downtime_s: float | None
    """From the earlier attempt's last finished step to this attempt's first step start."""
    cause: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def restarts(con: duckdb.DuckDBPyConnection, run_id: str) -> list[Restart]:
    """Every restart or resume of the run, oldest first."""
    by_attempt = {e["attempt"]: e for e in _events(con, run_id, (names.EVENT_RESTART,))}
    restart_events = [by_attempt[a] for a in sorted(by_attempt)]  # one per attempt
    if not restart_events:
        return []
    steps = con.execute(
        "SELECT attempt, step, step_time_s, start_ns, end_ns FROM attempt_steps "
        "WHERE run_id = ? ORDER BY attempt, step",
        [run_id],
    ).df()
    causes = _events(con, run_id, (names.EVENT_CRASH, names.EVENT_IN_FLIGHT))
    out = []
    for event in restart_events:
        attempt, start = int(event["attempt"]), int(event.get("resumed_from_step", event["step"]))
        earlier = steps[steps["attempt"] < attempt]
        previous = (
            earlier[earlier["attempt"] == earlier["attempt"].max()] if len(earlier) else earlier
        )
        redone = previous[previous["step"] >= start]
        mine = steps[steps["attempt"] == attempt]
        downtime = None
        if len(previous) and len(mine):
            downtime = float((mine["start_ns"].min() - previous["end_ns"].max()) / 1e9)
        before = [c for c in causes if c["attempt"] == attempt - 1]  # what ended the last one
        cause = None
        if before:
            last = before[-1]
            cause = (f"rank {last['rank']} crashed at step {last['step']}"
                     if last["kind"] == names.EVENT_CRASH
                     else f"collective timeout at step {last['step']}")  # fmt: skip
        out.append(
            Restart(attempt, event.get("how", "restart"), start, event.get("checkpoint"),
                    len(redone), float(redone["step_time_s"].sum()), downtime, cause)
        )  # fmt: skip
    return out


def checkpoint_summary(
    con: duckdb.DuckDBPyConnection, run_id: str, config: dict, step_time_s: float | None
) -> dict | None:
    """What checkpoints cost (blocking and background parts, bytes), and the expected work
    lost per failure at this cadence: half an interval between checkpoints on average (a
    failure strikes at a uniformly random time) plus the save still in flight. None when the
    run neither checkpointed nor was asked to."""
    every, minutes = int(config.get("checkpoint_every") or 0), config.get("checkpoint_minutes") or 0
    saves = _events(con, run_id, (names.EVENT_CHECKPOINT_SAVED,))
    failed = _events(con, run_id, (names.EVENT_CHECKPOINT_FAILED,))
    complete = _events(con, run_id, (names.EVENT_CHECKPOINT_COMPLETE,))
    if not (every or minutes or saves or failed):
        return None
    by_save: dict[tuple, list[dict]] = {}
    for save in saves:
        by_save.setdefault((save["attempt"], save["next_step"]), []).append(save)
    blocking = [max(s["blocking_s"] for s in group) for group in by_save.values()]
    background = [max(s["async_s"] or 0.0 for s in group) for group in by_save.values()]
    written = [sum(s["bytes"] or 0 for s in group) for group in by_save.values()]
    intervals = []
    if every and step_time_s:
        intervals.append(every * step_time_s)
    if minutes:
        intervals.append(60.0 * minutes)
    interval_s = min(intervals) if intervals else None
    save_s = float(np.median(np.add(blocking, background))) if blocking else 0.0
    median_blocking = float(np.median(blocking)) if blocking else None
    return {
        "every_steps": every or None,
        "every_minutes": minutes or None,
        "sync": bool(config.get("checkpoint_sync")),
        "saves": len(by_save),
        "complete": len(complete),
        "failed": len(failed),
        "last_complete_step": max((c["next_step"] for c in complete), default=None),
        "blocking_s": median_blocking,
        "async_s": float(np.median(background)) if background else None,
        "bytes": int(np.median(written)) if written else None,
        "interval_s": interval_s,
        "overhead_pct": (100.0 * median_blocking / interval_s
                         if median_blocking is not None and interval_s else None),
        "expected_lost_work_s": interval_s / 2 + save_s if interval_s else None,
    }  # fmt: skip


@dataclass
class Hang:
    """A rank the others waited for until the collective timeout."""

    rank: int
    step: int
    state: str
    """What the hung rank itself was doing: "in no collective", or the collective it was in."""
    waited_s: float | None
    blocked: list[dict]
    """The collectives its peers waited in: op, axis, group, waiting ranks, seconds waited."""

    def to_dict(self) -> dict:
        return asdict(self)


def _same_instance(a: dict, b: dict) -> bool:
    """Whether two in-flight records are the same collective (transfers: the same pair)."""
    if a["op"] is None or b["op"] is None or a["axis"] != b["axis"]:
        return False
    if sorted(a["group"]) != sorted(b["group"]):
        return False
    point_to_point = a["op"] in ("send", "recv", "send_recv")
    return point_to_point or a["seq"] == b["seq"]


def hangs(con: duckdb.DuckDBPyConnection, run_id: str) -> list[Hang]:
    """Ranks missing from collectives their peers timed out in, per attempt. A missing rank in
    no collective (or that recorded nothing) is hung; when every missing rank waits elsewhere
    (a mismatched or deadlocked collective), those ranks are named with what they wait in."""
    states = _events(con, run_id, (names.EVENT_IN_FLIGHT,))
    out = []
    for attempt in sorted({s["attempt"] for s in states}):
        latest = {s["rank"]: s for s in states if s["attempt"] == attempt}
        blocked: dict[int, list[dict]] = {}
        for rank, state in latest.items():
            if state["op"] is None:
                continue
            for member in state["group"]:
                other = latest.get(member)
                if member != rank and (other is None or not _same_instance(state, other)):
                    blocked.setdefault(member, []).append(
                        {"rank": rank, "op": state["op"], "axis": state["axis"],
                         "group": state["group"], "waited_s": state["waited_s"]}
                    )  # fmt: skip
        idle = [r for r in blocked if latest.get(r) is None or latest[r]["op"] is None]
        for rank in sorted(idle or blocked):
            state = latest.get(rank)
            waits = blocked[rank]
            if state is None:
                where, step, waited = "recorded nothing (dead or unresponsive)", None, None
            elif state["op"] is None:
                where, step, waited = "in no collective", state["step"], state["waited_s"]
            else:
                where = f"in {state['op']} on {state['axis']} (group {state['group']})"
                step, waited = state["step"], state["waited_s"]
            if step is None:
                step = min(w_state["step"] for w_state in latest.values())
            out.append(Hang(rank, int(step), where, waited, waits))
    return out
