"""The detection matrix: real multi-process runs with injected faults, diagnosed by
`ranktrace report --json` from the real store. Each fault must be found on exactly the injected
rank, with the right kind, its onset within 5 steps of the injection start; a healthy run, a
stage imbalance and varying sequence lengths must name no straggler. Also: remedies, the
shared-core replay, `ranktrace compare` on one- and two-axis pairs, the memory model against
the trainer's buffers for ZeRO 0/1/2, and `ranktrace sweep`. (An injected crash:
test_fault_tolerance.py.)"""

from __future__ import annotations

import json

import pytest

from tests.conftest import ranktrace
from tests.margins import at_least, at_most, machine_finding, only_findings

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

ONSET = 8
STEPS = ("--steps", "30")
RUNS = {
    # name: train arguments
    "healthy": ("--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1"),
    "compute": ("--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1",
                "--inject", f"compute:rank=6,factor=2,from={ONSET}"),
    "link": ("--tp", "2", "--pp", "2", "--dp", "2", "--zero", "2",
             "--inject", f"link:rank=5,delay=0.01,from={ONSET}"),
    "link-one-axis": ("--tp", "2", "--dp", "2",
                      "--inject", f"link:rank=1,delay=0.05,axis=dp,from={ONSET}"),
    "data": ("--pp", "2", "--dp", "2", "--inject", f"data:rank=2,delay=0.05,from={ONSET}"),
    # 0.4 s pauses: 4 pauses of 0.2 s cost 3.5% of a timing-loop run's replayed time on a slow
    # VM beside the loop's job (4.7% had each rank a core), under the 5% a finding must cost,
    # and the run was rightly healthy by that rule (rank_findings had it at 9.1% by its excess)
    "pause": ("--tp", "2", "--dp", "2", "--zero", "1",
              "--inject", f"pause:rank=3,every=6,duration=0.4,from={ONSET}"),
    # `small`, whose layers outweigh its head: moving one is a gain the replay can price. A
    # rank per stage: with pp 2 x dp 2 the 4 ranks take turns on the 2 cores, and moving a
    # layer gained 0.5-5.6% in the shared-core replay (-0.8% in a timing-loop run: no remedy;
    # 5.2% measured, benchmarks/remedy_accuracy.py); 2 ranks beside the loop's job, 12.4-12.9%
    "stage": ("--model", "small", "--pp", "2", "--stage-layers", "3,1",
              "--micro-batches", "4", "--seq-len", "128"),
    # every micro-batch of its own length: which rank is slowest changes with the tokens
    "lengths": ("--model", "small", "--dp", "2", "--micro-batches", "2", "--seq-len", "128",
                "--seq-len-dist", "uniform:16,128"),
}  # fmt: skip


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("detection") / "runs"
    for name, args in RUNS.items():
        result = ranktrace("train", *args, *STEPS, "--run-name", name, runs_dir=runs_dir)
        assert result.returncode == 0, (name, result.stdout[-2000:], result.stderr[-2000:])
    return runs_dir


def _report(store, name: str) -> dict:
    result = ranktrace("report", name, "--runs-dir", str(store), "--json", runs_dir=store)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.timing
def test_healthy_run_has_no_findings(store):
    report = _report(store, "healthy")
    only_findings(report["stragglers"], [])
    at_most("imbalances", len(report["imbalances"]), 0, report["imbalances"])
    assert 0 < report["mfu"] <= 1 and report["step_time_s"] > 0
    # 8 ranks on this machine's cores: the report says the host is oversubscribed.
    assert any("oversubscribed" in note and "8 ranks" in note for note in report["notes"])


@pytest.mark.parametrize(
    ("name", "rank", "kind"),
    [("compute", 6, "compute"), ("link", 5, "communication"), ("data", 2, "data"),
     ("pause", 3, "host")],
)  # fmt: skip
@pytest.mark.timing
def test_injected_fault_is_found_on_its_rank_with_its_kind(store, name, rank, kind):
    report = _report(store, name)
    (finding,) = only_findings(report["stragglers"], [(rank, kind)])
    at_most("onset's distance from the injection, steps", abs(finding["first_step"] - ONSET), 5)
    at_least("slowdown", finding["slowdown"], 1.15)
    assert finding["cost_pct"] > 0 and finding["whatif_step_time_s"] < finding["step_time_s"]
    at_most("imbalances", len(report["imbalances"]), 0, report["imbalances"])
    injected = [e for e in report["events"] if e["kind"] == "fault_injected"]
    assert [e["rank"] for e in injected] == [rank]
    if kind == "communication":  # slow transfer on every axis the rank's groups span
        assert set(finding["axes"]) == {"tp", "pp", "dp"}
    if kind == "compute":  # the trainer on CPU measures its main thread's CPU time
        assert "its CPU time in forward" in finding["evidence"][1]
    if name == "pause":  # time outside every phase, not waiting for a core
        assert (finding["pattern"], finding["cause"]) == ("transient", "pause")
    else:
        assert finding["pattern"] == "chronic"
    if name == "compute":  # an MFU drop where the fault starts is explained by the straggler,
        # not by its symptom. Whether there is one is the job's: with 8 ranks on 2 cores, the
        # others take rank 6's share of the cores while they wait, and in one CI run the step
        # time rose only over steps 8-15 (MFU 1.32% -> 1.13%, ±0.2 step to step), short of the
        # drop test's 4 noise deviations. test_demo asserts a drop (factor 3, model `small`).
        near = [d for d in report["efficiency_drops"] if abs(d["step"] - ONSET) <= 5]
        explained = f"rank 6 compute straggler from step {finding['first_step']}"
        assert len(near) <= 1 and all(d["explained_by"] == explained for d in near), near


