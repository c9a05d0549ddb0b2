"""docs/cli.md, generated from the parser itself, so the reference cannot drift from `--help`:

    python -m ranktrace.app.cli_reference > docs/cli.md

tests/test_docs_commands.py fails when the file differs from what this prints.
"""

from __future__ import annotations

import argparse
import os
import sys

from ranktrace.app.cli import build_parser

WIDTH = 100
HEADER = """# Command-line reference

Generated from `ranktrace <command> --help` by
`python -m ranktrace.app.cli_reference > docs/cli.md` (a test keeps it in sync).
`python -m ranktrace.trainer` (the per-rank entry point under torchrun) takes the options of
`ranktrace train`.
"""


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # the documented way to reach subparsers is this attribute
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render_reference() -> str:
    """The whole reference: the top-level help, then each command's."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)  # argparse wraps help text to the terminal's width
    try:
        parser = build_parser()
        parts = [HEADER, "## ranktrace\n", "```text\n" + parser.format_help() + "```\n"]
        for name, sub in _subcommands(parser).items():
            parts.append(f"## ranktrace {name}\n")
            parts.append("```text\n" + sub.format_help() + "```\n")
    finally:
        if previous is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(render_reference())
