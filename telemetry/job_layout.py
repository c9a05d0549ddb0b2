"""A job's layout as ranktrace records it, read from the job itself: the DeviceMeshes it built
(dimension names and sizes), else the torch.distributed.pipelining stages it built (the stage's
process group is the pipeline, its ranks' places the `pp` coordinates, each pipeline a
data-parallel replica), else every rank a data-parallel replica."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

AXIS_ALIASES = {"tp": ("tp",), "pp": ("pp",), "dp": ("dp", "dp_shard", "dp_replicate", "fsdp")}
"""Which mesh dimensions fill the store's tp / pp / dp coordinates (others keep their own names
in the collectives' axes)."""


@dataclass(frozen=True)
class MeshSeen:
    """A DeviceMesh as this rank saw it when it was built: what the layout needs of it, kept
    instead of the mesh, which holds its process groups (a group alive past the job's
    `destroy_process_group` aborts the process at exit: telemetry/comm_hooks.py)."""

    dim_names: tuple[str, ...]
    sizes: tuple[int, ...]
    local_ranks: tuple[int, ...]
    """This rank's place along each dimension."""

    @classmethod
    def of(cls, mesh) -> MeshSeen | None:
        """What `mesh` says without its process groups (a mesh built without them, as a
        sub-mesh is, says as much); None where this rank is not in it."""
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return None
        sizes = tuple(int(size) for size in mesh.mesh.shape)
        return cls(tuple(mesh.mesh_dim_names or ()), sizes, tuple(int(c) for c in coordinate))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class PipelineSeen:
    """What this rank's torch.distributed.pipelining objects said (telemetry/job.py)."""

    stages: list[int] = field(default_factory=list)
    """The stage indices this rank holds (several: an interleaved or V schedule)."""
    num_stages: int | None = None
    group_ranks: list[int] = field(default_factory=list)
    """The global ranks of the stages' process group (the pipeline)."""
    schedule_class: str | None = None
    micro_batches: int | None = None

    def run_record(self) -> dict:
        """run.json's keys for the pipeline: `schedule` and `micro_batches` as the trainer's
        (`ScheduleGPipe` -> gpipe, `Schedule1F1B` -> 1f1b, `ScheduleInterleaved1F1B` ->
        interleaved1f1b) and `pipeline` with the stages and the schedule's class."""
        if not self.stages and self.schedule_class is None:
            return {}
        record = {"pipeline": {"stages": self.num_stages, "schedule_class": self.schedule_class,
                               "ranks": self.group_ranks}}  # fmt: skip
        if self.schedule_class is not None:
            record["schedule"] = self.schedule_class.removeprefix("Schedule").lower()
        if self.micro_batches is not None:
            record["micro_batches"] = int(self.micro_batches)
        return record


def job_layout(meshes: list[MeshSeen], rank: int, world: int,
               pipeline: PipelineSeen | None = None) -> tuple[dict, dict]:  # fmt: skip
    """({dimension: size} of the job's widest named mesh, else of its pipeline, else
    {"dp": world}; this rank's tp, pp and dp coordinates)."""
    named = [m for m in meshes if m.dim_names]
    if not named:
        if pipeline is not None and len(pipeline.group_ranks) > 1:
            return _pipeline_layout(pipeline, rank, world)
        return {"tp": 1, "pp": 1, "dp": world}, {"tp": 0, "pp": 0, "dp": rank}
    mesh = max(named, key=lambda m: m.numel)
    names = list(mesh.dim_names)
    layout = dict(zip(names, mesh.sizes, strict=True))
    coordinates = {}
    for axis, aliases in AXIS_ALIASES.items():
        dims = [names.index(a) for a in aliases if a in names]
        coordinates[axis] = mesh.local_ranks[dims[0]] if dims else 0
    for axis in AXIS_ALIASES:
        layout.setdefault(axis, 1)
    return layout, coordinates


def _pipeline_layout(pipeline: PipelineSeen, rank: int, world: int) -> tuple[dict, dict]:
    """pp = the pipeline's ranks, dp = the pipelines: this rank's place in its pipeline, and
    its pipeline's place among them (pipelines of consecutive ranks, or strided ones)."""
    ranks = sorted(pipeline.group_ranks)
    pp = len(ranks)
    stride = ranks[1] - ranks[0]
    replica = ranks[0] // pp if stride == 1 else ranks[0]
    layout = {"tp": 1, "pp": pp, "dp": max(1, world // pp)}
    return layout, {"tp": 0, "pp": ranks.index(rank) if rank in ranks else 0, "dp": replica}
