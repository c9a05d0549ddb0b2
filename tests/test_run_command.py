"""`ranktrace run -- torchrun ...` on training scripts written the way PyTorch's tutorials write
them (tests/jobs/, no ranktrace in them), 4 gloo ranks: every job's losses and exit code the same
bare and recorded, every rank's steps, DDP's buckets, FSDP2's all-gathers and reduce-scatters with
the bytes the model implies, a DeviceMesh job's axes by their names, a rank slowed in forward
named, a healthy job with no finding, and a job whose own `trainer.py`, `app/` and `analysis/`
shadow nothing of ranktrace's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from ranktrace.analysis.ingest import remove_run
from tests.bare_jobs import run_bare
from tests.conftest import REPO, ranktrace
from tests.margins import at_most, only_findings

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

JOBS = REPO / "tests/jobs"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS = 12
DDP_PARAM_BYTES = (64 * 512 + 512 + 512 * 512 + 512 + 512 * 8 + 8) * 4  # fp32 Net of ddp_train
FSDP_BLOCK_BYTES = (128 * 256 + 256 + 256 * 128 + 128) * 4  # one fully_shard unit: a Block
FSDP_ROOT_BYTES = (128 * 8 + 8) * 4  # the root unit: the head
MESH_STEPS = 8  # mesh_2d_train.py's default
LIGHTNING_STEPS = 16
STEP_STYLES = ("accumulate", "two-optimizers", "lbfgs")  # step_styles_train.py --style
PIPELINE_MICRO_BATCHES = 4  # pipeline_train.py's
MESH_HEAD_OUTPUT_BYTES = 8 * 8 * 4  # [batch 8, classes 8] fp32, gathered over tp

# A job's own modules named like ranktrace's folders, and a launcher that checks it gets them.
OWN_MODULES = {
    "trainer.py": "WHO = 'job'\n",
    "app/__init__.py": "WHO = 'job'\n",
    "analysis/__init__.py": "WHO = 'job'\n",
    "train.py": (
        "import runpy, sys\n"
        "import analysis, app, trainer\n"
        "assert (trainer.WHO, app.WHO, analysis.WHO) == ('job',) * 3, 'shadowed'\n"
        "sys.argv = [sys.argv[1], *sys.argv[2:]]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    ),
}


@dataclass(frozen=True)
class Job:
    """One job of tests/jobs/ and how it is launched: `torchrun --nproc-per-node NPROC`, or
    plain `python` where nproc is None; from the job's own folder (OWN_MODULES) or not."""

    script: str
    args: tuple[str, ...] = ()
    nproc: int | None = 4
    env: tuple[tuple[str, str], ...] = ()
    in_job_dir: bool = False
    exit_code: int = 0
    parity: bool = True
    """Run bare too, for the parity test (a variant of a script already compared is not)."""
    timed: bool = True
    """Its findings are asserted, so it is recorded alone (the others two at a time)."""

    def command(self) -> tuple[str, tuple[str, ...]]:
        """(script, its arguments)."""
        script = str(JOBS / self.script)
        if self.in_job_dir:  # train.py runs the job after checking it gets its own modules
            return "train.py", (script, *self.args)
        return script, self.args

    def argv(self) -> list[str]:
        script, args = self.command()
        if self.nproc is None:
            return [sys.executable, script, *args]
        return [TORCHRUN, "--standalone", "--nproc-per-node", str(self.nproc), script, *args]


