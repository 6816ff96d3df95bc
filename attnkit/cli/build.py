"""Build the native CPU kernel (attnkit/csrc) into the attnkit this command runs from.

Examples:
  python -m attnkit build          # compile with this machine's C++ compiler (a minute or two)
  python -m attnkit build -v       # show the compiler's commands

The kernel goes to attnkit/csrc/_build/ inside the installed package (`python -m attnkit info` names the
folder it looks in). Without a compiler the command says why and exits 1; every backend except `native`
runs without the kernel.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="print the compiler's commands")


def run(args: argparse.Namespace) -> int:
    from ..csrc import build

    return build.main(verbose=args.verbose)
