"""Fault injection: `ranktrace train --inject SPEC` makes one rank slow (or kills it) in a way
that looks, to telemetry, like the real failure it imitates.

    compute:rank=R,factor=F[,from=S][,to=E]   forward and backward take F× as long (real work)
    link:rank=R,delay=SECONDS[,axis=A][,from=S][,to=E]   each collective of R (on axis A) is
                                               slow in transfer, as over a bad NIC
    data:rank=R,delay=SECONDS[,from=S][,to=E]  data loading takes SECONDS longer
    pause:rank=R,every=K,duration=SECONDS[,from=S][,to=E]   a host pause (GC-like) every K steps
    crash:rank=R,step=S                        the rank process dies at the start of step S
    hang:rank=R,step=S                         the rank stops at the start of step S (alive,
                                               in no collective: its peers wait for it)
    io:rank=R,delay=SECONDS[,from=S][,to=E]    the rank's checkpoint writes take SECONDS longer

`from` and `to` are steps (both included; default: the whole run). Parsing errors are
ConfigErrors naming the field, so `ranktrace train` exits 2 with one line.

Crashes and hangs are one-off events: they happen in the first attempt of a launch only, so a
job restarted (`--max-restarts`) or resumed (`--resume`) runs past them.

This module parses and checks specs (no torch: the CLI validates before anything starts);
`trainer/fault_injection.py` applies them inside a rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from ranktrace.trainer.config import ConfigError

LINK_AXES = ("tp", "pp", "dp", "world")
_REQUIRED = {
    "compute": ("rank", "factor"),
    "link": ("rank", "delay"),
    "data": ("rank", "delay"),
    "pause": ("rank", "every", "duration"),
    "crash": ("rank", "step"),
    "hang": ("rank", "step"),
    "io": ("rank", "delay"),
}
ONE_OFF_KINDS = ("crash", "hang")
_OPTIONAL = {
    "compute": ("from", "to"),
    "link": ("axis", "from", "to"),
    "data": ("from", "to"),
    "pause": ("from", "to"),
    "crash": (),
    "hang": (),
    "io": ("from", "to"),
}
_INTS = ("rank", "every", "step", "from", "to")
_FLOATS = ("factor", "delay", "duration")


@dataclass(frozen=True)
class FaultSpec:
    """One parsed `--inject` spec; steps `first_step..last_step` (None: to the end)."""

    text: str
    kind: str
    rank: int
    factor: float = 1.0
    delay_s: float = 0.0
    axis: str | None = None
    every: int = 0
    duration_s: float = 0.0
    first_step: int = 0
    last_step: int | None = None

    def active(self, step: int) -> bool:
        return step >= self.first_step and (self.last_step is None or step <= self.last_step)


def _field_value(text: str, key: str, raw: str):
    if key in _INTS:
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"--inject {text}: {key}={raw} is not an integer") from None
        if value < 0 or (key == "every" and value == 0):
            least = 1 if key == "every" else 0
            raise ConfigError(f"--inject {text}: {key}={raw} must be at least {least}")
        return value
    if key in _FLOATS:
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"--inject {text}: {key}={raw} is not a number") from None
        if key == "factor" and not value >= 1.0:
            raise ConfigError(f"--inject {text}: factor={raw} must be at least 1 (a slowdown)")
        if key != "factor" and not value > 0:
            raise ConfigError(f"--inject {text}: {key}={raw} must be a positive number of seconds")
        return value
    if raw not in LINK_AXES:
        raise ConfigError(f"--inject {text}: axis={raw} is not an axis; choose one of {LINK_AXES}")
    return raw


def parse_fault(text: str) -> FaultSpec:
    """Parse `kind:key=value,...`; ConfigError names the first bad part and the valid forms."""
    kind, sep, body = text.partition(":")
    if kind not in _REQUIRED:
        raise ConfigError(
            f"--inject {text}: unknown fault kind '{kind}'; choose one of {sorted(_REQUIRED)} "
            f"(e.g. compute:rank=1,factor=2)"
        )
    fields: dict = {}
    for part in body.split(",") if sep and body else []:
        key, eq, raw = part.partition("=")
        if not eq or not raw:
            raise ConfigError(f"--inject {text}: '{part}' is not key=value")
        allowed = _REQUIRED[kind] + _OPTIONAL[kind]
        if key not in allowed:
            raise ConfigError(f"--inject {text}: {kind} takes {', '.join(allowed)}, not '{key}'")
        fields[key] = _field_value(text, key, raw)
    missing = [key for key in _REQUIRED[kind] if key not in fields]
    if missing:
        raise ConfigError(f"--inject {text}: {kind} needs {', '.join(k + '=' for k in missing)}")
    first, last = fields.get("from", 0), fields.get("to")
    if kind in ONE_OFF_KINDS:
        first = last = fields["step"]
    if last is not None and last < first:
        raise ConfigError(f"--inject {text}: to={last} is before from={first}")
    return FaultSpec(
        text=text,
        kind=kind,
        rank=fields["rank"],
        factor=fields.get("factor", 1.0),
        delay_s=fields.get("delay", 0.0),
        axis=fields.get("axis"),
        every=fields.get("every", 0),
        duration_s=fields.get("duration", 0.0),
        first_step=first,
        last_step=last,
    )


def check_faults(specs: list[str], world_size: int, steps: int) -> list[FaultSpec]:
    """Parse every spec and check it against the job; ConfigError on the first bad one."""
    faults = [parse_fault(text) for text in specs]
    for fault in faults:
        if fault.rank >= world_size:
            raise ConfigError(
                f"--inject {fault.text}: rank={fault.rank} is not in this job; "
                f"choose a rank in 0..{world_size - 1}"
            )
        if fault.first_step >= steps:
            raise ConfigError(
                f"--inject {fault.text}: step {fault.first_step} is never reached with "
                f"--steps={steps}; choose a step below {steps}"
            )
    return faults