JOB_RUNS = {
    "ddp": Job("ddp_train.py", ("--steps", str(STEPS)), in_job_dir=True),
    "fsdp-slow": Job("fsdp2_train.py", ("--steps", str(STEPS)), nproc=2,
                     env=(("SLOW_RANK", "1"), ("SLOW_SECONDS", "0.04"))),
    "mesh": Job("mesh_2d_train.py", timed=False),
    "pipeline": Job("pipeline_train.py", ("--steps", str(STEPS)), nproc=2),
    "pipeline-8-1": Job("pipeline_train.py", ("--steps", str(STEPS), "--split", "8,1",
                        "--schedule", "1f1b"), nproc=2, parity=False),
    "lightning": Job("lightning_train.py", ("--steps", str(LIGHTNING_STEPS)), nproc=2),
    "lightning-slow": Job("lightning_train.py", ("--steps", str(LIGHTNING_STEPS)), nproc=2,
                          env=(("SLOW_RANK", "1"), ("SLOW_SECONDS", "0.02")), parity=False),
    "lightning-manual": Job("lightning_train.py", ("--steps", str(LIGHTNING_STEPS), "--manual"),
                            nproc=2, parity=False, timed=False),
    "eval": Job("eval_only.py", nproc=2, timed=False),
    "manual-update": Job("manual_update_train.py", nproc=2, timed=False),
    "failing": Job("failing_train.py", nproc=None, exit_code=3, timed=False),
}  # fmt: skip
"""The jobs recorded once for this module's tests, by name."""


