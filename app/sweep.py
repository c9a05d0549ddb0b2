"""`ranktrace sweep`: the same training run at several values of one layout axis, then one
table comparing them (everything else held fixed, as a fair layout comparison needs)."""

from __future__ import annotations

import dataclasses

from ranktrace.app import units
from ranktrace.trainer.config import ConfigError, TrainConfig

SWEEP_AXES = {"tp": "tp", "pp": "pp", "dp": "dp", "zero": "zero", "micro-batches": "micro_batches"}
"""--axis value -> TrainConfig field."""
TABLE_METRICS = ("step_time_s", "compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "mfu",
                 "tokens_per_s", "state_bytes_per_rank")  # fmt: skip


def parse_values(text: str) -> list[int]:
    """`1,2,4` -> [1, 2, 4]; ConfigError for anything else."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--values={text} is not a comma-separated list of integers") from None
    if len(set(values)) != len(values) or len(values) < 2:
        raise ConfigError(f"--values={text}: give two or more different values")
    return values


def sweep_configs(base: TrainConfig, axis: str, values: list[int]) -> list[TrainConfig]:
    """One validated config per value, named `<name>-<axis><value>`; ConfigError names the
    value that cannot work before anything is launched."""
    field = SWEEP_AXES[axis]
    stem = base.run_name or f"sweep-{axis}"
    configs = []
    for value in values:
        cfg = dataclasses.replace(
            base, **{field: value}, run_name=f"{stem}-{axis}{value}", run_id="", nproc=0
        )
        try:
            cfg.validate()
        except ConfigError as err:
            raise ConfigError(f"--axis {axis} value {value}: {err}") from None
        configs.append(cfg)
    return configs


def sweep_table(con, run_ids: list[str], axis: str) -> tuple[list[str], list[tuple]]:
    """(columns, rows) for people: one row per run with its axis value and TABLE_METRICS,
    named and formatted as everywhere else (app/units.py: MFU in %, memory in MiB)."""
    from ranktrace.analysis.run import resolve_run, run_metrics

    columns = [axis, "run", *(units.name(metric) for metric in TABLE_METRICS)]
    rows = []
    for run_id in run_ids:
        row = resolve_run(con, run_id)
        metrics = run_metrics(con, row)
        value = row[SWEEP_AXES[axis]]
        rows.append(
            (
                value,
                run_id,
                *(units.formatted(metric, metrics.get(metric)) for metric in TABLE_METRICS),
            )
        )
    return columns, rows
