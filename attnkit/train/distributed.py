"""DDP plumbing for ``torchrun``: process group from the environment, rank-0-only side effects."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistContext", "setup_distributed", "all_reduce_sum"]


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def setup_distributed(device: str = "auto") -> DistContext:
    """Read ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (set by ``torchrun``) and join the process group:
    nccl when training on CUDA, gloo on CPU. Without them, a single-process context."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = pick_device(device)
    if world <= 1:
        return DistContext(device=dev)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return DistContext(rank=rank, world=world, local_rank=local_rank, device=dev)


def all_reduce_sum(value: float | torch.Tensor, ctx: DistContext) -> float:
    t = torch.as_tensor(value, dtype=torch.float64, device=ctx.device if ctx.device.type == "cuda" else "cpu")
    if ctx.enabled:
        dist.all_reduce(t)
    return float(t)


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def teardown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
