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

MARGINS_ENV = "RANKTRACE_MARGINS"


def at_most(what: str, value: float, bound: float, detail: object = "") -> None:
    """Assert `value` <= `bound` (`what` names the check), logging both."""
    _log(what, value, bound, "<=", value <= bound)
    assert value <= bound, f"{what}: {value:.4g} > {bound:.4g} {detail}"


def at_least(what: str, value: float, bound: float, detail: object = "") -> None:
    """Assert `value` >= `bound` (`what` names the check), logging both."""
    _log(what, value, bound, ">=", value >= bound)
    assert value >= bound, f"{what}: {value:.4g} < {bound:.4g} {detail}"


def _log(what: str, value: float, bound: float, op: str, ok: bool) -> None:
    path = os.environ.get(MARGINS_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    line = {"test": test, "check": what, "value": float(value), "bound": float(bound), "op": op,
            "ok": bool(ok), "time": time.time()}  # fmt: skip
    with open(path, "a") as log:
        log.write(json.dumps(line) + "\n")