def _job_environment(job: Job) -> dict:
    """The job's environment: nothing of ranktrace's on the PYTHONPATH (it is installed)."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environment.update(OMP_NUM_THREADS="1", **dict(job.env))
    return environment


def launch(job: Job, root: Path, runs_dir: Path | None = None,
           name: str = "") -> subprocess.CompletedProcess:  # fmt: skip
    """The job under `ranktrace run --name NAME ... -- torchrun ...` when `runs_dir` is given,
    else bare: as its torchrun (or python) command line would, from a process that imported
    torch once (tests/bare_jobs.py; no ranktrace in it), the reference for its results."""
    job_dir = root / "job"
    for relative, text in OWN_MODULES.items():
        path = job_dir / relative
        if not path.exists() or path.read_text() != text:  # written once: launches run at once
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    cwd = job_dir if job.in_job_dir else root
    if runs_dir is None:
        return run_bare(*job.command(), job.nproc, cwd, _job_environment(job))
    argv = [sys.executable, "-m", "ranktrace.app.cli", "run", "--name", name, "--runs-dir",
            str(runs_dir), "--", *job.argv()]  # fmt: skip
    return subprocess.run(argv, cwd=cwd, env=_job_environment(job), capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def losses(result: subprocess.CompletedProcess) -> list[str]:
    """The `step N loss X` (or `eval loss X`) lines a job printed (X with every digit)."""
    return [line for line in result.stdout.splitlines() if line.startswith(("step ", "eval "))]


def cli(runs_dir: Path, *args: str) -> str:
    result = ranktrace(*args, "--runs-dir", str(runs_dir), runs_dir=runs_dir, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def sql(runs_dir: Path, query: str) -> list[dict]:
    return json.loads(cli(runs_dir, "sql", query, "--format", "json"))


TORCH_TEARDOWN_ABORT = "terminate called without an active exception"
"""torch 2.13 with gloo: a DDP job (no ranktrace in it) aborted at interpreter exit now and then
after its last step (tests/jobs/ddp_train.py; once in a CI run after the fix there), and once
the manual-update job under `ranktrace run` (0 of 40 recorded and 0 of 20 bare runs of it
aborted when run again here, two at a time): a job so aborted is run once more, bare or
recorded alike; one that aborts twice fails the test. (ranktrace itself kept the job's process
groups and its root modules alive past `destroy_process_group` until its hooks held them weakly:
a world group so kept aborted 11 of 21 bare runs of this job here; test_do_no_harm.py checks
that nothing is kept.)"""


def launched(job: Job, root: Path, runs_dir: Path | None = None,
             name: str = "") -> subprocess.CompletedProcess:  # fmt: skip
    """`launch`; once more if torch aborted the job at teardown (a recorded run's first run
    deleted first)."""
    result = launch(job, root, runs_dir, name)
    if result.returncode != job.exit_code and TORCH_TEARDOWN_ABORT in result.stderr:
        aborted = re.search(r"recording \S+ \((\S+)\)", result.stdout)
        if runs_dir is not None and aborted:
            remove_run(runs_dir, aborted.group(1))
            shutil.rmtree(runs_dir / aborted.group(1), ignore_errors=True)
        result = launch(job, root, runs_dir, name)
    return result


@dataclass
class Recorded:
    runs_dir: Path
    root: Path
    results: dict[str, subprocess.CompletedProcess]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Recorded:
    """JOB_RUNS, each recorded once by `ranktrace run` into one runs directory."""
    root = tmp_path_factory.mktemp("jobs")
    runs_dir = root / "runs"
    results = {name: launched(job, root, runs_dir, name) for name, job in JOB_RUNS.items()
               if job.timed}  # fmt: skip
    untimed = [name for name, job in JOB_RUNS.items() if not job.timed]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(lambda name: launched(JOB_RUNS[name], root, runs_dir, name), untimed)
        results.update(zip(untimed, runs, strict=True))
    for name, result in results.items():
        assert result.returncode == JOB_RUNS[name].exit_code, \
            f"{name}: {result.stdout[-1500:]}\n{result.stderr[-3000:]}"  # fmt: skip
        verdict = "completed" if JOB_RUNS[name].exit_code == 0 else "failed"
        assert f"ranktrace run: {name} {verdict}" in result.stdout
    return Recorded(runs_dir, root, results)


@pytest.fixture(scope="module")
def jobs(recorded) -> Path:
    """The runs directory of the recorded jobs."""
    return recorded.runs_dir


PARITY_RUNS = [name for name, job in JOB_RUNS.items() if job.parity]


@pytest.fixture(scope="module")
def bare(recorded) -> dict[str, subprocess.CompletedProcess]:
    """PARITY_RUNS run bare, one after another through one process that imported torch once
    (`launch`): 26 interpreters importing torch fewer than torchrun, ~40 s of CPU."""
    return {name: launched(JOB_RUNS[name], recorded.root) for name in PARITY_RUNS}


@pytest.mark.parametrize("name", PARITY_RUNS)
def test_a_job_gives_the_same_losses_and_exit_code_bare_and_recorded(recorded, bare, name):
    """ranktrace never changes a job's results: every loss, to the last digit, and the exit
    code (`failing` stops with 3 on purpose) are the same without it."""
    bare, under = bare[name], recorded.results[name]
    assert bare.returncode == under.returncode == JOB_RUNS[name].exit_code, (
        f"bare {bare.returncode}: {bare.stderr[-3000:]}\nrecorded {under.returncode}: "
        f"{under.stderr[-1500:]}")  # fmt: skip
    assert losses(bare) == losses(under) and losses(bare), (losses(bare), losses(under))


def test_every_recorded_jobs_report_passed_its_self_check_at_ingest(jobs):
    """Ingest computes each run's report under the strict self-check and stores a failure as
    the report's error: none of the recorded jobs (the parity runs' included, which no other
    test reads a report of) may have one."""
    rows = sql(jobs, "SELECT name, report IS NOT NULL AS computed, reports.error FROM reports "
               "JOIN runs USING (run_id) ORDER BY name")  # fmt: skip
    assert {row["name"] for row in rows} == set(JOB_RUNS), rows
    assert all(row["computed"] and row["error"] is None for row in rows), rows


def test_every_rank_of_a_ddp_job_is_recorded_with_its_buckets_and_nothing_shadowed(jobs):
    """The job imported its own trainer.py, app/ and analysis/ (train.py asserts it) while
    ranktrace recorded it: 4 ranks × 12 steps, one all-reduce of every gradient per step."""
    steps = sql(jobs, "SELECT rank, count(*) AS n, min(forward_s) AS forward, "
                "min(backward_s) AS backward, min(optimizer_s) AS optimizer "
                "FROM steps JOIN runs USING (run_id) WHERE name = 'ddp' GROUP BY rank")  # fmt: skip
    assert sorted(row["rank"] for row in steps) == [0, 1, 2, 3]
    for row in steps:
        assert row["n"] == STEPS and row["forward"] > 0 and row["backward"] > 0
        assert row["optimizer"] > 0
    buckets = sql(jobs, "SELECT rank, step, sum(bytes) AS bytes, min(axis) AS axis "
                  "FROM collectives JOIN runs USING (run_id) WHERE name = 'ddp' "
                  "AND op = 'all_reduce' GROUP BY ALL")  # fmt: skip
    assert len(buckets) == 4 * STEPS  # per rank and step, its buckets add up to the model
    assert {(row["bytes"], row["axis"]) for row in buckets} == {(DDP_PARAM_BYTES, "world")}
    # async buckets: their wait is recorded and only it is split into blocking and transfer
    split = sql(jobs, "SELECT count(*) AS n, count(wait_ns) AS waited, "
                "max(abs(blocking_s + transfer_s - wait_ns / 1e9)) AS off, "
                "max(duration_s - wait_ns / 1e9) AS overlapped FROM collectives "
                "JOIN runs USING (run_id) WHERE name = 'ddp'")  # fmt: skip
    assert split[0]["n"] == split[0]["waited"] > 0 and split[0]["off"] < 1e-6
    assert split[0]["overlapped"] > 0  # the earlier buckets ran under the backward
    # the main thread's wait for a core, sampled at the calls: ordered within each step
    waits = sql(jobs, "SELECT count(*) AS n, count(c.core_wait_start_ns) AS known, "
                "count(*) FILTER (WHERE 0 <= c.core_wait_start_ns AND c.core_wait_start_ns <= "
                "c.core_wait_end_ns AND c.core_wait_end_ns <= s.core_wait_s * 1e9 + 1) AS ordered "
                "FROM collectives c JOIN steps s USING (run_id, rank, step) "
                "JOIN runs USING (run_id) WHERE name = 'ddp'")  # fmt: skip
    assert waits[0]["n"] == waits[0]["known"] == waits[0]["ordered"], waits
    # every peer's clock against rank 0's, over the store: one host, so within half the trip
    clocks = sql(jobs, "SELECT rank, clock_offset_ns AS offset, clock_offset_rtt_ns AS rtt "
                 "FROM ranks JOIN runs USING (run_id) WHERE name = 'ddp' "
                 "ORDER BY rank")  # fmt: skip
    assert clocks[0]["offset"] == 0
    for row in clocks[1:]:
        assert row["rtt"] > 0 and abs(row["offset"]) <= row["rtt"] // 2 + 1, clocks


@pytest.mark.timing
def test_a_healthy_job_has_no_finding(jobs):
    """No straggler and no imbalance: the spread of 4 ranks taking turns on 2 cores is the
    host's scheduling, noted as such."""
    report = json.loads(cli(jobs, "report", "ddp", "--json"))
    only_findings(report["stragglers"], [])
    at_most("imbalances", len(report["imbalances"]), 0, report["imbalances"])
    assert report["command"][-3:] == [str(JOBS / "ddp_train.py"), "--steps", str(STEPS)]
    assert report["mfu"] > 0
    # a job ranktrace did not write has no layout it could change: nothing to apply
    assert report["layout_remedy"] is None
    healthy = ranktrace("remedy", "ddp", "--apply", "--runs-dir", str(jobs), runs_dir=jobs)
    assert healthy.returncode == 2 and "no remedy to apply: it is healthy" in healthy.stderr


