"""`ranktrace ingest --ray ADDRESS` on a real Ray cluster started here with `ray start` (a head
and one worker node, one CPU each, no dashboard): every window is derived by a Ray task, and
the store and the report are the ones a local ingest makes (`--workers 2` too); a long run's
report, window by window, is the same in one process, in 2 local workers and on Ray."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ranktrace.analysis.ingest import ingest
from ranktrace.analysis.store import open_reader, query
from ranktrace.analysis.windows import WINDOWED_TABLES
from tests.compare import assert_same
from tests.conftest import REPO, cli_env, ranktrace, wait_for

pytestmark = pytest.mark.multiprocess  # real rank processes and a real Ray cluster

if importlib.util.find_spec("ray") is None:  # not imported: this process never uses Ray itself
    pytest.skip("the optional extra ranktrace[ray] (make test installs it)",
                allow_module_level=True)  # fmt: skip
RAY = str(Path(sys.executable).parent / "ray")
WINDOW = 5
STOPPING: list[subprocess.Popen] = []
"""`ray stop` processes left to finish on their own."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _ray(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, *args], capture_output=True, text=True, timeout=180,
                          env=cli_env())  # fmt: skip


@pytest.fixture(scope="module")
def ray_cluster():
    """The address of a running two-node cluster (head, and one worker joining it)."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # a short path: Ray's sockets live there
    head = _ray("start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats",
                f"--temp-dir={temp}")  # fmt: skip
    assert head.returncode == 0, head.stderr[-3000:]
    try:
        worker = _ray("start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1",
                      "--num-cpus=1", "--disable-usage-stats")  # fmt: skip
        assert worker.returncode == 0, worker.stderr[-3000:]
        yield f"127.0.0.1:{port}"
    finally:  # stopped while the next tests run (it takes ~6 s)
        stop = f"{RAY} stop --force; rm -rf {temp}"
        STOPPING.append(subprocess.Popen(["sh", "-c", stop], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, env=cli_env()))  # fmt: skip


def _ingested(flushing_run, runs_dir: Path, *options: str) -> tuple[dict, dict]:
    """({table: its rows, sorted}, the report) after `ranktrace ingest --window 5 OPTIONS`."""
    shutil.copytree(flushing_run, runs_dir / flushing_run.name)
    # Ray's driver state stays in a process: its own interpreter for it
    result = ranktrace("ingest", "--runs-dir", str(runs_dir), "--window", str(WINDOW), *options,
                       runs_dir=runs_dir, new_process="--ray" in options)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(5 window(s) written)" in result.stdout, result.stdout  # 25 steps
    con = open_reader(runs_dir)
    try:
        rows = {t: query(con, f"SELECT * FROM {t} ORDER BY ALL")[1] for t in WINDOWED_TABLES}
    finally:
        con.close()
    report = ranktrace("report", flushing_run.name, "--runs-dir", str(runs_dir), "--json",
                       runs_dir=runs_dir)  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    return rows, json.loads(report.stdout)


def test_ray_and_local_workers_write_the_windows_and_report_of_one_process(
    flushing_run, ray_cluster, tmp_path
):
    wait_for(lambda: _ray("status", f"--address={ray_cluster}").stdout.count("node_") == 2, 60,
             "the head and its worker to be up")  # fmt: skip
    local_rows, local_report = _ingested(flushing_run, tmp_path / "local")
    ray_rows, ray_report = _ingested(flushing_run, tmp_path / "ray", "--ray", ray_cluster)
    workers_rows, workers_report = _ingested(flushing_run, tmp_path / "workers", "--workers", "2")
    for rows in (ray_rows, workers_rows):
        for table in WINDOWED_TABLES:
            assert rows[table] == local_rows[table], table
    assert_same(ray_report, local_report)
    assert_same(workers_report, local_report)


WINDOWED_REPORTS = """
import json, sys
from pathlib import Path
from ranktrace.analysis import windows
from ranktrace.analysis.run import report
from ranktrace.analysis.store import open_reader
windows.MIN_ANALYSIS_STEPS, windows.ANALYSIS_RANK_STEPS = 40, 0  # analysed 40 steps at a time
con = open_reader(Path(sys.argv[1]))
reports = [report(con, sys.argv[2], workers=w, ray_address=r)
           for w, r in ((1, None), (2, None), (1, sys.argv[3]))]
print(json.dumps(reports, default=float))
"""


def test_a_long_runs_report_is_the_same_on_ray_in_local_workers_and_in_one_process(
    ray_cluster, tmp_path
):
    """benchmarks/store_scale.py's run (16 ranks, 120 steps, rank 5 slow from step 50) in 3
    analysis windows: each a task (a Ray task, a local worker's), merged by the caller."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import store_scale

    runs_dir = tmp_path / "runs"
    store_scale.write_run(runs_dir / store_scale.RUN_ID, 16, 120, segment_steps=20, slow_from=50)
    ingest(runs_dir, window_steps=20)
    wait_for(lambda: _ray("status", f"--address={ray_cluster}").stdout.count("node_") == 2, 60,
             "the head and its worker to be up")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", WINDOWED_REPORTS, str(runs_dir),
                             store_scale.RUN_ID, ray_cluster], capture_output=True, text=True,
                            timeout=300, env=cli_env())  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    here, workers, ray = json.loads(result.stdout)
    assert here["slowdown_detail"]["windows"] == 3 and here["stragglers"][0]["rank"] == 5
    assert_same(workers, here)
    assert_same(ray, here)


def test_an_address_with_no_cluster_is_a_one_line_error(flushing_run, tmp_path):
    runs_dir = tmp_path / "runs"
    shutil.copytree(flushing_run, runs_dir / flushing_run.name)
    result = ranktrace("ingest", "--runs-dir", str(runs_dir), "--ray", f"127.0.0.1:{_free_port()}",
                       runs_dir=runs_dir, new_process=True)  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "no Ray cluster at" in result.stderr and "Traceback" not in result.stderr
