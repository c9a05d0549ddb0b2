"""The evidence of a random imbalance (spread slowness), in words: which rank is the slowest
of its stage step by step, how one micro-batch index's compute spreads across the dp ranks,
and whether that compute follows the micro-batch's tokens (varying sequence lengths); and,
where it does, whether a compute straggler is slow for its tokens or only had long ones.
"""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd

from ranktrace.analysis.peers import WARMUP_STEPS
from ranktrace.analysis.stragglers import MIN_SLOWDOWN

FOLLOWS_TOKENS_R = 0.5
"""Compute follows the tokens when their correlation is at least this: the tokens explain a
quarter of the compute's variance or more (none when compute ignores them; fixed-length
micro-batches have one token count, nothing to correlate). Compute is the rank's own work: on
a CPU device, the main thread's CPU time of each rank's forward in a step against the step's
tokens (a wall time also holds the rank's waits for a core: on ranks sharing 2 cores, lengths
16-128, six runs gave r = 0.21-0.76 by the micro-batches' wall times, 0.84-0.96 by CPU time);
elsewhere each micro-batch's forward wall time against its tokens."""
SHOWN_RANKS = 4
"""Ranks named in "the slowest rank changes from step to step"."""

_FORWARDS_SQL = """
SELECT s.rank, s.step, b.pp, b.tp, s.micro_batch, (s.end_ns - s.start_ns) / 1e9 AS seconds,
       s.tokens, b.forward_cpu_s AS step_forward_cpu_s, d.device
FROM span_records s JOIN steps b USING (run_id, rank, step)
LEFT JOIN (SELECT rank, any_value(device) AS device FROM ranks WHERE run_id = $1
           GROUP BY rank) d USING (rank)
WHERE s.run_id = $1 AND s.name = 'ranktrace.phase' AND s.phase = 'forward'
  AND s.micro_batch >= 0 AND s.step >= $2
"""


def forward_spans(con: duckdb.DuckDBPyConnection, run_id: str) -> pd.DataFrame:
    """Every micro-batch's forward after the warm-up step: rank, step, pp, tp, micro_batch,
    seconds, tokens (NULL where not recorded), step_forward_cpu_s (the main thread's CPU time
    of the rank's forward phase in that step, NULL where not recorded), device."""
    return con.execute(_FORWARDS_SQL, [run_id, WARMUP_STEPS]).df()


def evidence(frame: pd.DataFrame, forwards: pd.DataFrame) -> list[str]:
    """What shows slowness spread over ranks (`frame`: the run's step_breakdown rows,
    `forwards`: `forward_spans`), in words."""
    lines = [_slowest_ranks(frame)] if not frame.empty else []
    if forwards.empty:
        return lines
    spread = _micro_batch_spread(forwards)
    if spread is not None:
        lines.append(spread)
    line = follows_tokens(forwards)[1]
    return lines + ([line] if line else [])


def _slowest_ranks(frame: pd.DataFrame) -> str:
    """`the slowest rank of a stage changes from step to step: rank 3 in 6 of 23 steps, ...`."""
    own = frame["own_s"] - frame["core_wait_s"].fillna(0.0)
    slowest = frame.loc[own.groupby([frame["step"], frame["pp"]]).idxmax(), "rank"]
    counts = slowest.value_counts()
    steps = frame["step"].nunique()
    named = ", ".join(f"rank {int(rank)} in {n}" for rank, n in counts.head(SHOWN_RANKS).items())
    more = f" and {len(counts) - SHOWN_RANKS} more ranks" if len(counts) > SHOWN_RANKS else ""
    return (f"the slowest rank of a stage changes from step to step: {named} of {steps} "
            f"steps{more}")  # fmt: skip


def _micro_batch_spread(forwards: pd.DataFrame) -> str | None:
    """How one micro-batch index's forward time differs across the dp ranks of a stage: the
    median over (step, stage, tp rank, index) of (max - min) / mean."""
    groups = forwards.groupby(["step", "pp", "tp", "micro_batch"])["seconds"]
    if groups.size().max() < 2:
        return None  # one dp rank: nothing to spread over
    sizes = groups.size()
    gap = ((groups.max() - groups.min()) / groups.mean())[sizes >= 2]
    return (f"the same micro-batch index takes {100 * float(gap.median()):.0f}% longer on the "
            f"slowest dp rank than the fastest (median over steps and stages)")  # fmt: skip


def follows_tokens(forwards: pd.DataFrame) -> tuple[bool, str | None]:
    """(whether, in words) compute per micro-batch follows its tokens, where the micro-batches'
    token counts were recorded and differ: then spread over ranks is the job's own imbalance
    (varying sequence lengths), not the host's scheduling."""
    known = forwards.dropna(subset=["tokens"])
    if known.empty or known["tokens"].nunique() < 2:
        return False, None
    work, measure = _compute_and_tokens(known)
    # within one rank's stage and tp share, so the stages' different work is not correlated
    centred = work.groupby(["pp", "tp"])[["seconds", "tokens"]].transform(lambda c: c - c.mean())
    r = float(np.corrcoef(centred["seconds"], centred["tokens"].astype(float))[0, 1])
    if not r >= FOLLOWS_TOKENS_R:
        return False, (f"the micro-batches' tokens vary, but their compute ({measure}) does "
                       f"not follow them (r = {r:.2f})")  # fmt: skip
    low, high = int(known["tokens"].min()), int(known["tokens"].max())
    return True, (f"compute follows the micro-batches' tokens ({low}-{high} tokens a "
                  f"micro-batch; {measure}, r = {r:.2f}): varying sequence lengths")  # fmt: skip