@pytest.mark.timing
def test_fsdp2_collectives_carry_the_model_bytes_and_the_slow_rank_is_named(jobs):
    per_step = sql(jobs, "SELECT rank, step, op, list(bytes ORDER BY bytes) AS sizes "
                   "FROM collectives JOIN runs USING (run_id) WHERE name = 'fsdp-slow' "
                   "GROUP BY ALL")  # fmt: skip
    gathers = {tuple(r["sizes"]) for r in per_step if r["op"] == "all_gather"}
    scatters = {tuple(r["sizes"]) for r in per_step if r["op"] == "reduce_scatter"}
    # forward: the root and 3 blocks; backward: the 3 blocks again (resharded after forward)
    assert gathers == {(FSDP_ROOT_BYTES, *[FSDP_BLOCK_BYTES] * 6)}
    assert scatters == {(FSDP_ROOT_BYTES, *[FSDP_BLOCK_BYTES] * 3)}  # every gradient, once
    report = json.loads(cli(jobs, "report", "fsdp-slow", "--json"))
    (finding,) = only_findings(report["stragglers"], [(1, "compute")])
    assert "its CPU time in forward" in finding["evidence"][1]  # a CPU job


def test_a_device_mesh_job_shows_its_axes_by_their_names(jobs):
    """FSDP2 on `dp`, DTensor on `tp`. Per step, as torch's own CommDebugMode counts them on
    this job: a tp all-reduce of w2's partial output (forward) and one of the head's input
    gradient (backward); a tp all-gather of the head's sharded output into a replicated one
    (256 bytes: 8 × 8 fp32; DTensor calls `all_gather_single`, which ranktrace once missed); one
    dp all-gather of FSDP2's parameters and one reduce-scatter of its gradients."""
    rows = sql(jobs, "SELECT c.axis, c.op, count(*) AS n, min(c.bytes) AS bytes, "
               "max(c.bytes) AS top, count(*) FILTER (WHERE EXISTS (SELECT 1 FROM spans p "
               "WHERE p.run_id = c.run_id AND p.rank = c.rank AND p.step = c.step AND "
               "p.phase = 'backward' AND p.op IS NULL AND c.start_ns BETWEEN p.start_ns "
               "AND p.end_ns)) AS in_backward FROM collectives c JOIN runs USING (run_id) "
               "WHERE name = 'mesh' AND rank = 0 GROUP BY ALL")  # fmt: skip
    calls = {(r["axis"], r["op"]): r for r in rows}
    assert calls[("tp", "all_reduce")]["n"] == 2 * MESH_STEPS
    assert calls[("tp", "all_reduce")]["in_backward"] == MESH_STEPS
    gather = calls[("tp", "all_gather")]
    assert gather["n"] == MESH_STEPS and gather["in_backward"] == 0
    assert gather["bytes"] == gather["top"] == MESH_HEAD_OUTPUT_BYTES
    assert calls[("dp", "all_gather")]["n"] == calls[("dp", "reduce_scatter")]["n"] == MESH_STEPS
    (run,) = sql(jobs, "SELECT tp, pp, dp, world_size FROM runs WHERE name = 'mesh'")
    assert run == {"tp": 2, "pp": 1, "dp": 2, "world_size": 4}


