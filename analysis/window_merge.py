"""A long run's report from its windows, each diagnosed apart (analysis/window_report.py, over
the windows of analysis/windows.py `analysis_spans`), so that the memory a report needs follows
ranks × a window, not the run's length. What the windows found is merged:

- Per-step series (the job's step time; MFU, tokens/s and the parts' shares per step) are
  concatenated: the run's medians and efficiency drops are those of all its steps.
- S is weighted over the windows. With T_w a window's replayed time (its measured job steps,
  scaled by its replay's replayed / measured) and I_w = T_w / S_w its ideal: S = Σ T_w / Σ I_w.
  A factor S_X, and a cause's S without it, average over the ideals, Σ I_w S_X,w / Σ I_w (a
  window that did not price X: 1 for S_X, S_w for S without it).
- A cost (a finding's, a cause's saving) is a share of the run's time, Σ T_w cost_w / Σ T_w,
  a window without it adding nothing; the shares of S - 1 weight by each window's excess,
  T_w - I_w. Per window, a lone cause saves (1 - 1/S_X) of the window's time (self_check.py);
  these weights keep that true of the sums.
- Findings of one rank (or set of candidates), kind, axis and cause are joined: their steps
  span theirs, their slowdown and step times are weighted by their slow steps, and the evidence
  and remedy are those of the window where the finding cost most (its predicted gain weighted
  as the cost). A finding is reported when it is material over the run (stragglers.is_material;
  an imbalance MIN_COST_PCT): 15% of one window in ten is 1.5% of the run, a note.
"""

from __future__ import annotations

import dataclasses

import pandas as pd

from ranktrace.analysis.causes import cause_of
from ranktrace.analysis.imbalances import Imbalance
from ranktrace.analysis.run_part import Part
from ranktrace.analysis.slowdown import MAX_RANK_FACTORS
from ranktrace.analysis.stragglers import MIN_COST_PCT, Straggler, is_material


def merge_parts(parts: list[Part]) -> Part:
    """The run's Part from its windows' (module docstring), windows in step order."""
    times = [_replayed_time(part) for part in parts]
    total = sum(times)
    notes: list[str] = []
    stragglers = _joined(parts, times, total, "stragglers", _straggler_key, _merged_straggler)
    imbalances = _joined(parts, times, total, "imbalances", _imbalance_key, _merged_imbalance)
    kept_stragglers = [f for f in stragglers if _material(f)]
    kept_imbalances = [i for i in imbalances if i.cost_pct >= MIN_COST_PCT]
    for finding in [*stragglers, *imbalances]:
        if finding not in kept_stragglers and finding not in kept_imbalances:
            notes.append(_set_aside_note(finding))
    for part in parts:
        notes += [note for note in part.notes if note not in notes]
    kept_stragglers.sort(key=lambda f: -f.cost_pct)
    kept_imbalances.sort(key=lambda i: -i.cost_pct)
    per_step = [part.per_step for part in parts if not part.per_step.empty]
    replayed = _merged_replay(parts, times)
    _without_unreported_causes(replayed, [*kept_stragglers, *kept_imbalances])
    return Part(
        kept_stragglers, kept_imbalances, notes,
        pd.concat([part.job_step for part in parts]).sort_index(),
        pd.concat(per_step).sort_index() if per_step else parts[0].per_step, replayed,
    )  # fmt: skip


def _replayed_time(part: Part) -> float:
    """T_w: the window's measured job time, scaled by its replay's replayed / measured."""
    measured = float(part.job_step.sum())
    detail = part.replayed.get("slowdown_detail") or {}
    if detail.get("measured_s"):
        return measured * detail["replayed_s"] / detail["measured_s"]
    return measured


def _share(found: list[tuple[int, object]], times: list[float], total: float,
           attribute: str) -> float | None:  # fmt: skip
    """Σ T_w × value_w / total over the windows a finding was found in (None: none had it)."""
    values = [(times[w], getattr(f, attribute)) for w, f in found]
    if total <= 0 or all(value is None for _, value in values):
        return None
    return round(sum(t * v for t, v in values if v is not None) / total, 2)


