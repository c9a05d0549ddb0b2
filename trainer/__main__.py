"""`python -m ranktrace.trainer ...`: the per-rank entry point under torchrun (a process per rank).

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        -m ranktrace.trainer --tp 2 --pp 2 --dp 2 --model small --steps 100
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ranktrace.trainer.checkpoint import CheckpointError
from ranktrace.trainer.cli_args import add_train_arguments, config_from_args
from ranktrace.trainer.config import ConfigError
from ranktrace.trainer.resume import explicit_train_arguments, resume_config
from ranktrace.trainer.train import rank_main

REPORTER_GRACE_S = 10.0
"""How long a rank other than 0 waits before exiting on a bad configuration: every rank finds
the same error, rank 0 prints it, and torchrun stops the others when rank 0 exits. A rank that
exited at once could be first, and torchrun stopped rank 0 before it printed (CI, once)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ranktrace.trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    try:
        if args.resume:  # every rank reads the run before the rendezvous, so all agree
            explicit = explicit_train_arguments(sys.argv[1:] if argv is None else argv)
            cfg = resume_config(args.runs_dir, args.resume, explicit)
        else:
            cfg = config_from_args(args)
        cfg.validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, CheckpointError) as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"python -m ranktrace.trainer: error: {err}", file=sys.stderr, flush=True)
        else:  # torchrun stops every rank once one exits: leave rank 0 the time to say why
            time.sleep(REPORTER_GRACE_S)
        return 2
    rank_main(cfg.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
