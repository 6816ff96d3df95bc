"""Argument types shared by the commands: each refuses a bad value with one line that names the
flag's expectation and the value given (argparse prefixes the flag name)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

import torch

__all__ = ["bounded_int", "positive_int", "nonnegative_int", "int_list", "name_list", "device", "warn_if_approximate",
           "add_deprecated_alias"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """An int in ``[low, high]`` (``high=None``: no upper bound)."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"expected an integer {span}, got {text!r}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


positive_int = bounded_int(1)
nonnegative_int = bounded_int(0)


def int_list(low: int = 1, high: int | None = None) -> Callable[[str], list[int]]:
    """A comma-separated list of ints in ``[low, high]``, e.g. ``256,1024``."""
    one = bounded_int(low, high)

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
        try:
            return [one(x) for x in items]
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"{err}" + (f" (in {text!r})" if len(items) > 1 else "")) from None

    parse.__name__ = "list of int"
    return parse


def name_list(choices: Iterable[str] | None = None) -> Callable[[str], list[str]]:
    """A comma-separated list of names, each one of ``choices`` when given."""
    allowed = None if choices is None else sorted(choices)

    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in values if allowed is not None and x not in allowed]
        if bad or not values:
            expected = "a comma-separated list" + ("" if allowed is None else f" of {', '.join(allowed)}")
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return values

    parse.__name__ = "list"
    return parse


def warn_if_approximate(flag: str, name: str, what: str) -> None:
    """Warn on stderr when ``name`` is an approximate backend (a different function than softmax
    attention) used where the model's own, exact, results are expected; ``what`` says what changes."""
    import sys

    from ..registry import get_backend

    if name != "auto" and not get_backend(name).exact:
        print(f"warning: {flag} {name} is approximate attention (a different function), so {what} differ from "
              f"the model's own; pass an exact backend (auto, sdpa, tiled, naive, ...) for those.", file=sys.stderr)


def device(text: str) -> str:
    """A torch device this machine has: ``cpu``, ``cuda``, ``cuda:1``, ``mps``, ..."""
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu or cuda, got {text!r}") from None
    if dev.type == "cpu":
        return text
    module = getattr(torch, dev.type, None)
    if dev.type == "mps":
        ok, count = torch.backends.mps.is_available(), 1
    elif module is not None and hasattr(module, "is_available"):
        ok = module.is_available()
        count = module.device_count() if ok and hasattr(module, "device_count") else 0
    else:
        ok, count = False, 0
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {dev.type} is not available on this machine (torch {torch.__version__}); use --device cpu")
    if dev.index is not None and dev.index >= count:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} {dev.type} device(s) (0..{count - 1})")
    return text


def add_deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Accept flag ``old`` as a hidden alias of the flag ``new`` (already added, with its type): it
    stores into ``new``'s destination and says on stderr, once per use, to write ``new``."""
    import sys

    target = next(a for a in parser._actions if new in a.option_strings)

    class Alias(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"{parser.prog}: warning: {old} is deprecated; use {new}", file=sys.stderr)
            setattr(namespace, self.dest, values)

    parser.add_argument(old, dest=target.dest, type=target.type, default=argparse.SUPPRESS, action=Alias,
                        help=argparse.SUPPRESS)
