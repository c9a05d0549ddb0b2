"""A training script that updates its weights by hand, without a torch optimizer (gradients
averaged with `all_reduce`, then `p -= lr * p.grad`), the way minimal examples and some
research code do, with no ranktrace in it: there is no optimizer step to see.

    torchrun --nproc-per-node 2 manual_update_train.py [--steps 12]
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        inputs = torch.randn(64, 32, generator=generator)
        targets = torch.randn(64, 4, generator=generator)
        model.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        with torch.no_grad():
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter -= 0.05 * parameter.grad / world
        if rank == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
