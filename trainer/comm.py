"""Every collective and point-to-point transfer of the trainer, each on an explicit mesh axis.

Nothing else in the trainer calls torch.distributed for data movement. Each call is timed with
a wall-clock pair (gloo calls block until done) and reported to the observers, which is where
telemetry hooks in. With no observer attached the cost is two `perf_counter_ns` calls.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
import torch.distributed as dist

from ranktrace.trainer.mesh import ParallelDims


class CommObserver(Protocol):
    """Receives one call per completed communication operation. Marks come from `Comm.mark`
    (monotonic ns by default; CUDA events when a GPU timer is installed); `peer` is the global
    rank on the other end of a point-to-point transfer, else -1."""

    def on_comm(
        self,
        op: str,
        axis: str,
        group_size: int,
        nbytes: int,
        dtype: torch.dtype,
        start_mark,
        end_mark,
        peer: int = -1,
    ) -> None: ...


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn once
# per rank); torch 2.11 and 2.12 have only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Comm:
    """Collectives over the axes of a `ParallelDims` mesh ('tp', 'pp', 'dp' or 'world')."""

    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims
        self.observers: list[CommObserver] = []
        self.mark = time.perf_counter_ns  # replaced by telemetry's timer (CUDA events on GPU)
        self.link_delay_s: dict[str, float] = {}  # injected slow links (trainer/faults.py)
        # What the collective-timeout watchdog (trainer/watchdog.py) reads from another thread:
        # the call in flight as (op, axis, peers, seq, monotonic start), and when the last ended.
        self.in_flight: tuple[str, str, tuple[int, ...], int, float] | None = None
        self.last_done = time.monotonic()
        self._calls: dict[tuple[str, tuple[int, ...]], int] = {}

    def _enter(self, op: str, axis: str, peers: tuple[int, ...] = ()):
        """Note the call about to block (numbered per axis, or per peers for transfers: every
        member numbers a collective alike); returns its start mark."""
        key = (axis, peers)
        seq = self._calls.get(key, 0)
        self._calls[key] = seq + 1
        self.in_flight = (op, axis, peers, seq, time.monotonic())
        return self.mark()

    def _slow_link(self, axis: str) -> None:
        """An injected bad link: the transfer starts on time and then takes longer, so every
        member of the group sees it as transfer time, not as waiting for this rank."""
        delay = self.link_delay_s.get(axis)
        if delay:
            time.sleep(delay)

    def _report(
        self, op: str, axis: str, nbytes: int, dtype: torch.dtype, start, peer: int = -1
    ) -> None:
        end = self.mark()
        self.in_flight, self.last_done = None, time.monotonic()
        for observer in self.observers:
            observer.on_comm(op, axis, self.dims.size(axis), nbytes, dtype, start, end, peer)

    def all_reduce(
        self, tensor: torch.Tensor, axis: str, op: dist.ReduceOp = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce `tensor` in place over `axis`; returns it. A no-op on an axis of size 1."""
        if self.dims.size(axis) == 1:
            return tensor
        start = self._enter("all_reduce", axis)
        if self.link_delay_s:
            self._slow_link(axis)
        dist.all_reduce(tensor, op=op, group=self.dims.group(axis))
        self._report("all_reduce", axis, _nbytes(tensor), tensor.dtype, start)
        return tensor

    def all_gather(self, tensor: torch.Tensor, axis: str, dim: int = 0) -> torch.Tensor:
        """Concatenate every member's `tensor` along `dim` (members in group-rank order)."""
        size = self.dims.size(axis)
        if size == 1:
            return tensor
        moved = tensor.movedim(dim, 0).contiguous()
        shape = (size * moved.shape[0], *moved.shape[1:])
        out = torch.empty(shape, dtype=moved.dtype, device=moved.device)
        self.all_gather_into(out, moved, axis)
        return out.movedim(0, dim)

    def all_gather_into(self, output: torch.Tensor, shard: torch.Tensor, axis: str) -> None:
        """Fill contiguous `output` (size × shard along dim 0) with every member's `shard`."""
        start = self._enter("all_gather", axis)
        if self.link_delay_s:
            self._slow_link(axis)
        _all_gather_single(output, shard, group=self.dims.group(axis))
        self._report("all_gather", axis, _nbytes(output), output.dtype, start)

    def reduce_scatter(self, tensor: torch.Tensor, axis: str, dim: int = 0) -> torch.Tensor:
        """Sum `tensor` over `axis` and return this member's 1/size slice along `dim`."""
        size = self.dims.size(axis)
        if size == 1:
            return tensor
        moved = tensor.movedim(dim, 0).contiguous()
        shape = (moved.shape[0] // size, *moved.shape[1:])
        out = torch.empty(shape, dtype=moved.dtype, device=moved.device)
        self.reduce_scatter_into(out, moved, axis)
        return out.movedim(0, dim)

    def reduce_scatter_into(self, output: torch.Tensor, tensor: torch.Tensor, axis: str) -> None:
        """Sum contiguous `tensor` over `axis`; this member's slice (dim 0) goes to `output`."""
        start = self._enter("reduce_scatter", axis)
        if self.link_delay_s:
            self._slow_link(axis)
        _reduce_scatter_single(output, tensor, group=self.dims.group(axis))
        self._report("reduce_scatter", axis, _nbytes(tensor), tensor.dtype, start)

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        axis: str = "pp",
    ) -> None:
        """Post every send and receive at once (global peer ranks) and wait for all of them.

        Posting both directions together is what keeps the 1F1B steady state free of deadlock: a
        stage sends its activation forward while it receives a gradient from the same neighbour.
        """
        if not sends and not recvs:
            return
        ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
        op = "send_recv" if sends and recvs else ("send" if sends else "recv")
        peers = tuple(sorted({peer for _, peer in sends} | {peer for _, peer in recvs}))
        start = self._enter(op, axis, peers)
        if self.link_delay_s:
            self._slow_link(axis)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        nbytes = sum(_nbytes(t) for t, _ in sends) + sum(_nbytes(t) for t, _ in recvs)
        dtype, peer = (sends or recvs)[0][0].dtype, (sends or recvs)[0][1]
        self._report(op, axis, nbytes, dtype, start, peer)

    def gather_objects(self, obj: object, axis: str) -> list[object] | None:
        """Collect one picklable object from each member onto group rank 0 (None elsewhere)."""
        group = self.dims.group(axis)
        size = self.dims.size(axis)
        if size == 1:
            return [obj]
        is_root = dist.get_group_rank(group, dist.get_rank()) == 0
        out: list[object] | None = [None] * size if is_root else None
        root = dist.get_global_rank(group, 0)
        dist.gather_object(obj, out, dst=root, group=group)
        return out

    def broadcast_object(self, obj: object, axis: str = "world") -> object:
        """Return group rank 0's `obj` on every member of `axis`."""
        if self.dims.size(axis) == 1:
            return obj
        group = self.dims.group(axis)
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    def barrier(self, axis: str = "world") -> None:
        if self.dims.size(axis) > 1:
            dist.barrier(group=self.dims.group(axis))
