"""Data parallelism: contiguous parameter and gradient buffers cut into buckets, the bucketed
gradient all-reduce (ZeRO 0/1) or reduce-scatter (ZeRO 2), and the all-gather of updated
parameters (ZeRO 1/2).

Every parameter's `.data` and `.grad` are views into two flat buffers, so autograd accumulates
micro-batch gradients straight into the bucket that is then communicated, with no copies. Each
bucket is padded to a multiple of dp; dp rank r owns the r-th 1/dp slice of every bucket. Under
ZeRO 1/2 the optimizer keeps fp32 master weights and Adam moments for that slice only (ZeRO paper,
Rajbhandari et al. 2020); under ZeRO 0 it owns everything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ranktrace.trainer.comm import Comm


@dataclass(frozen=True)
class Bucket:
    """Elements [start, end) of the flat buffers; (end - start) is a multiple of dp."""

    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat buffers."""

    name: str
    param: nn.Parameter
    offset: int


def _plan_buckets(params: list[tuple[str, nn.Parameter]], bucket_numel: int, dp: int):
    """Lay parameters out back to front (gradients of late layers are ready first) in buckets."""
    slots, buckets = [], []
    offset = start = 0
    for name, param in reversed(params):
        slots.append(ParamSlot(name, param, offset))
        offset += param.numel()
        if offset - start >= bucket_numel:
            offset += -(offset - start) % dp
            buckets.append(Bucket(start, offset))
            start = offset
    if offset > start or not buckets:
        offset += -(offset - start) % dp
        buckets.append(Bucket(start, max(offset, start + dp)))
    return slots, buckets


class DataParallelBuffers:
    """Flat parameter/gradient buffers of one rank's model shard and their dp communication."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        comm: Comm,
        zero: int,
        bucket_bytes: int,
        dtype: torch.dtype,
    ) -> None:
        """Move fp32-initialised `named_params` into flat buffers of the compute `dtype`."""
        self.comm, self.zero = comm, zero
        self.dp, self.dp_rank = comm.dims.dp, comm.dims.coords.dp
        device = named_params[0][1].device
        element_size = torch.empty((), dtype=dtype).element_size()
        bucket_numel = max(1, bucket_bytes // element_size)
        self.slots, self.buckets = _plan_buckets(named_params, bucket_numel, self.dp)
        # This rank's slice of each bucket, concatenated: the elements its optimizer owns.
        self.owned_ranges = [self._owned_range(b) for b in self.buckets]
        self.owned_numel = sum(end - start for start, end in self.owned_ranges)
        total = self.buckets[-1].end
        initial = torch.zeros(total, dtype=torch.float32, device=device)  # padding stays zero
        for slot in self.slots:
            n = slot.param.numel()
            initial[slot.offset : slot.offset + n].copy_(slot.param.data.flatten())
        self.initial_master = self.owned(initial)  # fp32, before rounding to `dtype`
        self.params = initial.to(dtype)  # [total]
        self.grads = torch.zeros(total, dtype=dtype, device=device)  # [total]
        for slot in self.slots:
            n, shape = slot.param.numel(), slot.param.shape
            slot.param.data = self.params[slot.offset : slot.offset + n].view(shape)
            slot.param.grad = self.grads[slot.offset : slot.offset + n].view(shape)
        self.reduced_grads: torch.Tensor | None = None  # owned gradient after `sync_grads`

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        if self.zero == 0:
            return bucket.start, bucket.end
        per_rank = bucket.numel // self.dp
        start = bucket.start + self.dp_rank * per_rank
        return start, start + per_rank

    def owned(self, flat: torch.Tensor) -> torch.Tensor:
        """The owned elements of a full-size flat tensor, concatenated [owned_numel]."""
        return torch.cat([flat[start:end] for start, end in self.owned_ranges])

    def zero_grad(self) -> None:
        self.grads.zero_()

    def sync_grads(self) -> torch.Tensor:
        """Sum gradients over dp, bucket by bucket; returns the owned part as fp32, divided by dp
        (the mean over dp of per-rank mean losses is the global mean loss)."""
        parts = []
        for bucket, (start, end) in zip(self.buckets, self.owned_ranges, strict=True):
            grads = self.grads[bucket.start : bucket.end]
            if self.zero == 2:
                shard = torch.empty(end - start, dtype=grads.dtype, device=grads.device)
                if self.dp > 1:
                    self.comm.reduce_scatter_into(shard, grads, "dp")
                else:
                    shard.copy_(grads)
                parts.append(shard)
            else:
                self.comm.all_reduce(grads, "dp")
                parts.append(self.grads[start:end])
        self.reduced_grads = torch.cat(parts).float().div_(self.dp)
        return self.reduced_grads

    @torch.no_grad()
    def write_params(self, owned_values: torch.Tensor) -> None:
        """Store updated owned values (fp32 [owned_numel]) into the model and, under ZeRO 1/2,
        all-gather every rank's slice so that each dp rank again holds the full parameters."""
        cursor = 0
        for bucket, (start, end) in zip(self.buckets, self.owned_ranges, strict=True):
            n = end - start
            values = owned_values[cursor : cursor + n].to(self.params.dtype)
            cursor += n
            if self.zero == 0 or self.dp == 1:
                self.params[start:end].copy_(values)
            else:
                self.comm.all_gather_into(self.params[bucket.start : bucket.end], values, "dp")

    def element_mask(self, include) -> torch.Tensor:
        """fp32 [owned_numel] mask: 1 where `include(slot)` holds for the owning parameter."""
        mask = torch.zeros(self.params.numel(), dtype=torch.float32, device=self.params.device)
        for slot in self.slots:
            if include(slot):
                mask[slot.offset : slot.offset + slot.param.numel()] = 1.0
        return self.owned(mask)

    def full_grads(self) -> torch.Tensor:
        """All dp-reduced gradients of this model shard as fp32 [total] (gathers under ZeRO 1/2).
        For export and tests, not the training step."""
        if self.zero == 0 or self.dp == 1:
            return self.reduced_grads.clone()  # owned ranges cover every bucket, in order
        out = torch.empty(self.grads.numel(), dtype=torch.float32, device=self.grads.device)
        cursor = 0
        for bucket, (start, end) in zip(self.buckets, self.owned_ranges, strict=True):
            piece = self.reduced_grads[cursor : cursor + end - start].contiguous()
            self.comm.all_gather_into(out[bucket.start : bucket.end], piece, "dp")
            cursor += end - start
        return out
