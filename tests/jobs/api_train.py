"""A data-parallel job that uses ranktrace's API (three calls), for torchrun: each step is a
`ranktrace.step(tokens=...)` with two micro-batches and a `data` phase of its own.

    torchrun --nproc-per-node 2 api_train.py RUNS_DIR [--steps 8]
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

import ranktrace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs_dir")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    ranktrace.init(name="api", runs_dir=args.runs_dir)
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(dist.get_rank())
    for step in range(args.steps):
        with ranktrace.step(tokens=2 * 16):
            for _ in range(2):  # micro-batches: gradients accumulate
                with ranktrace.phase("data"):
                    batch = torch.randn(16, 32)
                loss = model(batch).square().mean()
                loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            optimizer.step()
            optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
