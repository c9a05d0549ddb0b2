"""A pipeline-parallel training script written the way torch.distributed.pipelining's docs (and
torchtitan) write one: each rank builds its stage's part of the model, wraps it in a
`PipelineStage` and runs a schedule (`ScheduleGPipe` by default), with no ranktrace in it.

    torchrun --nproc-per-node 2 pipeline_train.py [--steps 12] [--split 2,2] [--schedule gpipe]

--split: layers per stage (2 stages: 2,2 is even, 3,1 puts three of the four blocks on stage 0).
SLOW_RANK / SLOW_SECONDS (environment): that rank sleeps that long in every micro-batch's forward.
The last stage prints every step's loss (mean over its micro-batches) with full precision.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

WIDTH = 256
MICRO_BATCHES = 4
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class StagePart(nn.Module):
    """One stage's blocks; the slow rank sleeps in each of its forwards."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x):
        if dist.get_rank() == int(os.environ.get("SLOW_RANK", "-1")):
            time.sleep(float(os.environ.get("SLOW_SECONDS", "0")))
        return self.blocks(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--split", default="2,2", help="blocks per stage, e.g. 3,1")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    split = [int(n) for n in args.split.split(",")]
    assert len(split) == stages, f"--split {args.split} needs {len(split)} ranks"
    torch.manual_seed(0)  # every rank builds the whole model alike, then keeps its part
    blocks = [Block(WIDTH) for _ in range(sum(split))]
    start = sum(split[:rank])
    part = StagePart(blocks[start : start + split[rank]])
    stage = PipelineStage(part, rank, stages, torch.device("cpu"))
    schedule = SCHEDULES[args.schedule](stage, n_microbatches=MICRO_BATCHES,
                                        loss_fn=nn.functional.mse_loss)  # fmt: skip
    optimizer = torch.optim.SGD(part.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        inputs = torch.randn(8 * MICRO_BATCHES, WIDTH, generator=data)
        targets = torch.randn(8 * MICRO_BATCHES, WIDTH, generator=data)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)
        elif rank < stages - 1:
            schedule.step()
        else:
            losses = []
            schedule.step(target=targets, losses=losses)
            print(f"step {step} loss {torch.stack(losses).mean().item()!r}", flush=True)
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
