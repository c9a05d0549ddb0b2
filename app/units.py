"""One set of names and units for every metric a table or chart shows (CLI, report, dashboard):
MFU in %, memory in MiB or GiB, times in ms under a second and s above, readable names."""

from __future__ import annotations

import math

METRIC_LABELS = {
    "step_time_s": "step time",
    "compute_s": "compute",
    "tp_comm_s": "tp communication",
    "pp_comm_s": "pipeline wait",
    "dp_comm_s": "dp communication",
    "data_s": "data loading",
    "optimizer_s": "optimizer",
    "mfu": "MFU",
    "tokens_per_s": "tokens/s",
    "state_bytes_per_rank": "state per rank (predicted)",
    "rss_peak_bytes_per_rank": "peak RSS per rank",
}
"""Metric names (analysis.run.COMPARED_METRICS and the rest) in words."""
MIB, GIB = 2**20, 2**30


def name(metric: str) -> str:
    """The metric's name in words: a table's row or column whose cells carry their unit
    (`formatted`)."""
    return METRIC_LABELS.get(metric, metric.replace("_", " "))


def label(metric: str) -> str:
    """The metric's name in words with its unit, for a chart's axis of plain numbers (`scaled`):
    "step time (s)", "MFU (%)"."""
    return f"{name(metric)} ({unit(metric)})" if unit(metric) else name(metric)


def unit(metric: str) -> str:
    if metric == "mfu":
        return "%"
    if metric.endswith("_bytes_per_rank") or metric.endswith("_bytes"):
        return "MiB"
    if metric.endswith("_s") and metric != "tokens_per_s":
        return "s"
    return ""


def scaled(metric: str, value: float | None) -> float | None:
    """`value` in the unit of `label(metric)` (MFU as a percentage, bytes in MiB)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if metric == "mfu":
        return 100.0 * value
    if unit(metric) == "MiB":
        return value / MIB
    return value


def formatted(metric: str, value: float | None) -> str:
    """A table cell: "0.4321 s", "12.3 ms", "7.41%", "554.8 MiB", "1.52 GiB", "6823"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if metric == "mfu":
        return f"{100.0 * value:.2f}%"
    if unit(metric) == "MiB":
        return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / MIB:.1f} MiB"
    if unit(metric) == "s":
        return f"{1000.0 * value:.1f} ms" if abs(value) < 1.0 else f"{value:.3f} s"
    if metric == "tokens_per_s":
        return f"{value:.0f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)
