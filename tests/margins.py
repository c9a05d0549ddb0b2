"""The assertions of the tests that judge timing (`@pytest.mark.timing`), with their margins.

A test whose outcome depends on how fast this machine ran (a straggler named, a healthy run left
alone, a deadline met) asserts through `at_most` / `at_least`: each check is logged, value
against bound, to the JSON-lines file named by $RANKTRACE_MARGINS (when set), then asserted.
`tools/timing_loop.py` runs the timing tests again and again beside a training job and reports
each check's closest approach to its bound, so a margin that is thin shows before it fails.
"""

from __future__ import annotations

import json
import os
import time
from statistics import median

MARGINS_ENV = "RANKTRACE_MARGINS"


def at_most(what: str, value: float, bound: float, detail: object = "") -> None:
    """Assert `value` <= `bound` (`what` names the check), logging both."""
    _log(what, value, bound, "<=", value <= bound)
    assert value <= bound, f"{what}: {value:.4g} > {bound:.4g} {detail}"


def at_least(what: str, value: float, bound: float, detail: object = "") -> None:
    """Assert `value` >= `bound` (`what` names the check), logging both."""
    _log(what, value, bound, ">=", value >= bound)
    assert value >= bound, f"{what}: {value:.4g} < {bound:.4g} {detail}"


def machine_finding(finding: dict) -> bool:
    """A rank's wait for a core (`host (contention)`): the machine's, not the job's; another
    job on these 2 cores makes one, and a test beside it allows it."""
    return (finding["kind"], finding.get("cause")) == ("host", "contention")


def only_findings(findings: list[dict], expected: list[tuple]) -> list[dict]:
    """Assert `findings` (a report's stragglers) hold one of each (rank, kind) of `expected`
    (rank None: a link's candidates) and nothing else but the machine's (`machine_finding`),
    logging both counts; the expected findings, in `expected`'s order."""
    named = []
    for rank, kind in expected:
        these = [f for f in findings if (f["rank"], f["kind"]) == (rank, kind)]
        at_least(f"findings of rank {rank} {kind}", len(these), 1, findings)
        named.append(these[0])
    others = [f for f in findings if f not in named and not machine_finding(f)]
    at_most("other findings", len(others), 0, others)
    return named


def above_its_peers_from(own: dict, peers: dict, onset: int) -> None:
    """The straggler's compute against its peers' median, step by step: above theirs in every
    step from `onset`, 1.5x in the median step (a 3x fault); before it, 1.5x in at most one."""
    ratio = {s: own[s] / peers[s] for s in own if peers[s] > 0}
    after = [ratio[s] for s in ratio if s >= onset]
    before = [ratio[s] for s in ratio if 1 <= s < onset]
    assert after and before, (own, peers)
    at_least("its lowest compute ratio to its peers from the fault", min(after), 1.0, ratio)
    at_least("its median compute ratio to its peers from the fault", median(after), 1.5, ratio)
    at_most("steps before the fault at 1.5x its peers", sum(r >= 1.5 for r in before), 1, ratio)


def _log(what: str, value: float, bound: float, op: str, ok: bool) -> None:
    path = os.environ.get(MARGINS_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    line = {"test": test, "check": what, "value": float(value), "bound": float(bound), "op": op,
            "ok": bool(ok), "time": time.time()}  # fmt: skip
    with open(path, "a") as log:
        log.write(json.dumps(line) + "\n")
