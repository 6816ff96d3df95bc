"""``attnkit <command>`` (or ``python -m attnkit <command>``): each command lives in its own module
with ``add_arguments(parser)`` and ``run(args) -> int``.

A mistake in the input (a bad flag value, an unknown backend, a missing file, a device this machine
does not have, a missing optional extra) ends with one line on stderr,
``attnkit <command>: error: <what was wrong and the fix>``, and exit status 2, the status argparse
uses for usage errors. ``ATTNKIT_TRACEBACK=1`` shows the full traceback instead. ``train`` stopped
by SIGINT or SIGTERM saves its last finished step, prints one line and exits with 130 or 143.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import sys
from typing import NoReturn

from .. import __version__
from ..dispatch import NoBackendError
from . import options

# command name -> module under attnkit.cli (each defines add_arguments(parser) and run(args) -> int)
COMMANDS = {
    "info": "info",
    "demo": "demo",
    "embed": "embed",
    "bench": "bench",
    "train": "train",
    "generate": "generate",
    "build": "build",
}

# command -> (extra, modules it cannot work without): checked before any work starts.
REQUIRED_EXTRAS = {
    "train": ("train", ("safetensors",)),
    "generate": ("train", ("safetensors",)),
    "embed": ("hf", ("transformers", "safetensors", "tokenizers")),
}

# What a user's mistake raises inside a command. A programming error raises something else and keeps
# its traceback.
USER_ERRORS = (NoBackendError, ValueError, TypeError, FileNotFoundError, FileExistsError, NotADirectoryError,
               IsADirectoryError, PermissionError)


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line, ``<prog>: error: <message> (<prog> --help ...)``,
    exit status 2 (argparse's own): the usage is not printed before it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {tidy_usage_error(message)} ({self.prog} --help shows the usage)\n")


def tidy_usage_error(message: str) -> str:
    """argparse's ``argument --steps: invalid int value: 'abc'`` as ``--steps: expected an int, got 'abc'``."""
    message = re.sub(r"^argument ([^:/]+)(?:/[^:]+)?: ", r"\1: ", message)
    return re.sub(r"invalid (.+?) value: ('.*')$", lambda m: f"expected {_article(m[1])} {m[1]}, got {m[2]}", message)


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def build_parser(prog: str = "attnkit") -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog, description="attnkit: attention, measured.",
        epilog="A mistake in the input prints one error line and exits with status 2; "
               "set ATTNKIT_TRACEBACK=1 for the full traceback.")
    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"attnkit.cli.{module_name}")
        doc = module.__doc__.replace("python -m attnkit", prog)
        cmd = sub.add_parser(name, help=doc.strip().splitlines()[0], description=doc,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(_module=module, _parser=cmd)
    return parser


def command_name() -> str:
    """How a user runs this attnkit again, for ``python -m attnkit``'s hints: ``attnkit`` when that name on
    PATH is the console script of this very interpreter, else ``<this interpreter> -m attnkit`` (a bare
    ``python`` may be another environment's)."""
    script = shutil.which("attnkit")
    here = os.path.join(os.path.dirname(sys.executable), "attnkit")
    if script is not None and os.path.realpath(os.path.dirname(script)) == os.path.realpath(os.path.dirname(here)):
        return "attnkit"
    return f"{shlex.quote(sys.executable)} -m attnkit"


def missing_extra(command: str) -> str | None:
    """None if ``command`` has what it needs installed, else the message naming the extra."""
    if command not in REQUIRED_EXTRAS:
        return None
    extra, modules = REQUIRED_EXTRAS[command]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    verb = "is" if len(missing) == 1 else "are"
    return f"needs {', '.join(missing)}, which {verb} not installed: pip install 'attnkit[{extra}]'"


def _missing_device(args: argparse.Namespace) -> str | None:
    """Every command's ``--device`` names a device this machine has (checked before any work)."""
    value = getattr(args, "device", None)
    if not isinstance(value, str) or value == "auto":  # train's "auto": the best device there is
        return None
    try:
        options.device(value)
    except argparse.ArgumentTypeError as err:
        return f"--device {err}"
    return None


def one_line(text: str) -> str:
    """A multi-line message (e.g. ``NoBackendError``'s per-backend reasons) as one line."""
    parts = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(p if p.endswith((":", ".", ";")) or i == len(parts) - 1 else p + ";" for i, p in enumerate(parts))


def _is_user_error(exc: BaseException) -> bool:
    if isinstance(exc, USER_ERRORS):
        return True
    # the project's own "install the extra" messages (attnkit.interop, checkpoints, plots)
    return isinstance(exc, ImportError) and "attnkit[" in str(exc)


def main(argv: list[str] | None = None, prog: str = "attnkit") -> int:
    """Run one command; returns its exit status (0 ok, 2 a usage or input error)."""
    parser = build_parser(prog)
    args, unknown = parser.parse_known_args(argv)  # usage errors: one line, exit status 2 (OneLineParser)
    if unknown:  # named by the command's own parser, whose --help lists its flags
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args._argv = list(sys.argv[1:] if argv is None else argv)[1:]  # the command's own flags (bench records them)
    args._prog = prog
    where = f"{prog} {args.command}"
    why = missing_extra(args.command) or _missing_device(args)
    if why:
        print(f"{where}: error: {why}", file=sys.stderr)
        return 2
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt as exc:  # train's SIGINT/SIGTERM stop: it printed its one line and saved
        code = getattr(exc, "exit_code", None)
        if code is None:
            raise
        return code
    except Exception as exc:
        if not _is_user_error(exc) or os.environ.get("ATTNKIT_TRACEBACK"):
            raise
        message = one_line(str(exc))
        if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:  # not "[Errno 2] ..."
            message = f"{exc.strerror}: {exc.filename}"
        print(f"{where}: error: {message or type(exc).__name__}", file=sys.stderr)
        return 2