@pytest.mark.timing
def test_compute_less_its_wait_for_a_core_is_about_its_cpu_time(store):
    """8 ranks taking turns on 2 cores: a healthy rank's compute wall time less the time its
    main thread waited for a core in it is about the CPU time it spent there (a little less:
    the phases' CPU time also counts the calls' own; 0.85 of it here). The wait inside the calls
    was once counted as compute's too: the compute left was -0.08 x its CPU time, and a stage's
    compute read 0."""
    result = ranktrace("sql", "SELECT b.pp, median((work_s - work_core_wait_s) / work_cpu_s) AS r "
                       "FROM step_breakdown b JOIN runs USING (run_id) WHERE name = 'healthy' "
                       "AND step >= 1 AND work_cpu_s > 0 GROUP BY b.pp ORDER BY b.pp",
                       "--format", "json", "--runs-dir", str(store), runs_dir=store)  # fmt: skip
    assert result.returncode == 0, result.stderr
    ratios = [row["r"] for row in json.loads(result.stdout)]
    assert len(ratios) == 2, ratios
    at_least("compute less its wait over CPU time, lowest stage", min(ratios), 0.7)
    at_most("compute less its wait over CPU time, highest stage", max(ratios), 1.05)


@pytest.mark.timing
def test_link_on_one_axis_reports_its_group_as_candidates(store):
    """Only rank 1's dp link is slow: its dp group {1, 3} is slow and nothing tells which
    end is at fault, so both are candidates and no rank is blamed."""
    (finding,) = only_findings(_report(store, "link-one-axis")["stragglers"],
                               [(None, "communication")])  # fmt: skip
    assert finding["axis"] == "dp" and finding["candidates"] == [1, 3], finding


@pytest.mark.timing
def test_uneven_stage_layers_is_a_stage_imbalance_not_a_straggler(store):
    report = _report(store, "stage")
    only_findings(report["stragglers"], [])
    (imbalance,) = report["imbalances"]
    assert imbalance["kind"] == "stage" and imbalance["stage"] == 0
    at_least("stage 0's excess", imbalance["excess"], 0.15)
    assert imbalance["cost_pct"] > 0


def test_memory_model_matches_the_trainer_buffers_for_zero_0_1_2(store):
    """Predicted params + grads + optimizer bytes per rank vs the sizes of the buffers each
    rank allocated, within 5% (buckets are padded to a multiple of dp)."""
    for name, zero in (("data", 0), ("healthy", 1), ("link", 2)):
        report = _report(store, name)
        assert report["layout"]["zero"] == zero
        memory = report["memory"]
        assert len(memory) == 8 if name != "data" else len(memory) == 4
        for rank in memory:
            assert rank["state_ratio"] == pytest.approx(1.0, abs=0.05), (name, rank)
            assert rank["measured_rss_peak_bytes"] > rank["predicted_total_bytes"]


def test_compare_one_axis_pair_and_warn_on_two(store):
    one = ranktrace("compare", "healthy", "pause", "--runs-dir", str(store), "--json",
                    runs_dir=store)  # fmt: skip
    assert one.returncode == 0, one.stderr
    result = json.loads(one.stdout)
    assert result["differing_axes"] == ["pp"] and not result["confounded"]
    metrics = {m["metric"]: m for m in result["metrics"]}
    assert metrics["pp_comm_s"]["a"] > 0 and metrics["step_time_s"]["ratio"] > 0
    two = ranktrace("compare", "pause", "data", "--runs-dir", str(store), runs_dir=store)
    assert two.returncode == 0, two.stderr
    assert "WARNING" in two.stdout and "confounded" in two.stdout
    assert "tp" in two.stdout and "pp" in two.stdout