@pytest.mark.timing
def test_a_pipelining_job_records_its_stages_micro_batches_and_stage_imbalance(jobs):
    """torch.distributed.pipelining, 2 stages: the stages' sends and receives on `pp`, each
    rank's stage as its pp coordinate, the schedule and its micro-batches in the run, every
    micro-batch's forward and backward a phase of its own. Even split (GPipe): nothing found;
    8 blocks against 1 (1F1B): stage 0's imbalance, no straggler (3 against 1 made stage 0's
    compute only ~1.5x stage 1's, which runs the loss too: an excess of 0.19 over the median
    stage against the 0.15 bar, missed in a clean-clone CI run and a timing-loop run; 4 against
    1 read 0.28-0.43, 8 against 1 0.67 beside the loop's job and a second pytest worker, priced
    27%). "Even" is in blocks: the
    last stage also runs the loss's forward and backward on each micro-batch (small ops
    beside two small blocks; it prints the loss every step), so it may show as stage 1's
    imbalance (+22% once in CI), never as stage 0's."""
    runs = {r["name"]: r for r in sql(jobs, "SELECT name, tp, pp, dp, micro_batches, schedule "
                                            "FROM runs WHERE name LIKE 'pipeline%'")}  # fmt: skip
    assert runs["pipeline"] == {
        "name": "pipeline",
        "tp": 1,
        "pp": 2,
        "dp": 1,
        "micro_batches": PIPELINE_MICRO_BATCHES,
        "schedule": "gpipe",
    }
    assert runs["pipeline-8-1"]["schedule"] == "1f1b"
    axes = sql(jobs, "SELECT DISTINCT c.axis, c.op FROM collectives c JOIN runs USING (run_id) "
               "WHERE name = 'pipeline'")  # fmt: skip
    assert {(r["axis"], r["op"]) for r in axes} == {("pp", "send"), ("pp", "recv")}
    ranks = sql(jobs, "SELECT k.rank, k.pp FROM ranks k JOIN runs USING (run_id) "
                "WHERE name = 'pipeline' ORDER BY rank")  # fmt: skip
    assert ranks == [{"rank": 0, "pp": 0}, {"rank": 1, "pp": 1}]
    phases = sql(jobs, "SELECT s.phase, s.micro_batch, count(*) AS n FROM spans s JOIN runs r "
                 "USING (run_id) WHERE r.name = 'pipeline' AND s.name = 'ranktrace.phase' "
                 "AND s.rank = 0 AND s.step > 0 GROUP BY ALL")  # fmt: skip
    counts = {(row["phase"], row["micro_batch"]): row["n"] for row in phases}
    for micro_batch in range(PIPELINE_MICRO_BATCHES):
        assert counts[("forward", micro_batch)] == counts[("backward", micro_batch)] == STEPS - 1
    assert counts[("pipeline_wait", -1)] >= STEPS - 1
    even = json.loads(cli(jobs, "report", "pipeline", "--json"))
    only_findings(even["stragglers"], [])
    assert [(i["kind"], i["stage"]) for i in even["imbalances"]] in ([], [("stage", 1)])
    uneven = json.loads(cli(jobs, "report", "pipeline-8-1", "--json"))
    only_findings(uneven["stragglers"], [])
    assert [(i["kind"], i["stage"]) for i in uneven["imbalances"]] == [("stage", 0)]


