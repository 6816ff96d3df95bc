"""SIGINT (Ctrl-C) and SIGTERM (a cluster's preemption) stop a run *between* optimizer steps.

While :class:`StopSignals` is active, the first SIGINT or SIGTERM only records itself; the training
loop checks :attr:`StopSignals.signum` after each finished step, saves a complete checkpoint of that
step and raises :class:`TrainingInterrupted` (the command line exits with ``128 + signal``: 130 for
SIGINT, 143 for SIGTERM). A second signal while the first is being handled acts at once, as it would
without attnkit (a checkpoint save is atomic, so even then the run stays resumable). Handlers are
installed only in the main thread (Python delivers signals there alone) and restored on exit.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["StopSignals", "TrainingInterrupted", "STOP_SIGNALS"]

STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM between two optimizer steps (``step`` is the last finished
    one, saved when ``saved`` is a path). ``exit_code`` is the shell's ``128 + signal number``."""

    def __init__(self, signum: int, step: int, saved: str | None, message: str):
        super().__init__(message)
        self.signum, self.step, self.saved, self.message = signum, step, saved, message

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


class StopSignals:
    """Context manager: record the first SIGINT/SIGTERM in ``signum`` instead of acting on it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            return
        # a second signal: what the signal does without attnkit
        previous = self._previous.get(signum)
        self._restore()
        if callable(previous):
            previous(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            os.kill(os.getpid(), signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
