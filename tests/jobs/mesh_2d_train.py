"""A 2-D DeviceMesh job (data parallel × tensor parallel, DTensor), written the way PyTorch's
tensor-parallel tutorial writes one, for torchrun with 4 ranks, with no ranktrace in it.

    torchrun --nproc-per-node 4 mesh_2d_train.py [--steps 8]
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)


class FeedForward(nn.Module):
    def __init__(self, width: int = 64, classes: int = 8) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.w2(torch.relu(self.w1(x))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = FeedForward()
    plan = {
        "w1": ColwiseParallel(),
        "w2": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(mesh["dp"].get_local_rank())
    for step in range(args.steps):
        inputs = torch.randn(8, 64)
        loss = model(inputs).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