@pytest.mark.timing
def test_lightning_steps_run_inside_the_optimizer_step_and_are_counted(jobs):
    """Lightning's automatic optimization (`optimizer.step(closure)`: forward and backward
    inside the optimizer step) and its manual optimization: every step recorded with its
    phases; Lightning's broadcast between its phases (every step but the last) counted as
    communication outside the phases, not as host time; healthy, nothing found (a loop run
    beside another job once named rank 0 a host pause while that broadcast was host time);
    one rank computing longer in its forwards: that rank."""
    steps = sql(jobs, "SELECT name, rank, count(*) AS n, min(forward_s) AS forward, "
                "min(backward_s) AS backward, count(*) FILTER (comm_outside_phases_s > 0) "
                "AS between FROM steps JOIN runs USING (run_id) "
                "WHERE name LIKE 'lightning%' GROUP BY ALL")  # fmt: skip
    assert len(steps) == 6
    for row in steps:
        assert row["n"] == LIGHTNING_STEPS, row
        assert row["forward"] > 0 and row["backward"] > 0, row
        assert row["between"] >= LIGHTNING_STEPS - 1, row
    healthy = json.loads(cli(jobs, "report", "lightning", "--json"))
    only_findings(healthy["stragglers"], [])
    slow = json.loads(cli(jobs, "report", "lightning-slow", "--json"))
    only_findings(slow["stragglers"], [(1, "compute")])