def _compute_and_tokens(known: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """(rank, step, pp, tp, seconds, tokens rows; what they measure) for FOLLOWS_TOKENS_R and
    `per_token_slowdown`: on CPU devices with CPU time recorded, one row per rank and step (its
    forward's CPU time, its micro-batches' tokens summed); else one per micro-batch (its
    forward's wall time)."""
    on_cpu = known["device"].eq("cpu").all() and known["step_forward_cpu_s"].notna().all()
    if not on_cpu:
        columns = ["rank", "step", "pp", "tp", "seconds", "tokens"]
        return known[columns].assign(micro_batches=1), "each micro-batch's forward time"
    steps = known.groupby(["rank", "step", "pp", "tp"], as_index=False).agg(
        seconds=("step_forward_cpu_s", "first"), tokens=("tokens", "sum"),
        micro_batches=("tokens", "size"))  # fmt: skip
    return steps, "the forward's CPU time per rank and step"


def micro_batch_cost(forwards: pd.DataFrame) -> tuple[float, float] | None:
    """(seconds, seconds per token): a micro-batch's forward compute is the first plus the
    second × its tokens, fitted over every rank and step on the compute FOLLOWS_TOKENS_R reads
    (on CPU devices the forward's CPU time per rank and step, each row `micro_batches`
    micro-batches: their wall times also hold waits for a core, 2.0-2.7x the per-micro-batch cost
    and 1.6-1.8x the per-token cost the CPU times gave, 3 runs beside another job); None without
    tokens, or where compute does not grow with them."""
    known = forwards.dropna(subset=["tokens"])
    if known.empty or known["tokens"].nunique() < 2:
        return None
    work, _ = _compute_and_tokens(known)
    design = work[["micro_batches", "tokens"]].to_numpy(dtype=float)
    (per_batch, per_token), *_ = np.linalg.lstsq(design, work["seconds"].to_numpy(float),
                                                 rcond=None)  # fmt: skip
    return None if per_token <= 0 else (float(per_batch), float(per_token))


def per_token_slowdown(forwards: pd.DataFrame, finding) -> float | None:
    """A compute straggler's slowdown once its tokens are accounted for: over the finding's
    steps, the median of its forward compute over the compute its tokens predict (one linear
    fit per stage and tp share, over every rank and step), against the same median of the
    other ranks of its stage; None where tokens were not recorded or it has no peer. A rank
    whose micro-batches happened to be long for a stretch of steps is slow by the raw
    comparison and not by this one. Compute is measured as for FOLLOWS_TOKENS_R: on CPU
    devices the forward's CPU time per rank and step, as the compute finding itself is (its
    wall time also holds its waits for a core, which on ranks sharing cores with other work
    are as large as the tokens' effect)."""
    known = forwards.dropna(subset=["tokens"])
    if finding.pp is None or known.empty or known["tokens"].nunique() < 2:
        return None
    work, _ = _compute_and_tokens(known)
    return _for_tokens(work, finding.pp, finding.tp, finding.rank, finding.first_step,
                       finding.last_step)  # fmt: skip


def explained_by_tokens(forwards: pd.DataFrame) -> frozenset[int]:
    """The ranks whose forward compute over the whole run is under MIN_SLOWDOWN × their stage
    peers' once their tokens are accounted for (`per_token_slowdown`): whatever share of the
    spread's excess compute such a rank holds, its micro-batches' tokens explain it (a dp 2
    run of lengths 16-128 gave rank 1 78% of it, 1.30x its peer's compute over steps 11-29 and
    0.97x for its tokens). Empty where tokens were not recorded or do not vary."""
    known = forwards.dropna(subset=["tokens"])
    if known.empty or known["tokens"].nunique() < 2:
        return frozenset()
    work, _ = _compute_and_tokens(known)
    first, last = int(work["step"].min()), int(work["step"].max())
    places = work.drop_duplicates("rank")[["rank", "pp", "tp"]].itertuples(index=False)
    ratios = {int(rank): _for_tokens(work, pp, tp, rank, first, last) for rank, pp, tp in places}
    return frozenset(rank for rank, ratio in ratios.items()
                     if ratio is not None and ratio < MIN_SLOWDOWN)  # fmt: skip


def _for_tokens(work: pd.DataFrame, pp: int, tp: int, rank: int, first: int,
                last: int) -> float | None:  # fmt: skip
    """`per_token_slowdown` of `rank` (of stage `pp`, tp share `tp`) over steps first-last, on
    `_compute_and_tokens` rows `work`."""
    stage = work[(work["pp"] == pp) & (work["tp"] == tp)]
    slope, intercept = np.polyfit(stage["tokens"].astype(float), stage["seconds"], 1)
    stretch = stage[stage["step"].between(first, last)]
    predicted = intercept + slope * stretch["tokens"].astype(float)
    if slope <= 0 or (predicted <= 0).any():
        return None
    ratio = stretch["seconds"] / predicted
    mine = ratio[stretch["rank"] == rank]
    peers = ratio[stretch["rank"] != rank]
    if mine.empty or peers.empty:
        return None
    return float(mine.median() / peers.median())