def _joined(parts, times, total, attribute, key, merged) -> list:
    """The findings of every window under `attribute`, those of one `key` merged into one."""
    groups: dict[tuple, list[tuple[int, object]]] = {}
    for window, part in enumerate(parts):
        for finding in getattr(part, attribute):
            groups.setdefault(key(finding), []).append((window, finding))
    return [merged(found, times, total) for found in groups.values()]


def _straggler_key(finding: Straggler) -> tuple:
    return (finding.rank, finding.kind, finding.axis, finding.cause,
            tuple(sorted(finding.candidates)), tuple(finding.hosts))  # fmt: skip


def _imbalance_key(imbalance: Imbalance) -> tuple:
    return (imbalance.kind, imbalance.stage)


def _costliest(found: list[tuple[int, object]], times: list[float]):
    """The finding of the window where it cost most."""
    return max(found, key=lambda wf: times[wf[0]] * (wf[1].cost_pct or 0.0))[1]


def _merged_straggler(found: list[tuple[int, Straggler]], times: list[float],
                      total: float) -> Straggler:  # fmt: skip
    findings = [f for _, f in found]
    best = _costliest(found, times)
    slow = sum(f.slow_steps for f in findings)

    def by_slow_steps(attribute: str) -> float:
        if not slow:
            return float(getattr(best, attribute))
        return sum(getattr(f, attribute) * f.slow_steps for f in findings) / slow

    chronic = any(f.pattern == "chronic" for f in findings)
    evidence = list(best.evidence)
    if len(found) > 1:
        spans = ", ".join(f"{f.first_step}-{f.last_step}" for f in findings)
        evidence.append(f"found in {len(found)} windows of the run (steps {spans}), joined")
    return dataclasses.replace(
        best, first_step=min(f.first_step for f in findings),
        last_step=max(f.last_step for f in findings),
        slowdown=round(by_slow_steps("slowdown"), 3),
        cost_pct=_share(found, times, total, "cost_pct") or 0.0,
        pattern="chronic" if chronic else "transient", slow_steps=slow,
        step_time_s=by_slow_steps("step_time_s"),
        whatif_step_time_s=by_slow_steps("whatif_step_time_s"),
        saved_pct=_share(found, times, total, "saved_pct"),
        dedicated_core_cost_pct=_share(found, times, total, "dedicated_core_cost_pct"),
        cost_once_others_fixed_pct=_share(found, times, total, "cost_once_others_fixed_pct"),
        axes=sorted({axis for f in findings for axis in f.axes}),
        steps=[] if chronic else sorted({step for f in findings for step in f.steps}),
        evidence=evidence, remedy=_merged_remedy(found, times, total, best),
    )  # fmt: skip


def _merged_imbalance(found: list[tuple[int, Imbalance]], times: list[float],
                      total: float) -> Imbalance:  # fmt: skip
    best = _costliest(found, times)
    present = sum(times[w] for w, _ in found) or 1.0
    return dataclasses.replace(
        best,
        excess=round(sum(times[w] * i.excess for w, i in found) / present, 3),
        cost_pct=_share(found, times, total, "cost_pct") or 0.0,
        whatif_step_time_s=sum(times[w] * i.whatif_step_time_s for w, i in found) / present,
        ranks=sorted({rank for _, i in found for rank in i.ranks}),
        remedy=_merged_remedy(found, times, total, best),
    )  # fmt: skip


def _merged_remedy(found, times: list[float], total: float, best) -> dict | None:
    """The costliest window's remedy, its predicted gain a share of the run as costs are."""
    if best.remedy is None or best.remedy.get("predicted_gain_pct") is None:
        return best.remedy
    gains = [(times[w], (f.remedy or {}).get("predicted_gain_pct")) for w, f in found]
    gain = sum(t * g for t, g in gains if g is not None) / total if total > 0 else None
    return {**best.remedy, "predicted_gain_pct": round(gain, 2) if gain is not None else None}


