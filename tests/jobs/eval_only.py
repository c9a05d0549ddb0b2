"""An evaluation-only script, written the way an evaluation loop is usually written (a model
in eval mode, `torch.no_grad()`, the metric summed over the ranks with `all_reduce`), with no
ranktrace in it and no optimizer: nothing to call a training step.

    torchrun --nproc-per-node 2 eval_only.py [--batches 12]
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4)).eval()
    generator = torch.Generator().manual_seed(rank)
    total = torch.zeros(2)
    with torch.no_grad():
        for _ in range(args.batches):
            inputs = torch.randn(256, 32, generator=generator)
            targets = torch.randn(256, 4, generator=generator)
            batch = torch.tensor([nn.functional.mse_loss(model(inputs), targets).item(), 1.0])
            dist.all_reduce(batch)
            total += batch
    if rank == 0:
        print(f"eval loss {(total[0] / total[1]).item()!r}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
