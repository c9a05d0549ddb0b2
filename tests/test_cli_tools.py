"""`ranktrace plan` (layouts that fit, and why others do not) and `ranktrace export-trace`
(a trace-event JSON file Perfetto loads), run as a user runs them."""

from __future__ import annotations

import json
import re

import pytest

from ranktrace.analysis.memory import ModelShape, predict
from ranktrace.analysis.planner import HEADROOM
from ranktrace.trainer.config import MODELS
from tests.conftest import DASH_STRAGGLER_RANK, ranktrace


def _plan(*args: str, runs_dir):
    return ranktrace("plan", *args, runs_dir=runs_dir)


def test_plan_of_7b_on_64_h100s_explains_and_ranks(tmp_path):
    text = _plan("--model", "7b", "--gpus", "64", "--gpu-mem", "80", runs_dir=tmp_path)
    assert text.returncode == 0, text.stderr
    assert ("6.7B params × 16 B/param = 108 GB > 80 GB per device: data parallelism alone "
            "cannot fit this model; shard with ZeRO/TP/PP") in text.stdout  # fmt: skip
    result = _plan("--model", "7b", "--gpus", "64", "--gpu-mem", "80", "--json",
                   runs_dir=tmp_path)  # fmt: skip
    plans = json.loads(result.stdout)["plans"]
    assert len(plans) >= 10
    assert all(p["tp"] * p["pp"] * p["dp"] == 64 for p in plans)
    assert all(p["tp"] <= 8 for p in plans)  # TP within a node
    assert all(p["memory_gb"] <= 80 * (1 - HEADROOM) for p in plans)
    assert [p["step_s"] for p in plans] == sorted(p["step_s"] for p in plans)
    assert not any(p["tp"] == 1 and p["pp"] == 1 and p["zero"] == 0 for p in plans)
    # The memory figures are the analysis memory model's (the one reports compare with runs).
    best, m = plans[0], MODELS["7b"]
    shape = ModelShape(m.vocab_size, m.hidden, m.n_layers, m.n_heads, m.ffn_hidden)
    stages = predict(shape, best["tp"], best["pp"], best["dp"], best["zero"], "bf16",
                     micro_batch=1, seq_len=4096, micro_batches=best["micro_batches"])  # fmt: skip
    assert best["memory_gb"] == pytest.approx(max(s.total_bytes for s in stages) / 1e9)


def test_plan_that_cannot_fit_says_why_and_misuse_exits_2(tmp_path):
    none_fit = _plan("--model", "7b", "--gpus", "8", "--gpu-mem", "24", runs_dir=tmp_path)
    assert none_fit.returncode == 1
    assert "no layout of 8 devices fits in 22 GB" in none_fit.stdout
    partial = _plan("--model", "7b", "--gpus", "12", "--gpu-mem", "80", runs_dir=tmp_path)
    assert partial.returncode == 2
    assert "not a whole number of nodes of 8" in partial.stderr
    assert len(partial.stderr.strip().splitlines()) == 1


def _check_trace_event_format(trace: dict) -> None:
    """The JSON object form of Google's Trace Event Format, as Perfetto and chrome://tracing
    read it: complete events ("X") with µs timestamps and durations, metadata events ("M")
    naming processes and threads."""
    assert set(trace) >= {"traceEvents"} and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    for event in trace["traceEvents"]:
        assert event["ph"] in ("X", "M"), event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert isinstance(event["name"], str) and event["name"]
        if event["ph"] == "X":
            assert isinstance(event["ts"], int | float) and event["ts"] >= 0
            assert isinstance(event["dur"], int | float) and event["dur"] >= 0
            assert isinstance(event.get("args", {}), dict)
        else:
            assert event["name"] in ("process_name", "process_sort_index", "thread_name")
            key = "sort_index" if event["name"] == "process_sort_index" else "name"
            assert key in event["args"]


def test_export_trace_writes_a_perfetto_trace_of_every_rank(dash_runs_dir, tmp_path):
    out = tmp_path / "trace.json"
    result = ranktrace("export-trace", "slow", "--steps", "4-5", "-o", str(out),
                       "--runs-dir", str(dash_runs_dir), runs_dir=dash_runs_dir)  # fmt: skip
    assert result.returncode == 0, result.stderr
    trace = json.loads(out.read_text())
    _check_trace_event_format(trace)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 1, 2, 3}  # one process per rank
    assert {e["args"]["step"] for e in complete} == {4, 5}
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"step", "phases", "collectives"}
    # The injected 3x compute straggler's forward work is the longest of its stage.
    forward = {}
    for e in complete:
        if e["name"].startswith("forward"):
            forward[e["pid"]] = forward.get(e["pid"], 0) + e["dur"]
    assert max(forward, key=forward.get) == DASH_STRAGGLER_RANK
    # without --steps: the run's last 3 traced steps
    default = ranktrace("export-trace", "slow", "-o", str(out), "--runs-dir",
                        str(dash_runs_dir), runs_dir=dash_runs_dir)  # fmt: skip
    assert default.returncode == 0, default.stderr
    last = int(re.search(r": steps (\d+)-(\d+) of", default.stdout).group(2))
    steps = {
        e["args"]["step"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"
    }
    assert steps == {last - 2, last - 1, last}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("slow", "--steps", "5-4"), "ends before it starts"),
        (("slow", "--steps", "x"), "is not a step range"),
        (("slow", "--steps", "900-901"), "has no spans in steps 900-901"),
        (("no-such-run", "--steps", "1-2"), "no run with id or name 'no-such-run'"),
    ],
)
def test_export_trace_misuse_is_one_line_exit_2(dash_runs_dir, tmp_path, args, message):
    out = tmp_path / "t.json"
    result = ranktrace("export-trace", *args, "-o", str(out), "--runs-dir", str(dash_runs_dir),
                       runs_dir=dash_runs_dir)  # fmt: skip
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()