@pytest.mark.parametrize("name, seen", [
    ("eval", "12 forward passes, 12 all_reduce calls"),
    ("manual-update", "12 forward passes, 12 backward passes, 48 all_reduce calls"),
])  # fmt: skip
def test_a_job_without_an_optimizer_step_is_no_data_never_healthy(jobs, name, seen):
    """An evaluation loop and hand-written updates: no step recorded, said first, with what the
    ranks did instead; JSON `no_data`; never "stragglers: none"."""
    report = json.loads(cli(jobs, "report", name, "--json"))
    assert report["verdict"] == "no_data" and report["stragglers"] == []
    text = cli(jobs, "report", name)
    first = text.split("\n\n", 1)[1].splitlines()[0]
    assert first.startswith("no training step was recorded: no optimizer step was seen, though "
                            f"ranks 0, 1 saw {seen}"), first  # fmt: skip
    assert first.endswith("mark steps with `ranktrace.step()` (docs/instrumenting.md)")
    assert "stragglers: none" not in text and "healthy" not in text


def test_a_partial_capture_names_its_ranks_before_any_finding(recorded, tmp_path):
    """The DDP job's run with rank 3's telemetry gone and rank 2's last segment lost: the
    report says so first, with the step rank 2 stopped after. (The last segment, not the
    second: segments are flushed by time, and in a clean-clone run rank 2 wrote steps 0, 1-10
    and 11 in three; losing steps 1-10 left it ending at step 11, never stopped early.)"""
    (run,) = sql(recorded.runs_dir, "SELECT run_id FROM runs WHERE name = 'ddp'")
    copy = tmp_path / "runs" / run["run_id"]
    shutil.copytree(recorded.runs_dir / run["run_id"], copy)
    shutil.rmtree(copy / "telemetry" / "rank=00003")
    rank_2 = copy / "telemetry" / "rank=00002"
    sequences = sorted(path.stem.rsplit("-", 1)[1] for path in rank_2.glob("steps-*.parquet"))
    assert len(sequences) >= 2, f"rank 2 wrote its steps in one segment: {sequences}"
    for path in rank_2.glob(f"*-{sequences[-1]}.parquet"):
        path.unlink()
    report = json.loads(cli(tmp_path / "runs", "report", "ddp", "--json"))  # ingests the copy
    (kept,) = sql(tmp_path / "runs", "SELECT max(step) AS last FROM steps WHERE rank = 2")
    capture = report["capture"]
    assert capture["ranks_without_steps"] == [3]
    assert capture["stopped_early"] == [{"rank": 2, "last_step": kept["last"]}]
    assert kept["last"] < capture["last_step"] == STEPS - 1
    text = cli(tmp_path / "runs", "report", "ddp")
    findings = text.split("\n\n", 1)[1].splitlines()
    assert findings[0].startswith("capture: rank 3 of 4 recorded no step")
    assert findings[1].startswith(f"capture: rank 2 recorded no step after step {kept['last']}")


@pytest.fixture(scope="module")
def step_styles(tmp_path_factory) -> tuple[Path, dict]:
    """step_styles_train.py's three styles, each recorded into a runs dir of its own (one rank
    each: two at a time), and LBFGS bare too; (root, {name: result})."""
    root = tmp_path_factory.mktemp("styles")
    runs = {style: (Job("step_styles_train.py", ("--style", style), nproc=None),
                    root / style) for style in STEP_STYLES}  # fmt: skip
    runs["bare"] = (runs["lbfgs"][0], None)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda name: launch(runs[name][0], root, runs[name][1], name), runs)
        return root, dict(zip(runs, results, strict=True))


