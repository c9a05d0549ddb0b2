"""A job's layout as ranktrace records it, read from the job itself: the DeviceMeshes it built
(dimension names and sizes) or, without one, every rank a data-parallel replica."""

from __future__ import annotations

AXIS_ALIASES = {"tp": ("tp",), "pp": ("pp",), "dp": ("dp", "dp_shard", "dp_replicate", "fsdp")}
"""Which mesh dimensions fill the store's tp / pp / dp coordinates (others keep their own names
in the collectives' axes)."""


def job_layout(meshes: list, rank: int, world: int) -> tuple[dict, dict]:
    """({dimension: size} of the job's widest named mesh, or {"dp": world}; this rank's tp, pp
    and dp coordinates)."""
    named = [m for m in meshes if m.mesh_dim_names]
    if not named:
        return {"tp": 1, "pp": 1, "dp": world}, {"tp": 0, "pp": 0, "dp": rank}
    mesh = max(named, key=lambda m: m.mesh.numel())
    names = list(mesh.mesh_dim_names)
    layout = {name: int(mesh.size(i)) for i, name in enumerate(names)}
    coordinates = {}
    for axis, aliases in AXIS_ALIASES.items():
        dims = [names.index(a) for a in aliases if a in names]
        coordinates[axis] = int(mesh.get_local_rank(dims[0])) if dims else 0
    for axis in AXIS_ALIASES:
        layout.setdefault(axis, 1)
    return layout, coordinates