def _material(finding: Straggler) -> bool:
    """stragglers.is_material over the run, judged as analysis/whatif.py `confirmed` judges."""
    judged = finding.cost_pct
    if finding.dedicated_core_cost_pct is not None:
        judged = finding.dedicated_core_cost_pct
    judged = max(judged, finding.cost_once_others_fixed_pct or 0.0)
    return is_material(finding.pattern, judged, finding.slowdown)


def _set_aside_note(finding) -> str:
    if isinstance(finding, Imbalance):
        where = f"stage {finding.stage} " if finding.stage is not None else ""
        return (f"a {where}{finding.kind} imbalance seen in part of the run costs "
                f"{finding.cost_pct:.2f}% of the run's time: under the {MIN_COST_PCT:g}% a "
                "cause needs, not reported")  # fmt: skip
    return (f"{finding.who} was a {finding.kind} straggler ({finding.slowdown:.2f}x) over steps "
            f"{finding.first_step}-{finding.last_step}, but costs {finding.cost_pct:.2f}% of the "
            "run's time: too little to report over the whole run")  # fmt: skip


def _without_unreported_causes(replayed: dict, reported: list) -> None:
    """`slowdown_by_cause` of the reported findings only: a window prices every finding it
    sees (stragglers.cost_judged_by_the_run), and the run reports those material over it; the
    share of S - 1 of a cause not reported goes to the remainder."""
    causes = replayed.get("slowdown_by_cause") or []
    named = {_cause_key(cause_of(finding)) for finding in reported}
    dropped = [c for c in causes if _cause_key(c) not in named]
    replayed["slowdown_by_cause"] = [c for c in causes if _cause_key(c) in named]
    remainder = replayed.get("slowdown_remainder")
    if remainder is not None:
        remainder["share_pct"] += sum(c["share_pct"] or 0.0 for c in dropped)


# -- the replay -----------------------------------------------------------------------------


def _merged_replay(parts: list[Part], times: list[float]) -> dict:
    """`slowdown`, `slowdown_detail`, `slowdown_by`, `slowdown_by_cause` (and
    `slowdown_remainder`) weighted over the windows that have a replay."""
    replays = [(part.replayed, t) for part, t in zip(parts, times, strict=True)
               if part.replayed.get("slowdown") is not None and t > 0]  # fmt: skip
    if not replays:
        return parts[0].replayed
    ideals = [t / r["slowdown"] for r, t in replays]
    slowdown = sum(t for _, t in replays) / sum(ideals)
    causes, remainder = _merged_causes(replays, ideals)
    merged = {
        "slowdown": slowdown, "slowdown_detail": _merged_detail(replays, slowdown),
        "slowdown_by": _merged_factors(replays, ideals), "slowdown_by_cause": causes,
    }  # fmt: skip
    if any("slowdown_remainder" in r for r, _ in replays):
        merged["slowdown_remainder"] = remainder
    return merged


