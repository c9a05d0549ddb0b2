"""A real per-op trace re-timed with one worker's compute changed: the recorded order of every
worker's operations is kept and their timestamps are derived again from a model of the GPU job,
written apart from the replay (analysis/replay*.py) so that a finding's saving can be checked
against something the analysis did not compute.

The model (Megatron-style, one worker = one (dp_rank, stage)):
- the host issues a worker's calls in recorded order; a call is one operation, or a send and a
  recv posted together (two rows with one start and one duration);
- compute, collectives, gc and the optimizer run in order on the compute stream, each from the
  later of its issue and the stream being free; the host does not wait for them;
- a point-to-point call posts at the later of its issue, the end of the compute before it (its
  tensor) and the point-to-point stream being free; each transfer in it completes its recorded
  transfer time after both ends posted, the call when all its transfers did; the host waits for
  the call (synchronous p2p), sends included;
- a collective ends its recorded transfer time after its last member arrived.
A transfer's recorded time is its end less the later of its ends' recorded starts; a
collective's, its end less its last member's recorded start. Every step starts at 0 on every
worker: launch delays are not modelled (the host is never late). A slow link is built the same
way: one worker's point-to-point transfers scaled (`slowed_link`).
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

P2P_DIRECTION = {"forward-send": (0, +1), "forward-recv": (0, -1), "backward-send": (1, -1),
                 "backward-recv": (1, +1)}  # fmt: skip
"""optype -> (direction, stage offset of the peer)."""
COMPUTE_OPS = ("forward-compute", "backward-compute")


def _members(optype: str, dp_rank: int, stage: int, dp: int, pp: int) -> tuple:
    if optype in ("grads-reduce-scatter", "params-all-gather"):
        return tuple((d, stage) for d in range(dp))
    if optype == "embedding-grads-all-reduce":
        return ((dp_rank, 0), (dp_rank, pp - 1))
    if optype == "optimizer-clip-main-grad":
        return tuple((d, s) for s in range(pp) for d in range(dp))
    return ((dp_rank, stage),)


def _transfer_key(row, pp: int) -> tuple:
    """Both ends of one point-to-point transfer: (direction, dp_rank, lower stage, seq_id)."""
    direction, offset = P2P_DIRECTION[row.optype]
    return (direction, row.dp_rank, min(row.stage, row.stage + offset), row.seq_id)


def recorded_transfers(step_rows: pd.DataFrame, pp: int, dp: int) -> tuple[dict, dict]:
    """({transfer key: seconds}, {(optype, members, n): seconds}) of one step's recording."""
    ends = step_rows["start_ts"] + step_rows["duration"]
    p2p, groups = {}, {}
    starts: dict = {}
    for row, end in zip(step_rows.itertuples(), ends, strict=True):
        if row.optype in P2P_DIRECTION:
            key = _transfer_key(row, pp)
            starts.setdefault(key, []).append((row.start_ts, end))
        elif row.optype not in (*COMPUTE_OPS, "gc", "optimizer"):
            key = (row.optype, _members(row.optype, row.dp_rank, row.stage, dp, pp), row.seq_id)
            starts.setdefault(key, []).append((row.start_ts, end))
    for key, pairs in starts.items():
        latest = max(start for start, _ in pairs)
        value = max(0.0, min(end for _, end in pairs) - latest)
        (p2p if isinstance(key[0], int) else groups)[key] = value
    return p2p, groups


Transfer = Callable[[tuple, float], float]
"""(a point-to-point transfer's key, its recorded seconds) -> the seconds it takes re-timed."""


def retime_step(step_rows: pd.DataFrame, pp: int, dp: int, duration: Callable[[object], float],
                transfer: Transfer | None = None) -> pd.DataFrame:  # fmt: skip
    """One step's rows with new start_ts/duration (module docstring); `duration(row)` gives each
    compute operation's time (the recorded one, scaled, or a peer's), `transfer` each
    point-to-point transfer's (as recorded where None)."""
    p2p_time, group_time = recorded_transfers(step_rows, pp, dp)
    if transfer is not None:
        p2p_time = {key: transfer(key, seconds) for key, seconds in p2p_time.items()}
    rows = step_rows.sort_values(["rank", "start_ts"], kind="stable")
    calls: dict[tuple, list[list]] = {}
    for (dp_rank, stage), worker in rows.groupby(["dp_rank", "stage"], sort=False):
        program: list[list] = []
        for row in worker.itertuples():
            last = program[-1] if program else None
            batched = (
                last is not None
                and row.optype in P2P_DIRECTION
                and last[0].optype in P2P_DIRECTION
                and (last[0].start_ts, last[0].duration) == (row.start_ts, row.duration)
            )
            if batched:
                last.append(row)
            else:
                program.append([row])
        calls[(dp_rank, stage)] = program
    state = {w: {"at": 0, "host": 0.0, "compute": 0.0, "p2p": 0.0} for w in calls}
    posted: dict = {}  # transfer key -> {side: post}
    arrived: dict = {}  # group key -> {worker: arrival}
    timed: dict[int, tuple[float, float]] = {}  # row index -> (start, end)

    def advance(worker) -> bool:
        s, call = state[worker], calls[worker][state[worker]["at"]]
        first = call[0]
        if first.optype in P2P_DIRECTION:
            post = max(s["host"], s["compute"], s["p2p"])
            keys = [_transfer_key(row, pp) for row in call]
            for row, key in zip(call, keys, strict=True):
                posted.setdefault(key, {}).setdefault("send" in row.optype, post)
            if any(len(posted[key]) < 2 for key in keys):
                return False
            end = max(max(posted[key].values()) + p2p_time[key] for key in keys)
            for row in call:
                timed[row.Index] = (post, end)
            s["p2p"] = s["host"] = end
            return True
        start = max(s["host"], s["compute"])
        if first.optype in (*COMPUTE_OPS, "gc", "optimizer"):
            end = start + duration(first)
        else:
            members = _members(first.optype, first.dp_rank, first.stage, dp, pp)
            group = arrived.setdefault((first.optype, members, first.seq_id), {})
            group.setdefault(worker, start)
            if len(group) < len(members):
                return False
            start = group[worker]
            end = max(group.values()) + group_time[(first.optype, members, first.seq_id)]
        timed[first.Index] = (start, end)
        s["compute"] = end
        return True

    progress = True
    while progress:
        progress = False
        for worker in calls:
            while state[worker]["at"] < len(calls[worker]) and advance(worker):
                state[worker]["at"] += 1
                progress = True
    stuck = [w for w in calls if state[w]["at"] < len(calls[w])]
    assert not stuck, f"re-timed step deadlocked on workers {stuck}"
    start = pd.Series({i: t[0] for i, t in timed.items()})
    end = pd.Series({i: t[1] for i, t in timed.items()})
    return step_rows.assign(
        start_ts=start.reindex(step_rows.index).to_numpy(),
        duration=(end - start).reindex(step_rows.index).to_numpy(),
    )


