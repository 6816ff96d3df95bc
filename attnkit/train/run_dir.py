"""The run directory a training run writes: refuse to mix runs, rewrite the metrics on resume.

A new run goes into an empty (or absent) ``--out``; a non-empty one is refused unless the user
asks to ``--overwrite`` it (which removes attnkit's own files there, nothing else) or to
``--resume`` it (offered only when it holds a checkpoint). A new run that fails before its first
checkpoint leaves nothing behind. Every file is written through :mod:`attnkit.io.files`, so a
symbolic link planted in the directory is replaced, never written through.
"""

from __future__ import annotations

import json
import os
import shutil

from .checkpoint import CHECKPOINT_NAME, CheckpointError, checkpoint_names, newest_checkpoint
from ..io.files import append_line, atomic_write_text, is_stale_temporary, remove_stale_temporaries

__all__ = ["check_new_run", "prepare_new_run", "discard_failed_start", "same_directory", "write_metrics",
           "append_metric", "write_results",
           "METRICS", "RESULTS", "LOSS_CURVE"]

METRICS, RESULTS, LOSS_CURVE, LATEST = "metrics.jsonl", "results.json", "loss.png", "latest"
_RUN_FILES = (METRICS, RESULTS, LOSS_CURVE, LATEST, "trace.json")


def _is_run_file(name: str) -> bool:
    return name in _RUN_FILES or bool(CHECKPOINT_NAME.match(name)) or (
        name.startswith("trace-rank") and name.endswith(".json"))


def _remove_run_files(out: str, present: list[str]) -> None:
    for name in present:
        path = os.path.join(out, name)
        if not _is_run_file(name):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def check_new_run(out: str, overwrite: bool) -> None:
    """Refuse, reading only, an ``out`` a new run cannot use: not a directory, or non-empty without
    ``overwrite``. Every rank of a multi-process run calls it before the process group starts, so all
    refuse alike. Temporary files of writers no longer running do not count (a new run removes them).

    The refusal offers ``--resume`` only when ``out`` holds a checkpoint to resume."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"out: {out!r} exists and is not a directory. Fix: pass a directory for --out.")
    if overwrite or not os.path.isdir(out):
        return
    present = sorted(name for name in os.listdir(out) if not is_stale_temporary(name))
    if not present:
        return
    shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
    try:
        resumable = newest_checkpoint(out) is not None
    except CheckpointError:
        resumable = False
    fix = (f"--resume {out} to continue that run, --overwrite to replace it, or another --out" if resumable
           else "it holds no checkpoint to resume: --overwrite to replace its files, or another --out")
    raise ValueError(f"out: {out!r} is not empty ({shown}). Fix: {fix}.")


def prepare_new_run(out: str, overwrite: bool) -> None:
    """Make ``out`` ready for a new run: create it, or refuse a non-empty one unless ``overwrite``
    (:func:`check_new_run`), removing attnkit's own files there when ``overwrite``."""
    check_new_run(out, overwrite)
    os.makedirs(out, exist_ok=True)
    remove_stale_temporaries(out)
    present = sorted(os.listdir(out))
    if present:
        _remove_run_files(out, present)


def discard_failed_start(out: str, created: bool) -> None:
    """Undo a new run that failed before its first checkpoint: remove ``out`` if the run created it,
    else the files the run wrote there (a failed start leaves nothing behind)."""
    try:
        if checkpoint_names(out):
            return
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            _remove_run_files(out, sorted(os.listdir(out)))
    except OSError:  # best effort: the original error is the one to report
        pass


def same_directory(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def write_metrics(out: str, history: list[dict]) -> None:
    """``metrics.jsonl`` holding exactly ``history`` (one JSON line a step), replaced atomically."""
    atomic_write_text(os.path.join(out, METRICS), "".join(json.dumps(r) + "\n" for r in history))


def append_metric(out: str, record: dict) -> None:
    append_line(os.path.join(out, METRICS), json.dumps(record))


def write_results(out: str, results: dict) -> str:
    path = os.path.join(out, RESULTS)
    atomic_write_text(path, json.dumps(results, indent=1) + "\n")
    return path
