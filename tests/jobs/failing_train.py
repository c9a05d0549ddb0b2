"""A single-process training script that stops with exit code 3 on purpose (as a job does when
its data turns out bad), with no ranktrace in it: `ranktrace run` must hand the job's own exit
code back, unchanged.

    python failing_train.py [--steps 6] [--fail-at 4]
"""

import argparse
import sys

import torch
import torch.nn as nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fail-at", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        if step == args.fail_at:
            print(f"step {step}: bad batch, stopping", file=sys.stderr, flush=True)
            sys.exit(3)
        inputs, targets = torch.randn(64, 32), torch.randn(64, 1)
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item()!r}", flush=True)


if __name__ == "__main__":
    main()
