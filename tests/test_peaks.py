"""MFU's denominator, one per machine (telemetry/peaks.py): runs on one host divide by the same
stored peak, shared by their ranks; `--peak-flops` overrides it."""

from __future__ import annotations

import json

import pytest

from ranktrace.analysis.run import compare
from ranktrace.analysis.store import open_reader
from tests.conftest import ranktrace

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

TRAIN = ("--dp", "2", "--steps", "3", "--seq-len", "32", "--precision", "fp32")
GIVEN = 2.5e12


def test_runs_on_one_host_share_its_stored_peak_and_peak_flops_overrides_it(tmp_path):
    runs_dir = tmp_path / "runs"
    for name, extra in (("a", ()), ("b", ("--pp", "2")), ("given", ("--peak-flops", str(GIVEN)))):
        result = ranktrace("train", *TRAIN, *extra, "--run-name", name, runs_dir=runs_dir)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (stored,) = json.loads((runs_dir / "peaks.json").read_text()).values()
    assert {"host", "device", "dtype", "flops", "measured_at", "method"} <= set(stored)
    con = open_reader(runs_dir)
    try:
        rows = con.execute(
            "SELECT name, k.peak_flops, k.job_peak_flops, k.peak_flops_source "
            "FROM ranks k JOIN runs USING (run_id) ORDER BY name, k.rank"
        ).fetchall()
        same_host, overridden = compare(con, "a", "b"), compare(con, "a", "given")
    finally:
        con.close()
    peaks = {}
    for name, peak, job_peak, source in rows:
        peaks.setdefault(name, []).append((peak, job_peak, source))
    # a: 2 ranks, b: 4 ranks on the same host: each rank its share, the job the host's peak
    assert {p for p, _, _ in peaks["a"]} == {stored["flops"] / 2}
    assert {p for p, _, _ in peaks["b"]} == {stored["flops"] / 4}
    assert [j for _, j, _ in peaks["a"] + peaks["b"]] == pytest.approx([stored["flops"]] * 6)
    assert all("peaks.json" in s for _, _, s in peaks["a"])
    assert {(p, j) for p, j, _ in peaks["given"]} == {(GIVEN, 2 * GIVEN)}
    assert {s for _, _, s in peaks["given"]} == {"given (--peak-flops)"}
    # compared: a and b divide by one host peak (their ranks' shares differ, 1/2 and 1/4 of
    # it); `given` by its own, which the comparison says
    assert same_host["peak_note"] is None
    assert same_host["peaks"]["a"]["flops"] == pytest.approx(stored["flops"])
    note = overridden["peak_note"]
    assert note and "different peaks" in note and "given (--peak-flops)" in note, note
