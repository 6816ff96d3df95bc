"""Bits of torch's API used without their import-time cost."""

from __future__ import annotations

import functools
import sys
import threading

import torch

__all__ = ["assume_constant_result", "progress_bar_class", "scope_reader"]


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` when attnkit is
    imported: that import costs about a second of every command's start, and on an install without
    NumPy it prints torch's "Failed to initialize NumPy" warning. The mark is the attribute the
    decorator itself sets; once ``torch._dynamo`` is loaded, the decorator is called as it is."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


def scope_reader(var):
    """A function returning ``var.get()`` (a ContextVar) that ``torch.compile`` calls once while
    tracing and takes as a constant (Dynamo cannot trace ``ContextVar.get``): a scope such as
    ``use_backend`` is read when a compiled function is traced, as any other Python setting is."""
    def read():
        return var.get()

    read.__name__ = read.__qualname__ = f"read_{var.name}"
    return assume_constant_result(read)


@functools.lru_cache(maxsize=1)
def progress_bar_class():
    """tqdm's bar class (``tqdm.auto``) guarded by a lock of this process only, or None without tqdm.

    tqdm guards its output with a lock shared across processes (a semaphore, inherited through
    ``fork``): a forked child killed while it prints leaves that lock held, and the parent's next
    line then waits forever. attnkit's bars and lines are printed by one process, so a thread lock
    is all they need; other tqdm bars keep tqdm's own."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None

    class ProcessLocalTqdm(tqdm):
        pass

    ProcessLocalTqdm.set_lock(threading.RLock())
    return ProcessLocalTqdm
