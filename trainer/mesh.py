"""The 3D device mesh (pp, dp, tp): each rank's coordinates and its process group on every axis.

Which axis varies fastest over consecutive ranks is the rank order, innermost first. The default
"tp-dp-pp" keeps a TP group on consecutive ranks, so on one node under torchrun:
    rank = (pp_rank * dp + dp_rank) * tp + tp_rank
"dp-tp-pp" puts dp innermost instead (rank = (pp_rank * tp + tp_rank) * dp + dp_rank), which
spreads a TP group over nodes once tp * dp exceeds the ranks per node.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ranktrace.trainer.config import RANK_ORDERS

AXES = ("pp", "dp", "tp")
DEFAULT_RANK_ORDER = RANK_ORDERS[0]


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits in the mesh."""

    pp: int
    dp: int
    tp: int


def _strides(pp: int, dp: int, tp: int, order: str) -> dict[str, int]:
    """Rank distance between neighbours on each axis for rank order `order`."""
    sizes, strides, stride = {"pp": pp, "dp": dp, "tp": tp}, {}, 1
    for axis in order.split("-"):
        strides[axis] = stride
        stride *= sizes[axis]
    return strides


def coordinates_of(
    rank: int, pp: int, dp: int, tp: int, order: str = DEFAULT_RANK_ORDER
) -> Coordinates:
    """The (pp, dp, tp) coordinates of a global rank under rank order `order`."""
    if not 0 <= rank < pp * dp * tp:
        raise ValueError(f"rank {rank} is outside a mesh of {pp * dp * tp} ranks")
    sizes, strides = {"pp": pp, "dp": dp, "tp": tp}, _strides(pp, dp, tp, order)
    return Coordinates(**{axis: rank // strides[axis] % sizes[axis] for axis in AXES})


def rank_of(coords: Coordinates, pp: int, dp: int, tp: int, order: str = DEFAULT_RANK_ORDER) -> int:
    """The global rank at the given coordinates (inverse of `coordinates_of`)."""
    strides = _strides(pp, dp, tp, order)
    return sum(getattr(coords, axis) * strides[axis] for axis in AXES)


def rank_grid(pp: int, dp: int, tp: int, order: str = DEFAULT_RANK_ORDER) -> torch.Tensor:
    """[pp, dp, tp] global ranks: the device mesh of rank order `order`."""
    grid = torch.empty(pp, dp, tp, dtype=torch.int)
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        grid[p, d, t] = rank_of(Coordinates(p, d, t), pp, dp, tp, order)
    return grid


class ParallelDims:
    """The mesh of this job: degrees, this rank's coordinates, and one process group per axis.

    Built on `init_device_mesh` after `init_process_group`. Pass it explicitly; there is no global.
    """

    def __init__(
        self, pp: int, dp: int, tp: int, device_type: str = "cpu",
        rank_order: str = DEFAULT_RANK_ORDER,
    ) -> None:  # fmt: skip
        self.pp, self.dp, self.tp, self.rank_order = pp, dp, tp, rank_order
        self.world_size = pp * dp * tp
        self.rank = dist.get_rank()
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"pp*dp*tp = {pp}*{dp}*{tp} = {self.world_size} but the job has "
                f"{dist.get_world_size()} ranks"
            )
        grid = rank_grid(pp, dp, tp, rank_order)
        self.mesh = DeviceMesh(device_type, grid, mesh_dim_names=AXES)
        self.coords = coordinates_of(self.rank, pp, dp, tp, rank_order)
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
        return rank_of(
            Coordinates(c.pp + offset, c.dp, c.tp), self.pp, self.dp, self.tp, self.rank_order
        )
