"""The Instrumentor on a plain torch.distributed script (not our trainer), its full undo, and
spans reaching an OpenTelemetry collector over OTLP/HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from ranktrace.analysis.store import open_live, query
from ranktrace.telemetry.exporter import RankIdentity, StepContext
from ranktrace.telemetry.instrument import Instrumentor
from ranktrace.telemetry.run_record import write_run_json
from ranktrace.telemetry.session import RankTelemetry
from tests.conftest import ranktrace
from tests.distributed import run_on_ranks
from tests.otlp_receiver import exported, otlp_receiver

pytestmark = pytest.mark.multiprocess  # real rank processes (see `make test-fast`)

STEPS = 3


def _plain_data_parallel_script(rank: int, world_size: int, run_dir: str) -> dict:
    """A hand-rolled 4-rank script: a dp group of pairs, gradients averaged by all_reduce, an
    async all-reduce waited for, a barrier on the default group. Only the Instrumentor knows
    about ranktrace."""
    pair = rank // 2
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_group = groups[pair]
    identity = RankIdentity("plain", rank, pp=pair, dp=rank % 2, tp=0, host="localhost")
    context = StepContext(0.0, 0.0, 0, 0, 0, epoch_anchor_ns=0)
    metrics = InMemoryMetricReader()
    telemetry = RankTelemetry.open(
        identity,
        Path(run_dir),
        context,
        {},
        flush_every_steps=1,
        meter_provider=MeterProvider(metric_readers=[metrics]),
    )
    instrumentor = Instrumentor(telemetry.recorder)
    original, original_wait = dist.all_reduce, dist.distributed_c10d.Work.wait
    instrumentor.instrument(axis_of_group={dp_group: "dp"})
    wrapped = (
        dist.all_reduce is not original and dist.distributed_c10d.Work.wait is not original_wait
    )
    model = torch.nn.Linear(16, 4)
    for step in range(STEPS):
        telemetry.recorder.begin_step(step)
        with telemetry.recorder.phase("forward"):
            loss = model(torch.randn(8, 16)).square().mean()
        with telemetry.recorder.phase("backward"):
            loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_group)  # [4, 16] and [4] fp32
        dist.all_reduce(torch.ones(2), group=dp_group, async_op=True).wait()  # [2] fp32, async
        dist.barrier()
        if step == 1:
            telemetry.event("checkpoint", step, "saved step 1")
        telemetry.recorder.end_step(loss=loss.item(), tokens=8)
    instrumentor.uninstrument()
    dist.all_reduce(torch.ones(3))  # after uninstrument: not recorded
    telemetry.close()
    (step_time,) = [
        m
        for rm in metrics.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "ranktrace.step.duration"
    ]
    return {
        "wrapped": wrapped,
        "restored": dist.all_reduce is original
        and dist.distributed_c10d.Work.wait is original_wait,
        "step_time_count": step_time.data.data_points[0].count,
    }


def test_instrumenting_a_plain_script_records_its_collectives_and_undoes_fully(tmp_path):
    run_dir = tmp_path / "plain"
    write_run_json(run_dir, {"run_id": "plain", "status": "completed", "layout": {}})
    results = run_on_ranks(_plain_data_parallel_script, 4, str(run_dir))
    assert all(r["wrapped"] and r["restored"] for r in results)
    assert [r["step_time_count"] for r in results] == [STEPS] * 4  # a provider passed in

    con = open_live(tmp_path, "plain")
    try:
        ops = query(
            con,
            "SELECT axis, op, group_size, group_id, bytes, count(*), count(wait_ns) "
            "FROM collectives GROUP BY ALL ORDER BY ALL",
        )[1]
        steps = query(con, "SELECT count(*), count(DISTINCT rank) FROM steps")[1]
        complete = query(con, "SELECT bool_and(complete) FROM collectives")[1]
        events = query(con, "SELECT DISTINCT kind, step, detail FROM events")[1]
    finally:
        con.close()
    per_rank_calls = 4 * STEPS  # four ranks, one call per step each
    calls = 2 * STEPS  # two ranks per group, one call per step each
    assert ops == [  # blocking calls have no wait_ns; the async one's wait is recorded
        ("dp", "all_reduce", 2, 0, 8, calls, calls),  # the async all-reduce of ranks 0 and 1
        ("dp", "all_reduce", 2, 0, 16, calls, 0),  # bias grad
        ("dp", "all_reduce", 2, 0, 256, calls, 0),  # weight grad
        ("dp", "all_reduce", 2, 2, 8, calls, calls),
        ("dp", "all_reduce", 2, 2, 16, calls, 0),
        ("dp", "all_reduce", 2, 2, 256, calls, 0),
        ("world", "barrier", 4, 0, 0, per_rank_calls, 0),
    ]
    assert steps == [(4 * STEPS, 4)]
    assert complete == [(True,)]
    assert events == [("checkpoint", 1, "saved step 1")]


def test_otlp_endpoint_receives_the_step_spans(tmp_path):
    with otlp_receiver() as (endpoint, received):
        result = ranktrace("train", "--steps", "3", "--seq-len", "16", "--otlp-endpoint",
                           endpoint, runs_dir=tmp_path / "runs")  # fmt: skip
    assert result.returncode == 0, result.stderr
    names = []
    for request in exported(received, "/v1/traces", ExportTraceServiceRequest):
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                names += [span.name for span in scope_spans.spans]
    assert names.count("ranktrace.step") == 3
    assert names.count("ranktrace.phase") >= 3 * 4
