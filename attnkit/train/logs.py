"""What a run prints and draws: a progress bar on a terminal only, plain lines in a log file, a loss curve.

Every ``log_every`` steps one line ``step 120/300 | loss 2.1034 | lr 1.84e-03 | 41.2k tok/s`` is
printed (through the bar when one is shown, so lines and bar do not mix); evaluations, samples and
saves print their own lines. The bar uses tqdm's ``disable=None``: shown on a TTY, absent when
output goes to a file.
"""

from __future__ import annotations

import os

from .distributed import DistContext
from .._compat import progress_bar_class
from ..io.files import atomic_write

__all__ = ["RunLog", "plot_loss_curve"]


class RunLog:
    """``log(text)`` on the main process, plus the optional progress bar (``log.bar``)."""

    def __init__(self, ctx: DistContext, total: int, initial: int, progress: bool):
        self.ctx = ctx
        self.bar = None
        self._write = print
        if not ctx.is_main:
            return
        tqdm = progress_bar_class()
        if tqdm is None:
            return
        self._write = tqdm.write
        if progress:
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, disable=None)

    def __call__(self, *msg) -> None:
        if self.ctx.is_main:
            self._write(" ".join(str(m) for m in msg))

    def step(self, record: dict, total: int, every: int) -> None:
        """Advance the bar; every ``every`` steps (and at the last) print the step's line."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            self.bar.update(1)
        if every and (record["step"] % every == 0 or record["step"] == total):
            self(f"step {record['step']}/{total} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                 f"{record['tokens_per_s'] / 1e3:.1f}k tok/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def plot_loss_curve(history: list[dict], evals: list[dict], path: str, title: str = "") -> str | None:
    """Train loss per step (raw and smoothed) and eval loss as points, to a PNG at ``path``.

    Returns the path, or None when matplotlib (the ``plot`` extra) is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r["step"] for r in history]
    losses = [r["loss"] for r in history]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, losses, color="#9ecae1", linewidth=0.8, label="train loss (per step)")
    width = max(len(losses) // 30, 1)
    if width > 1:
        smooth = [sum(losses[max(i - width + 1, 0):i + 1]) / len(losses[max(i - width + 1, 0):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, color="#08519c", linewidth=1.6, label=f"train loss ({width}-step mean)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", color="#d94801", markersize=5,
                label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    return path
