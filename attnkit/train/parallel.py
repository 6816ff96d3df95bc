"""How the one training loop spreads a global batch over processes: the parallelism strategies.

A strategy is a model wrapper plus a batch sharder; :func:`attnkit.train.train` picks one from the
config and runs the same loop with either:

* :class:`DataParallel` — one process, or DDP under ``torchrun``: each process takes its rows of
  the global batch and runs the whole sequence;
* :class:`ContextParallel` — ``--context-parallel N``: ``N`` consecutive processes share each
  sequence (zigzag slices, absolute positions), their self-attention layers call
  :func:`~attnkit.distributed.context_parallel_attention` (gated-delta layers
  :func:`~attnkit.distributed.context_parallel_gated_linear_attention`), and the ``world / N`` groups
  of them are data-parallel replicas over the rows.

Both hand every process a loss summed over its own tokens and divided by the answer tokens of the
*global* batch, and both sum gradients over every process (DDP's mean times the world), so any
strategy computes the gradient one process computes on the whole batch.
"""

from __future__ import annotations

import resource
import sys
import warnings

from torch import Tensor, nn

from ..distributed.layout import SequenceLayout
from ..distributed.training import ContextParallelGroups, ContextParallelModel
from .config import TrainConfig
from .distributed import DistContext, all_reduce_sum

__all__ = ["DataParallel", "ContextParallel", "choose_parallel"]


class DataParallel:
    """One process, or DDP over every process of ``ctx`` (the rows of a batch are split)."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.replicas, self.replica = ctx.world, ctx.rank  # data-parallel replicas, and ours

    def describe(self) -> str:
        return f"{self.ctx.world} process(es)"

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model the processes run (``model`` itself, its parameters shared)."""
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """The training module: DDP over every process when there are several."""
        if not self.ctx.enabled:
            return model
        device = self.ctx.device
        with warnings.catch_warnings():
            # torch deprecates broadcast_buffers for forward_sync_buffers, whose False still syncs the
            # buffers at init; its own message says to keep broadcast_buffers=False for rank-local
            # buffers (ContextParallel's) until init_sync_buffers exists: not the user's to act on.
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
            return nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None, **self._ddp_options)

    _ddp_options: dict = {}

    def rows(self, batch_size: int, micro: int, accum: int) -> slice:
        """This process's rows of micro-batch ``micro`` of ``accum`` in a global batch."""
        per_micro = batch_size // (self.replicas * accum)
        start = (self.replica * accum + micro) * per_micro
        return slice(start, start + per_micro)

    def shard(self, t: Tensor) -> Tensor:
        """This process's part of the sequence axis (dim 1) of rows ``(B, T)``: all of it."""
        return t

    def samples(self) -> bool:
        """Whether the main process may draw text samples from the model alone."""
        return True

    def results(self) -> dict:
        """Strategy-specific entries of ``results.json`` (collective)."""
        return {}


class ContextParallel(DataParallel):
    """``world = replicas x cp`` processes: ``cp`` consecutive ranks hold one zigzag slice each of
    the same rows and attend across their group; see :mod:`attnkit.distributed.training`."""

    # Buffers may be built from a rank's own positions: never overwrite them with rank 0's.
    _ddp_options = {"broadcast_buffers": False}

    def __init__(self, ctx: DistContext, cfg: TrainConfig):
        super().__init__(ctx)
        self.groups = ContextParallelGroups(cfg.context_parallel)
        self.replicas, self.replica = self.groups.dp, self.groups.dp_rank
        self.layout = SequenceLayout.zigzag(cfg.seq_len, self.groups.cp)
        self.positions = self.layout.positions(self.groups.cp_rank, ctx.device)

    def describe(self) -> str:
        g = self.groups
        return (f"{self.ctx.world} process(es): {g.dp} replica(s) x {g.cp} context-parallel ranks, "
                f"{self.layout.local_len(g.cp_rank)} of {self.layout.total_len} positions per rank (zigzag)")

    def prepare(self, model: nn.Module) -> nn.Module:
        return ContextParallelModel(model, self.groups.cp_group, self.layout, self.positions)

    def shard(self, t: Tensor) -> Tensor:
        return self.layout.shard(t, self.groups.cp_rank, dim=1)

    def samples(self) -> bool:
        return False  # a sample would need every rank of the group

    def results(self) -> dict:
        peak = [all_reduce_sum(_peak_rss_mb() if r == self.ctx.rank else 0.0, self.ctx) for r in range(self.ctx.world)]
        return {"context_parallel": self.groups.cp, "data_parallel": self.groups.dp, "peak_rss_mb_per_rank": peak}


def choose_parallel(cfg: TrainConfig, ctx: DistContext) -> DataParallel:
    """The strategy for ``cfg`` on ``ctx`` (``ValueError`` naming the flag when it cannot run)."""
    if cfg.context_parallel == 1:
        return DataParallel(ctx)
    unsupported = {"--distill-from": cfg.distill_from, "--quantize": cfg.quantize != "none"}
    flags = [flag for flag, used in unsupported.items() if used]
    if flags:
        raise ValueError(f"context_parallel: {', '.join(flags)} cannot be combined with --context-parallel "
                         f"{cfg.context_parallel} (they run a whole-sequence model on one process); run without them.")
    if cfg.model != "gpt":
        raise ValueError(f"context_parallel: splits a transformer's sequence; --model {cfg.model} has no attention.")
    if ctx.world < 2:
        raise ValueError(f"context_parallel={cfg.context_parallel}: launch with torchrun --nproc_per_node="
                         f"{cfg.context_parallel} (or a multiple of it for data parallelism as well).")
    if cfg.seq_len < 2 * cfg.context_parallel:
        raise ValueError(f"context_parallel: a sequence of {cfg.seq_len} positions cannot be split into the "
                         f"{2 * cfg.context_parallel} zigzag chunks of {cfg.context_parallel} ranks. Fix: a longer "
                         "--seq-len or fewer ranks per sequence.")
    return ContextParallel(ctx, cfg)


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024
