"""``python -m attnkit <command>``: each command lives in its own module with ``add_parser``/``run``."""

from __future__ import annotations

import argparse
import importlib

# command name -> module under attnkit.cli (each defines add_arguments(parser) and run(args) -> int)
COMMANDS = {
    "info": "info",
    "demo": "demo",
    "embed": "embed",
    "train": "train",
    "generate": "generate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m attnkit", description="attnkit: attention, measured.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"attnkit.cli.{module_name}")
        cmd = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0], description=module.__doc__)
        module.add_arguments(cmd)
        cmd.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._module.run(args) or 0)