@pytest.mark.parametrize("style, phases", [
    ("accumulate", {("forward", 0), ("forward", 1), ("forward", 2), ("backward", 0),
                    ("backward", 1), ("backward", 2), ("optimizer", -1), ("data", -1)}),
    ("two-optimizers", {("forward", 0), ("backward", 0), ("optimizer", -1), ("data", -1)}),
    ("lbfgs", {("forward", 0), ("forward", 1), ("forward", 2), ("backward", 0),
               ("backward", 1), ("backward", 2), ("optimizer", -1), ("data", -1)}),
])  # fmt: skip
def test_a_step_is_the_optimizer_step_however_the_job_writes_it(step_styles, style, phases):
    """Gradient accumulation (3 micro-batches a step), two optimizers stepped one after the
    other, LBFGS (its closure's forward and backward run 3 times inside its step): 10 steps
    each, as the job counts them (LBFGS's losses the same bare and recorded)."""
    root, results = step_styles
    under = results[style]
    assert under.returncode == 0, under.stderr[-3000:]
    assert len(losses(under)) == 10
    if style == "lbfgs":  # the closure inside the optimizer step: the most hooks in play
        assert losses(results["bare"]) == losses(under)
    rows = sql(root / style, "SELECT step, phase, micro_batch, count(*) AS n FROM spans "
               "WHERE name = 'ranktrace.phase' GROUP BY ALL")  # fmt: skip
    assert {r["step"] for r in rows} == set(range(10))
    assert {(r["phase"], r["micro_batch"]) for r in rows if r["step"] > 0} == phases
    optimizer = {r["n"] for r in rows if r["phase"] == "optimizer" and r["step"] > 0}
    # two optimizers: two optimizer phases; LBFGS: its step, cut by 3 closures, in 4 pieces
    assert optimizer == {{"accumulate": 1, "two-optimizers": 2, "lbfgs": 4}[style]}


def test_the_api_records_its_steps_phases_and_micro_batches(tmp_path):
    """tests/jobs/api_train.py (ranktrace.init / step / phase) under plain torchrun, 2 ranks;
    `ranktrace report` ingests the finished run on its own. Under `ranktrace run` (init() then
    only joins that run) its losses are the same."""
    api = Job("api_train.py", (str(tmp_path), "--steps", "6"), nproc=2)
    result = launch(api, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(cli(tmp_path, "report", "api", "--json"))
    assert report["status"] == "completed" and report["launcher"] == "ranktrace.init"
    phases = sql(tmp_path, "SELECT phase, micro_batch, count(*) AS n FROM spans "
                 "WHERE name = 'ranktrace.phase' AND rank = 0 GROUP BY ALL")  # fmt: skip
    counts = {(row["phase"], row["micro_batch"]): row["n"] for row in phases}
    assert counts == {("data", -1): 12, ("forward", 0): 6, ("forward", 1): 6,
                      ("backward", 0): 6, ("backward", 1): 6, ("optimizer", -1): 6}  # fmt: skip
    steps = sql(tmp_path, "SELECT count(*) AS n, min(tokens) AS tokens FROM steps")
    assert steps == [{"n": 12, "tokens": 32}]
    under = launch(api, tmp_path, tmp_path / "under", "api-under")
    assert under.returncode == 0 and losses(under) == losses(result) and len(losses(result)) == 6


def test_a_command_that_is_not_there_is_a_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ranktrace.app.cli", "run", "--runs-dir",
                             str(tmp_path), "--", "no-such-launcher", "train.py"],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2
    assert "command not found: no-such-launcher" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("exit_code", [0, 3])
def test_a_store_that_cannot_take_the_run_never_changes_the_jobs_exit_code(tmp_path, exit_code):
    """The job ran and exited; ingesting its run then fails (here the store is not a DuckDB
    file): one line says so, the exit code is the job's, the segments are kept."""
    (tmp_path / "ranktrace.duckdb").write_bytes(b"not a duckdb file" * 300)
    job = f"import sys; print('job ran'); sys.exit({exit_code})"
    result = subprocess.run([sys.executable, "-m", "ranktrace.app.cli", "run", "--runs-dir",
                             str(tmp_path), "--", sys.executable, "-c", job],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == exit_code, result.stderr
    assert "job ran" in result.stdout and "Traceback" not in result.stderr
    assert "recorded but not ingested:" in result.stderr
    assert "is not a DuckDB database" in result.stderr
    (run_json,) = tmp_path.glob("*/run.json")
    assert json.loads(run_json.read_text())["exit_code"] == exit_code
