"""File primitives for run and model directories that may hold someone else's files.

* Writes never follow a symbolic link already in the directory: every file is written under a
  temporary name and renamed over the target (``os.replace`` replaces a link, it does not write
  through it); appends open with ``O_NOFOLLOW``.
* Temporary names carry the writer's process id, so a later writer can remove the debris of a
  crashed one (:func:`remove_stale_temporaries`) without touching a save in progress.
* JSON is read with a size limit, and every failure is a ``ValueError`` naming the file and the fix.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable

__all__ = ["atomic_write", "atomic_write_text", "append_line", "is_stale_temporary", "read_json", "fsync_dir",
           "temp_prefix", "remove_stale_temporaries"]

# ".<name>.tmp-<pid>-<random>": the pid says whether the writer can still be running
_TEMP = re.compile(r"^\..*\.tmp-(\d+)-[^/]*$")


def temp_prefix(name: str) -> str:
    """The prefix of a temporary file or directory standing in for ``name`` while it is written."""
    return f".{name}.tmp-{os.getpid()}-"


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - not every platform opens directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` for a fresh temporary path beside ``path``, then rename it over ``path``.

    A crash leaves the old file (or none), never a partial one; a symlink at ``path`` is replaced."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(os.path.basename(path)), dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`)."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append ``line + "\\n"`` to ``path``, refusing to write through a symbolic link."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{os.fspath(path)}: is a symbolic link; refusing to write through it. "
                             f"Fix: remove the link, or use another --out directory.") from None
        raise
    with os.fdopen(fd, "a") as f:
        f.write(line + "\n")


def read_json(path: str | os.PathLike, *, limit_bytes: int, fix: str):
    """The JSON value in ``path`` (a regular file, not a link, at most ``limit_bytes``)."""
    path = os.fspath(path)
    if os.path.islink(path):
        raise ValueError(f"{path}: is a symbolic link; refusing to read through it. Fix: {fix}")
    try:
        size = os.path.getsize(path)
        if size > limit_bytes:
            raise ValueError(f"{path}: {size} bytes, more than the {limit_bytes} this file may have. Fix: {fix}")
        with open(path, "rb") as f:
            return json.loads(f.read(limit_bytes + 1))
    except FileNotFoundError:
        raise ValueError(f"{path}: not found. Fix: {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable or not valid JSON ({exc}). Fix: {fix}") from None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    except OSError:  # pragma: no cover - a pid the platform refuses
        return True
    return True


def is_stale_temporary(name: str) -> bool:
    """Whether ``name`` is the temporary file of a writer no longer running (:func:`remove_stale_temporaries`)."""
    match = _TEMP.match(name)
    return match is not None and not _alive(int(match.group(1)))


def remove_stale_temporaries(directory: str | os.PathLike) -> list[str]:
    """Remove temporary files and directories (``.<name>.tmp-<pid>-...``) of writers that are no
    longer running; a link is removed as a link, never followed. Returns the names removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if not is_stale_temporary(name):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                continue
        removed.append(name)
    return removed
