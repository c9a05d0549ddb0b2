"""`ranktrace demo --no-dash`, the README's main job, end to end on its embedded defaults."""

from __future__ import annotations

import re

import pytest

from ranktrace.app.demo import BASE, STRAGGLER, STRAGGLER_FACTOR, STRAGGLER_RANK
from tests.conftest import ranktrace

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)


def test_demo_sweeps_finds_the_straggler_and_reports(tmp_path):
    runs_dir = tmp_path / "runs"
    result = ranktrace("demo", "--no-dash", "--runs-dir", str(runs_dir), runs_dir=runs_dir,
                       timeout=900)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, (out + result.stderr)[-3000:]
    # Progress: each job announced, and its steps printed.
    assert [int(n) for n in re.findall(r"== demo (\d)/3", out)] == [1, 2, 3]
    for steps in (BASE.steps, STRAGGLER.steps):
        assert f"step {steps:>5}/{steps}" in out
    # The sweep table: one row per tp value.
    sweep = out.split("== one-axis sweep of tp")[1].split("==")[0]
    assert re.search(r"^1\s+\S+", sweep, flags=re.M) and re.search(r"^2\s+\S+", sweep, flags=re.M)
    # The straggler run's report names the injected rank and kind.
    report = out.split("== report of the straggler run")[1]
    assert report.startswith(f" (rank {STRAGGLER_RANK} was made {STRAGGLER_FACTOR}x slow"), report
    assert re.search(rf"rank {STRAGGLER_RANK} \(pp=1 dp=0 tp=1\)\s+compute", report), report
    # The MFU drop where the fault starts is explained by it, not by its symptom.
    drops = report.split("efficiency drops:")[1]
    assert re.search(rf"^\d+\s.*rank {STRAGGLER_RANK} compute straggler from step \d+", drops,
                     flags=re.M), drops  # fmt: skip
    assert (runs_dir / "ranktrace.duckdb").exists()
