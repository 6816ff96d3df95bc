"""Point-to-point and all-to-all communication for context parallelism (gloo and NCCL).

Everything here speaks group ranks; ``torch.distributed`` wants global ranks for peers, so
:class:`Ring` translates once. Sends and receives are asynchronous (``isend``/``irecv``): the
caller starts the transfer of the next block, computes on the current one, then waits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Ring", "WAIT_LABEL", "wait_all", "all_to_all_heads_to_seq", "all_to_all_seq_to_heads", "gather_descriptors"]


class Ring:
    """A context-parallel group seen as a ring: ``next`` receives from us, ``prev`` sends to us.

    ``group=None`` with no initialized process group is the one-rank ring (no communication)."""

    def __init__(self, group):
        self.group = group
        if group is None and not dist.is_initialized():
            self.rank, self.world = 0, 1
        else:
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    @classmethod
    def local(cls) -> Ring:
        """The one-rank ring, whatever process groups exist."""
        ring = cls.__new__(cls)
        ring.group, ring.rank, ring.world = None, 0, 1
        return ring

    def peer(self, offset: int) -> int:
        """Global rank of the ring member ``offset`` places after us."""
        r = (self.rank + offset) % self.world
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def send(self, t: Tensor, offset: int, tag: int):
        return dist.isend(t.contiguous(), self.peer(offset), group=self.group, tag=tag)

    def recv(self, buf: Tensor, offset: int, tag: int):
        return dist.irecv(buf, self.peer(offset), group=self.group, tag=tag)

    def shift(self, t: Tensor, buf: Tensor, tag: int) -> tuple[Tensor, list]:
        """Start sending ``t`` to ``next`` and receiving into ``buf`` from ``prev``; returns
        ``buf`` and the requests to wait on. The pair is one batched operation, which NCCL needs
        so that a ring of blocking sends cannot deadlock."""
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.peer(1), self.group, tag),
               dist.P2POp(dist.irecv, buf, self.peer(-1), self.group, tag)]
        return buf, dist.batch_isend_irecv(ops)


#: Profiler label of the time spent blocked on transfers (benchmarks/bench_context_parallel.py sums it).
WAIT_LABEL = "context_parallel.wait"


def wait_all(requests) -> None:
    """Block until every request completes (labelled for the profiler)."""
    with torch.profiler.record_function(WAIT_LABEL):
        for r in requests:
            r.wait()


def gather_descriptors(ring: Ring, values: list[int]) -> list[list[int]]:
    """Every rank's list of ints (same length on all ranks), in group-rank order."""
    mine = torch.tensor(values, dtype=torch.long)
    if ring.world == 1:
        return [values]
    backend = dist.get_backend(ring.group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = mine.to(device)
    out = [torch.empty_like(mine) for _ in range(ring.world)]
    with torch.profiler.record_function(WAIT_LABEL):
        dist.all_gather(out, mine, group=ring.group)
    return [t.tolist() for t in out]


def _heads_to_seq(ring: Ring, x: Tensor, lengths: list[int]) -> Tensor:
    """``(B, H, T_local, E)`` sequence slices → ``(B, H / P, sum(lengths), E)`` full sequence (in
    rank order) for this rank's heads."""
    P = ring.world
    B, H, T, E = x.shape
    h = H // P
    send = x.reshape(B, P, h, T, E).transpose(0, 1).contiguous()  # (P, B, h, T, E): chunk j goes to rank j
    recv = x.new_empty(sum(B * h * n * E for n in lengths))
    # all_to_all_single(output, input, output_split_sizes, input_split_sizes)
    with torch.profiler.record_function(WAIT_LABEL):
        dist.all_to_all_single(recv, send.reshape(-1), [B * h * n * E for n in lengths], [B * h * T * E] * P,
                               group=ring.group)
    chunks = recv.split([B * h * n * E for n in lengths])
    return torch.cat([c.view(B, h, n, E) for c, n in zip(chunks, lengths)], dim=2)


def _seq_to_heads(ring: Ring, x: Tensor, lengths: list[int]) -> Tensor:
    """The inverse of :func:`_heads_to_seq`: ``(B, H / P, sum(lengths), E)`` → ``(B, H, T_local, E)``."""
    P = ring.world
    B, h, _, E = x.shape
    T = lengths[ring.rank]
    send = torch.cat([c.reshape(-1) for c in x.split(lengths, dim=2)])
    recv = x.new_empty(P * B * h * T * E)
    with torch.profiler.record_function(WAIT_LABEL):
        dist.all_to_all_single(recv, send, [B * h * T * E] * P, [B * h * n * E for n in lengths], group=ring.group)
    return recv.view(P, B, h, T, E).transpose(0, 1).reshape(B, P * h, T, E)  # (B, H, T, E)


class _AllToAll(torch.autograd.Function):
    """Differentiable head↔sequence all-to-all; the backward is the opposite exchange."""

    @staticmethod
    def forward(ctx, x, ring, lengths, to_seq):
        ctx.ring, ctx.lengths, ctx.to_seq = ring, lengths, to_seq
        return (_heads_to_seq if to_seq else _seq_to_heads)(ring, x.contiguous(), lengths)

    @staticmethod
    def backward(ctx, grad):
        back = _seq_to_heads if ctx.to_seq else _heads_to_seq
        return back(ctx.ring, grad.contiguous(), ctx.lengths), None, None, None


def all_to_all_heads_to_seq(ring: Ring, x: Tensor, lengths: list[int]) -> Tensor:
    """Differentiable ``(B, H, T_local, E) → (B, H / P, T, E)`` (Ulysses' first exchange)."""
    return _AllToAll.apply(x, ring, lengths, True)


def all_to_all_seq_to_heads(ring: Ring, x: Tensor, lengths: list[int]) -> Tensor:
    """Differentiable ``(B, H / P, T, E) → (B, H, T_local, E)`` (Ulysses' second exchange)."""
    return _AllToAll.apply(x, ring, lengths, False)