def _merged_detail(replays: list[tuple[dict, float]], slowdown: float) -> dict:
    details = [r["slowdown_detail"] for r, _ in replays]
    weights = [t for _, t in replays]
    measured = sum(d["measured_s"] for d in details)
    full = sum(d["measured_s"] * (1 + (d["replay_error_pct"] or 0.0) / 100) for d in details)
    medians = sorted(d["replay_error_abs_pct_median"] for d in details
                     if d.get("replay_error_abs_pct_median") is not None)  # fmt: skip
    maxima = [d["replay_error_abs_pct_max"] for d in details
              if d.get("replay_error_abs_pct_max") is not None]  # fmt: skip
    return {
        **details[0], "slowdown": slowdown,
        "replayed_s": sum(d["replayed_s"] for d in details),
        "ideal_s": sum(d["ideal_s"] for d in details), "measured_s": measured,
        "steps": sum(d["steps"] for d in details),
        "first_step": min(d["first_step"] for d in details),
        "last_step": max(d["last_step"] for d in details),
        "sampled_every": max(d["sampled_every"] for d in details),
        "replay_error_pct": 100 * (full - measured) / measured if measured else None,
        "replay_error_abs_pct_median": medians[len(medians) // 2] if medians else None,
        "replay_error_abs_pct_max": max(maxima) if maxima else None,
        "launch_slowdown": sum(w * d["launch_slowdown"] for w, d in zip(weights, details,
                                                                        strict=True))
        / sum(weights),
        "ranks": max(d["ranks"] for d in details),
        "ranks_sharing_cores": max(d.get("ranks_sharing_cores") or 0 for d in details),
        "windows": len(details),
    }  # fmt: skip


def _merged_factors(replays: list[tuple[dict, float]], ideals: list[float]) -> dict:
    """S_X per rank, stage and phase: Σ I_w S_X,w / Σ I_w (1 where a window has none); the
    ranks whose factor is largest, MAX_RANK_FACTORS of them."""
    merged = {}
    for group in ("rank", "stage", "phase"):
        maps = [(r.get("slowdown_by") or {}).get(group) or {} for r, _ in replays]
        keys = sorted({k for m in maps for k in m}, key=_factor_order)
        values = {k: round(sum(i * m.get(k, 1.0) for i, m in zip(ideals, maps, strict=True))
                           / sum(ideals), 4) for k in keys}  # fmt: skip
        if group == "rank" and len(values) > MAX_RANK_FACTORS:
            top = sorted(values, key=lambda k: -values[k])[:MAX_RANK_FACTORS]
            values = {k: values[k] for k in keys if k in top}
        merged[group] = values
    return merged


def _factor_order(key: str) -> tuple:
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def _merged_causes(replays: list[tuple[dict, float]],
                   ideals: list[float]) -> tuple[list[dict], dict | None]:  # fmt: skip
    """`slowdown_by_cause` and `slowdown_remainder` over the windows (module docstring)."""
    total, ideal = sum(t for _, t in replays), sum(ideals)
    # each window's excess T_w - I_w where it shared S - 1 out (a remainder), else None
    excesses = [t - i if r.get("slowdown_remainder") is not None else None
                for (r, t), i in zip(replays, ideals, strict=True)]  # fmt: skip
    excess = sum(e for e in excesses if e is not None)
    named: dict[tuple, dict] = {}
    for replay, _ in replays:
        for cause in replay.get("slowdown_by_cause") or []:
            named.setdefault(_cause_key(cause), {k: cause[k] for k in CAUSE_NAME})
    causes = []
    for key, name in named.items():
        of = [_cause_in(replay, key) for replay, _ in replays]
        saved = sum(t * c["saved_pct"] for (_, t), c in zip(replays, of, strict=True) if c)
        without = sum(i * (c["slowdown_without"] if c else r["slowdown"])
                      for (r, _), i, c in zip(replays, ideals, of, strict=True))  # fmt: skip
        share = None
        if excess > 0 and any(c and c.get("share_pct") is not None for c in of):
            share = (
                sum(
                    e * ((c or {}).get("share_pct") or 0.0)
                    for e, c in zip(excesses, of, strict=True)
                    if e is not None
                )
                / excess
            )
        causes.append({**name, "share_pct": share, "saved_pct": saved / total,
                       "slowdown_without": without / ideal})  # fmt: skip
    causes.sort(key=lambda c: -c["saved_pct"])
    if all(e is None for e in excesses):  # no window shared S - 1 out
        return causes, None
    left = sum(i * (r.get("slowdown_remainder") or {}).get("slowdown_left", r["slowdown"])
               for (r, _), i in zip(replays, ideals, strict=True))  # fmt: skip
    share = (sum(e * r["slowdown_remainder"]["share_pct"]
                 for (r, _), e in zip(replays, excesses, strict=True) if e is not None) / excess
             if excess > 0 else 100.0)  # fmt: skip
    return causes, {"share_pct": share, "slowdown_left": left / ideal}


CAUSE_NAME = ("cause", "kind", "stage", "rank")
"""What names a cause in `slowdown_by_cause` (the same cause in every window)."""


def _cause_key(cause: dict) -> tuple:
    return tuple(cause[k] for k in CAUSE_NAME)


def _cause_in(replay: dict, key: tuple) -> dict | None:
    return next((c for c in replay.get("slowdown_by_cause") or [] if _cause_key(c) == key), None)
