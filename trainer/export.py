"""Consolidate a sharded model into full, layout-independent tensors on rank 0.

Used to save the final weights (and the last step's dp-reduced gradients) of a run, which is how
tests compare any (tp, pp, dp, zero) layout against the single-process run parameter by parameter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ranktrace.trainer.comm import Comm
from ranktrace.trainer.parallel.data import DataParallelBuffers
from ranktrace.trainer.parallel.tensor import unshard_tensors

WEIGHTS_FILE = "weights.pt"


def _unshard_over_tp(tensor: torch.Tensor, param, comm: Comm) -> torch.Tensor:
    if param.tp_dim is None or comm.dims.tp == 1:
        return tensor
    stacked = comm.all_gather(tensor.unsqueeze(0).contiguous(), "tp", dim=0)  # [tp, *shard]
    return unshard_tensors(list(stacked.unbind(0)), param.tp_dim, param.tp_fused)


def consolidate(buffers: DataParallelBuffers, comm: Comm) -> dict | None:
    """{"params": {name: fp32}, "grads": {name: fp32}} of the whole model on global rank 0.

    Every rank must call it (it runs collectives over dp, tp and pp); other ranks get None.
    """
    full_grads = buffers.full_grads()  # fp32 [total], dp-reduced
    params, grads = {}, {}
    for slot in buffers.slots:
        n, shape = slot.param.numel(), slot.param.shape
        value = buffers.params[slot.offset : slot.offset + n].view(shape).float()
        grad = full_grads[slot.offset : slot.offset + n].view(shape)
        params[slot.name] = _unshard_over_tp(value, slot.param, comm).cpu()
        grads[slot.name] = _unshard_over_tp(grad, slot.param, comm).cpu()
    stages = comm.gather_objects((params, grads), "pp")
    if comm.dims.rank != 0:
        return None
    merged: dict = {"params": {}, "grads": {}}
    for stage_params, stage_grads in stages:
        merged["params"].update(stage_params)
        merged["grads"].update(stage_grads)
    return merged


def save_consolidated(buffers: DataParallelBuffers, comm: Comm, directory: Path) -> None:
    """Write `directory/weights.pt` from rank 0 (all ranks must call)."""
    merged = consolidate(buffers, comm)
    if merged is not None:
        torch.save(merged, directory / WEIGHTS_FILE)