def test_report_of_an_unknown_run_is_one_line_exit_2(store):
    result = ranktrace("report", "nope", "--runs-dir", str(store), runs_dir=store)
    assert result.returncode == 2
    assert "no run with id or name 'nope'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_sweep_runs_one_axis_and_prints_one_row_per_value(tmp_path):
    runs_dir = tmp_path / "runs"
    args = ("--axis", "tp", "--values", "1,2", "--steps", "4", "--run-name", "sw")
    result = ranktrace("sweep", *args, "--runs-dir", str(runs_dir), runs_dir=runs_dir)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    table = result.stdout.split("one-axis sweep of tp")[1].splitlines()
    rows = [line.split() for line in table if line[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"]
    names = sorted(r["name"] for r in (json.loads(p.read_text())
                                       for p in runs_dir.glob("*/run.json")))  # fmt: skip
    assert names == ["sw-tp1", "sw-tp2"]


@pytest.mark.timing
def test_remedies_a_rebalanced_split_loader_workers_and_a_layout_change(store):
    """3 layers on stage 0 and 1 on stage 1: the remedy moves a layer (--stage-layers 2,2),
    priced on the layers moved (never the stage at its mean), and `ranktrace remedy` lists it;
    a data straggler's remedy (loader workers) is not one `--apply` can train here; a healthy
    run far below its devices' best layout gets the one-axis change with its predicted MFU."""
    report = _report(store, "stage")
    (imbalance,) = report["imbalances"]
    remedy = imbalance["remedy"]
    assert remedy["settings"] == {"stage_layers": "2,2"}, remedy
    assert "--stage-layers 2,2" in remedy["action"]
    assert 0 <= remedy["predicted_gain_pct"] < imbalance["cost_pct"] + 5
    assert remedy["predicted_step_s"] <= report["step_time_s"] * 1.05
    listed = ranktrace("remedy", "stage", "--runs-dir", str(store), runs_dir=store)
    assert listed.returncode == 0 and "--stage-layers 2,2" in listed.stdout, listed.stderr
    data = _report(store, "data")["stragglers"][0]["remedy"]
    assert data["settings"] == {"data_loading": 2} and "num_workers" in data["action"]
    refused = ranktrace("remedy", "data", "--apply", "--runs-dir", str(store), runs_dir=store)
    assert refused.returncode == 2 and "cannot be carried out" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) <= 2 and "Traceback" not in refused.stderr
    # the healthy tp 2 run: its tp all-reduces over gloo cost more than any layout of its 8
    # ranks without them, which the layout remedy (analysis/layout_remedy.py) says
    healthy = _report(store, "healthy")
    layout = healthy["layout_remedy"]
    assert layout is not None and layout["settings"].get("tp") == 1, layout
    assert layout["predicted_mfu"] > healthy["mfu"] and layout["predicted_gain_pct"] >= 5
    listed = ranktrace("remedy", "healthy", "--runs-dir", str(store), runs_dir=store)
    assert listed.returncode == 0 and "the layout: change the layout" in listed.stdout
    assert "--tp 1" in listed.stdout and ", MFU " in listed.stdout


@pytest.mark.timing
def test_varying_sequence_lengths_are_a_random_imbalance_not_a_slow_rank(store):
    """Lengths 16-128 per micro-batch on dp 2: the spread is named "varying sequence lengths"
    with its cost and evidence, length bucketing is its remedy, and no rank is blamed, even
    where one rank drew longer micro-batches for a stretch of steps (1.40x its peer's compute
    over 17 steps once, 0.98x for its tokens). Two micro-batches of two sequences a rank: with
    four of one sequence each, per-micro-batch overheads blurred the compute's dependence on
    the tokens (r = 0.51-0.66 over three seeds, 0.47 in a CI run, which then named rank 1; two
    of two: r = 0.89-0.95)."""
    report = _report(store, "lengths")
    only_findings(report["stragglers"], [])
    (imbalance,) = report["imbalances"]
    assert imbalance["kind"] == "random", imbalance
    at_least("the random imbalance's cost, %", imbalance["cost_pct"], 5)
    assert any("follows the micro-batches' tokens" in line for line in imbalance["evidence"])
    assert (imbalance["remedy"] or {}).get("settings") == {"length_buckets": 8}, imbalance
    (cause,) = [c for c in report["slowdown_by_cause"] if c["kind"] == "random"]
    assert cause["cause"] == "varying sequence lengths (random imbalance)"
    machine = {(f["rank"], f["kind"]) for f in report["stragglers"] if machine_finding(f)}
    if not machine:
        at_least("its share of S - 1, %", cause["share_pct"], 80)
    else:  # A machine's finding, allowed above, has its share of S - 1, and what the causes
        # leave is then the machine's waits outside its steps as much as the job's: beside
        # another pytest worker a wait for a core took 57% and 9% was left, the lengths 34%
        # (78% of the rest). Judged among the causes named: the job's is the lengths.
        named = [c for c in report["slowdown_by_cause"] if (c["rank"], c["kind"]) not in machine]
        at_least("its share of the job's named causes' shares, %",
                 100 * cause["share_pct"] / sum(c["share_pct"] for c in named), 80)  # fmt: skip
