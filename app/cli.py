"""The `ranktrace` command line."""

from __future__ import annotations

import argparse
import sys

from trainer.cli_args import add_train_arguments, config_from_args
from trainer.config import ConfigError


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage mistakes end in one line naming the problem and where to look, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cfg = config_from_args(args)
    try:
        cfg.validate()
    except ConfigError as err:
        parser.error(str(err))
    import torch  # imported only once a job is really going to start

    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.world_size:
        parser.error(
            f"--device cuda needs {cfg.world_size} GPUs on this machine but torch sees "
            f"{torch.cuda.device_count()}; use --device cpu (or auto), or fewer ranks"
        )
    from trainer.launch import launch

    return launch(cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="ranktrace",
        description="Profiling and straggler diagnosis for distributed training, "
        "with a reference 3D-parallel trainer.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    train = commands.add_parser(
        "train",
        help="train with tp x pp x dp local processes",
        description="Spawn tp*pp*dp local rank processes and train. Under torchrun, use "
        "`python -m trainer` with the same options.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_train_arguments(train)
    train.set_defaults(handler=_train, command_parser=train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.handler(args, args.command_parser)


if __name__ == "__main__":
    sys.exit(main())
