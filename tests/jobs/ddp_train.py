"""A DDP training script written the way PyTorch's DDP tutorial writes one, for torchrun, with
no ranktrace in it: tests run it unmodified under `ranktrace run`.

    torchrun --nproc-per-node 4 ddp_train.py [--steps 12]

SLOW_RANK / SLOW_SECONDS (environment): that rank sleeps that long in every forward (from its
SLOW_FROM-th forward on, 0 unless set), the straggler the tests expect ranktrace to name.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 8)
        )

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        slow_from = int(os.environ.get("SLOW_FROM", "0"))
        if dist.get_rank() == int(os.environ.get("SLOW_RANK", "-1")) and self.calls > slow_from:
            time.sleep(float(os.environ.get("SLOW_SECONDS", "0")))
        return self.body(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DDP(Net())
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        inputs, targets = torch.randn(128, 64), torch.randn(128, 8)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
    dist.barrier()  # every rank done before any tears gloo down
    # torch 2.13 with gloo: a DDP reducer still alive at interpreter exit aborted the process
    # ("terminate called without an active exception") in 2 of 15 bare runs here; freed before
    # the process group goes, 0 of 15
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
