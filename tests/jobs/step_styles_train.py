"""One process, three ways of writing a training step that users write, with no ranktrace in it:

- `accumulate`: gradient accumulation, `--micro-batches` forwards and backwards per
  `optimizer.step()`;
- `two-optimizers`: two optimizers (one per part of the model), stepped one after the other;
- `lbfgs`: `torch.optim.LBFGS`, whose `step(closure)` runs the forward and backward inside the
  optimizer step (several times).

    python step_styles_train.py --style accumulate [--steps 10] [--micro-batches 3]

Each step prints `step N loss X` (X with every digit).
"""

import argparse

import torch
import torch.nn as nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--style", choices=("accumulate", "two-optimizers", "lbfgs"),
                        required=True)  # fmt: skip
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batches", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    body, head = nn.Sequential(nn.Linear(16, 64), nn.Tanh()), nn.Linear(64, 2)
    model = nn.Sequential(body, head)
    loss_fn = nn.MSELoss()
    data = torch.Generator().manual_seed(1)

    def batch():
        return torch.randn(32, 16, generator=data), torch.randn(32, 2, generator=data)

    if args.style == "two-optimizers":
        optimizers = [torch.optim.SGD(body.parameters(), lr=0.05),
                      torch.optim.Adam(head.parameters(), lr=0.01)]  # fmt: skip
    elif args.style == "lbfgs":
        optimizers = [torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)]
    else:
        optimizers = [torch.optim.SGD(model.parameters(), lr=0.05)]
    for step in range(args.steps):
        for optimizer in optimizers:
            optimizer.zero_grad()
        if args.style == "lbfgs":
            inputs, targets = batch()

            def closure(inputs=inputs, targets=targets):
                optimizers[0].zero_grad()
                loss = loss_fn(model(inputs), targets)
                loss.backward()
                return loss

            loss = optimizers[0].step(closure)
        else:
            parts = args.micro_batches if args.style == "accumulate" else 1
            total = 0.0
            for _ in range(parts):
                inputs, targets = batch()
                loss = loss_fn(model(inputs), targets) / parts
                loss.backward()
                total += loss.item()
            for optimizer in optimizers:
                optimizer.step()
            loss = torch.tensor(total)
        print(f"step {step} loss {loss.item()!r}", flush=True)


if __name__ == "__main__":
    main()