def retime(trace: pd.DataFrame, duration: Callable[[object], float],
           transfer: Transfer | None = None) -> pd.DataFrame:  # fmt: skip
    """Every step of `trace` re-timed with compute times from `duration(row)` and point-to-point
    transfer times from `transfer` (as recorded where None); steps follow one another (each
    starts 1 s after the previous one's end, on one clock)."""
    pp, dp = int(trace["stage"].max()) + 1, int(trace["dp_rank"].max()) + 1
    out, offset = [], 0.0
    for _, step_rows in trace.groupby("step", sort=True):
        step = retime_step(step_rows, pp, dp, duration, transfer)
        out.append(step.assign(start_ts=step["start_ts"] + offset))
        offset = float((step["start_ts"] + step["duration"]).max()) + offset + 1.0
    return pd.concat(out).astype({"start_ts": "float64", "duration": "float64"})


def step_times(trace: pd.DataFrame) -> pd.Series:
    """Per step: its last end less its first start."""
    ends = trace["start_ts"] + trace["duration"]
    return ends.groupby(trace["step"]).max() - trace["start_ts"].groupby(trace["step"]).min()


def slowed(factor: float, worker: tuple[int, int]) -> Callable[[object], float]:
    """Compute times as recorded, the worker's forward/backward × factor."""

    def duration(row) -> float:
        scale = factor if (row.dp_rank, row.stage) == worker and row.optype in COMPUTE_OPS else 1
        return float(row.duration) * scale

    return duration


def at_peers(trace: pd.DataFrame, factor: float, worker: tuple[int, int]):
    """Compute times as `slowed`, except the worker's forward/backward at the mean of its peers
    (the other dp_ranks of its stage) for the same (step, optype, seq_id)."""
    dp_rank, stage = worker
    compute = trace[trace["optype"].isin(COMPUTE_OPS) & (trace["stage"] == stage)
                    & (trace["dp_rank"] != dp_rank)]  # fmt: skip
    peers = compute.groupby(["step", "optype", "seq_id"], observed=True)["duration"].mean()
    slow = slowed(factor, worker)

    def duration(row) -> float:
        if (row.dp_rank, row.stage) == worker and row.optype in COMPUTE_OPS:
            return float(peers[(row.step, row.optype, row.seq_id)])
        return slow(row)

    return duration


def saving(trace: pd.DataFrame, factor: float, worker: tuple[int, int],
           steps: list[int]) -> tuple[float, pd.DataFrame]:  # fmt: skip
    """(the saving of `steps` when the slowed worker runs at its peers' pace, the slowed trace):
    1 - Σ step time with the worker at its peers' / Σ with it slowed, both re-timed here."""
    slow = retime(trace, slowed(factor, worker))
    return _saved(slow, retime(trace, at_peers(trace, factor, worker)), steps), slow


def _saved(slow: pd.DataFrame, fixed: pd.DataFrame, steps: list[int]) -> float:
    """1 - Σ step time of `fixed` / Σ of `slow` over `steps` (two re-timed traces)."""
    return float(1 - step_times(fixed)[steps].sum() / step_times(slow)[steps].sum())


def recorded(row) -> float:
    """Compute times as recorded."""
    return float(row.duration)


def slowed_link(factor: float, worker: tuple[int, int]) -> Transfer:
    """Point-to-point transfer times as recorded, those with the worker at one end × factor (a
    slow NIC or link of that worker: its sends and its receives)."""
    dp_rank, stage = worker

    def transfer(key: tuple, seconds: float) -> float:
        _, key_dp, low, _ = key  # (direction, dp_rank, lower stage, seq_id)
        return seconds * factor if key_dp == dp_rank and stage in (low, low + 1) else seconds

    return transfer


def link_saving(trace: pd.DataFrame, factor: float, worker: tuple[int, int],
                steps: list[int]) -> tuple[float, pd.DataFrame]:  # fmt: skip
    """(the saving of `steps` when the worker's point-to-point transfers take their recorded
    time again, the trace with them × factor): as `saving`, for a slow link."""
    slow = retime(trace, recorded, slowed_link(factor, worker))
    return _saved(slow, retime(trace, recorded), steps), slow
