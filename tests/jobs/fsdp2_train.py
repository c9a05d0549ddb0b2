"""An FSDP2 training script written the way PyTorch's FSDP2 example writes one (`fully_shard`
on every block, then on the model), for torchrun, with no ranktrace in it.

    torchrun --nproc-per-node 4 fsdp2_train.py [--steps 12]

SLOW_RANK / SLOW_SECONDS (environment): that rank computes that much longer (CPU time spent in a
loop) in every forward.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def busy(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time: a rank that computes slowly (a throttled
    core). A sleep is not compute: on a crowded host a sleeping rank's core is taken, and its
    excess read as a wait for a core (a loop run's FSDP2 job: 'host, transient')."""
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        pass


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        if dist.get_rank() == int(os.environ.get("SLOW_RANK", "-1")):
            busy(float(os.environ.get("SLOW_SECONDS", "0")))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(dist.get_rank())
    for step in range(args.steps):
        inputs, targets = torch.randn(16, 128), torch.randn(16, 8)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
