"""A PyTorch Lightning training script written the way Lightning's docs write one (a
LightningModule, a DataLoader, `Trainer(strategy="ddp")`), with no ranktrace in it: tests run it
unmodified under `ranktrace run`. Lightning's automatic optimization calls
`optimizer.step(closure)`: forward and backward run inside the optimizer step.

    torchrun --nproc-per-node 2 lightning_train.py [--steps 24] [--manual]

`--manual`: manual optimization (`automatic_optimization = False`, the step's forward, backward
and `opt.step()` written in `training_step`). SLOW_RANK / SLOW_SECONDS (environment): that rank
computes that much longer (CPU time spent in a loop) in every forward, the straggler the tests
expect ranktrace to name.
"""

import argparse
import os
import time

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def busy(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time: a rank that computes slowly (a throttled
    core). A sleep is not compute: on a crowded host a sleeping rank's core is taken, and its
    excess read as a wait for a core (a loop run's FSDP2 job: 'host, transient')."""
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        pass


class Regression(pl.LightningModule):
    def __init__(self, manual: bool = False, width: int = 256) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.body = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 4))

    def forward(self, x):
        if self.global_rank == int(os.environ.get("SLOW_RANK", "-1")):
            busy(float(os.environ.get("SLOW_SECONDS", "0")))
        return self.body(x)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = nn.functional.mse_loss(self(inputs), targets)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        if self.global_rank == 0:
            print(f"step {self.global_step} loss {loss.item()!r}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--manual", action="store_true")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 4))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(args.manual), DataLoader(data, batch_size=64, shuffle=False))
    # torch 2.13 with gloo: a DDP reducer still alive at interpreter exit aborted the process
    # ("terminate called without an active exception") in about 1 bare run in 8 here; freed
    # before the process group goes, never (tests/jobs/ddp_train.py does the same)
    trainer.strategy.barrier()
    del trainer
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
