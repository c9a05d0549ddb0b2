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
    from trainer.launch import launch  # imports torch's launcher only when a job really starts

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
