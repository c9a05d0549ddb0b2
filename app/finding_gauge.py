"""Findings as OpenTelemetry metrics, for a Grafana or Prometheus user who never opens the
dashboard: the gauge `ranktrace.straggler.slowdown` (unit 1: the finding's slowdown, × its
peers), one series per finding, sent over OTLP/HTTP as each is found.

Attributes: `rank` where one rank is located, else `candidates` (the ranks the evidence allows,
comma-separated); `kind` (compute, data, host, communication); `host` (the rank's, a slow
node's, or the candidates' hosts, comma-separated); `axis` where one is known; `run_id`.
"""

from __future__ import annotations

METRIC_NAME = "ranktrace.straggler.slowdown"


def finding_attributes(finding: dict, rank_hosts: dict[int, str], run_id: str) -> dict:
    """The gauge's attributes of one straggler finding (a report's `stragglers` entry)."""
    attributes = {"kind": finding["kind"], "run_id": run_id}
    if finding["rank"] is not None:
        attributes["rank"] = int(finding["rank"])
        hosts = [rank_hosts.get(int(finding["rank"]), "")]
    else:
        ranks = [int(r) for r in finding.get("candidates") or []]
        attributes["candidates"] = ",".join(map(str, ranks))
        hosts = (
            finding.get("hosts")
            or finding.get("candidate_hosts")
            or sorted({rank_hosts.get(r, "") for r in ranks})
        )
    attributes["host"] = ",".join(h for h in hosts if h)
    if finding.get("axis"):
        attributes["axis"] = finding["axis"]
    return attributes


class FindingGauge:
    """The gauge, exported to `endpoint` (e.g. http://collector:4318) as soon as it is set."""

    def __init__(self, endpoint: str, run_id: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        exporter = OTLPMetricExporter(endpoint=endpoint.rstrip("/") + "/v1/metrics")
        # exported on each finding (force_flush); the period only repeats the last values
        reader = PeriodicExportingMetricReader(exporter, export_interval_millis=60_000)
        resource = Resource.create({"service.name": "ranktrace", "ranktrace.run_id": run_id})
        self.provider = MeterProvider(metric_readers=[reader], resource=resource)
        meter = self.provider.get_meter("ranktrace.watch")
        self.gauge = meter.create_gauge(
            METRIC_NAME, unit="1", description="a straggler's slowdown (x its peers)"
        )
        self.run_id = run_id

    def record(self, finding: dict, rank_hosts: dict[int, str]) -> None:
        """Set the finding's series and send it now."""
        attributes = finding_attributes(finding, rank_hosts, self.run_id)
        self.gauge.set(float(finding["slowdown"]), attributes)
        self.provider.force_flush()

    def close(self) -> None:
        self.provider.shutdown()
