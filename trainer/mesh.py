"""The 3D device mesh (pp, dp, tp): each rank's coordinates and its process group on every axis.

Rank layout, TP innermost so that a TP group sits on one node:
    rank = (pp_rank * dp + dp_rank) * tp + tp_rank
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits in the mesh."""

    pp: int
    dp: int
    tp: int


def coordinates_of(rank: int, pp: int, dp: int, tp: int) -> Coordinates:
    """The (pp, dp, tp) coordinates of a global rank for the TP-innermost layout."""
    if not 0 <= rank < pp * dp * tp:
        raise ValueError(f"rank {rank} is outside a mesh of {pp * dp * tp} ranks")
    return Coordinates(pp=rank // (dp * tp), dp=(rank // tp) % dp, tp=rank % tp)


def rank_of(coords: Coordinates, dp: int, tp: int) -> int:
    """The global rank at the given coordinates (inverse of `coordinates_of`)."""
    return (coords.pp * dp + coords.dp) * tp + coords.tp


class ParallelDims:
    """The mesh of this job: degrees, this rank's coordinates, and one process group per axis.

    Built on `init_device_mesh` after `init_process_group`. Pass it explicitly; there is no global.
    """

    def __init__(self, pp: int, dp: int, tp: int, device_type: str = "cpu") -> None:
        self.pp, self.dp, self.tp = pp, dp, tp
        self.world_size = pp * dp * tp
        self.rank = dist.get_rank()
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"pp*dp*tp = {pp}*{dp}*{tp} = {self.world_size} but the job has "
                f"{dist.get_world_size()} ranks"
            )
        self.mesh: DeviceMesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=AXES)
        self.coords = coordinates_of(self.rank, pp, dp, tp)
        self._groups = {axis: self.mesh.get_group(axis) for axis in AXES}
        self._groups["world"] = dist.group.WORLD
        self._sizes = {"pp": pp, "dp": dp, "tp": tp, "world": self.world_size}

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank on `axis` ('pp', 'dp', 'tp' or 'world')."""
        return self._groups[axis]

    def size(self, axis: str) -> int:
        return self._sizes[axis]

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.pp - 1

    def stage_peer(self, offset: int) -> int:
        """Global rank of the rank `offset` pipeline stages away with the same dp and tp."""
        c = self.coords
        return rank_of(Coordinates(c.pp + offset, c.dp, c.tp), self.dp, self.tp)
