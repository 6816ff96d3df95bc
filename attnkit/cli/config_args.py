"""Command-line flags generated from config dataclasses: one source of truth, help from field metadata."""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing

__all__ = ["add_dataclass_arguments", "dataclass_from_args", "name_the_flag"]


def _scalar_type(hint):
    """``int``, ``float``, ``str`` or ``bool`` behind ``X`` or ``X | None``; None for anything else."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 and args[0] in (int, float, str, bool) else None
    return hint if hint in (int, float, str, bool) else None


def _optional(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def add_dataclass_arguments(parser, cls, *, group_title: str | None = None, prefix: str = "",
                            defaults: dict | None = None, skip: tuple[str, ...] = (),
                            force_prefix: bool = False) -> list[tuple[str, str]]:
    """Add ``--field-name`` flags for the scalar fields of dataclass ``cls``; return ``(field, dest)`` pairs.

    Fields already present in ``parser`` (a name clash), or all with ``force_prefix``, get ``prefix``
    in front. ``defaults``
    overrides the dataclass defaults shown and used."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(group_title or cls.__name__) if group_title is not False else parser
    taken = {a.dest for a in parser._actions}
    pairs = []
    for f in dataclasses.fields(cls):
        kind = _scalar_type(hints[f.name])
        if kind is None or f.name in skip:
            continue
        dest = prefix + f.name if force_prefix or f.name in taken else f.name
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        if defaults and f.name in defaults:
            default = defaults[f.name]
        flag = "--" + dest.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if kind is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            convert = kind
            if _optional(hints[f.name]):
                def convert(text, _kind=kind):
                    return None if text.lower() == "none" else _kind(text)
            group.add_argument(flag, dest=dest, type=convert, default=default, metavar=kind.__name__.upper(),
                               help=f"{help_text} (default: {default})".strip())
        pairs.append((f.name, dest))
    return pairs


def dataclass_from_args(cls, args: argparse.Namespace, pairs: list[tuple[str, str]], **extra):
    return cls(**{name: getattr(args, dest) for name, dest in pairs}, **extra)


def name_the_flag(exc: Exception, pairs: list[tuple[str, str]]) -> Exception:
    """``exc`` (a config's ``ValueError``/``TypeError``) with the command-line flag of the field it
    is about in front, e.g. ``--dropout: TransformerConfig.dropout: expected ...``.

    The field is the subject the message starts with (``name:``, ``Class.name:`` or
    ``Class(name=...)``); a message that already names its flag, or none of ``pairs``, is returned as is."""
    message = str(exc)
    match = re.match(r"^(?:\w+[.(])?(\w+)(?:=[^)]*\))?[:\s(]", message)
    dests = dict(pairs)
    if match is None or match.group(1) not in dests:
        return exc
    flag = "--" + dests[match.group(1)].replace("_", "-")
    if flag in message:
        return exc
    try:
        return type(exc)(f"{flag}: {message}")
    except Exception:  # an exception type with its own constructor: keep it
        return exc
