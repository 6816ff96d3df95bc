"""Point-to-point and all-to-all communication for context parallelism (gloo and NCCL).

Everything here speaks group ranks; ``torch.distributed`` wants global ranks for peers, so
:class:`Ring` translates once. Sends and receives are asynchronous (``isend``/``irecv``): the
caller starts the transfer of the next block, computes on the current one, then waits.

No rank is left waiting for a peer that failed: a rank whose computation raises keeps taking part
in the exchanges of the call (sending what it has), and every call ends with :func:`agree`, where
the ranks exchange a failure flag and all raise :class:`ContextParallelError` naming the rank that
failed and its exception. A peer that died or stopped taking part is bounded by the wait timeout
(``timeout=`` of the call or ``ATTNKIT_CP_TIMEOUT`` in seconds; by default the process group's).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Ring", "WAIT_LABEL", "TIMEOUT_ENV", "ContextParallelError", "resolve_timeout", "wait_all", "agree",
           "heads_to_seq", "seq_to_heads", "gather_descriptors", "exchange_checks", "digest_ints"]

#: Environment variable: seconds any rank waits for a transfer or collective before it raises.
TIMEOUT_ENV = "ATTNKIT_CP_TIMEOUT"
#: Bytes of each rank's error message in the failure exchange of :func:`agree`.
_MESSAGE_BYTES = 480


class ContextParallelError(RuntimeError):
    """A context-parallel call failed on some rank (its exception is named), or a peer did not answer
    within the wait timeout. Raised on every rank of the group, so none is left waiting."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = ranks


def resolve_timeout(timeout) -> datetime.timedelta | None:
    """The wait timeout: ``timeout`` (seconds or a ``timedelta``), else ``ATTNKIT_CP_TIMEOUT``
    (seconds), else None (the process group's own timeout applies)."""
    source = "timeout"
    if timeout is None:
        timeout, source = os.environ.get(TIMEOUT_ENV) or None, TIMEOUT_ENV
        if timeout is None:
            return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        try:
            seconds = float(timeout) if not isinstance(timeout, bool) else math.nan
        except (TypeError, ValueError):
            seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{source}: expected a positive number of seconds (or a timedelta), got {timeout!r}. "
                         f"Fix: e.g. timeout=60, or unset {TIMEOUT_ENV} to use the process group's timeout.")
    return datetime.timedelta(seconds=seconds)


class Ring:
    """A context-parallel group seen as a ring: ``next`` receives from us, ``prev`` sends to us.

    ``group=None`` with no initialized process group is the one-rank ring (no communication).
    ``timeout`` (a ``timedelta`` or None) bounds every wait of this ring's transfers."""

    def __init__(self, group, timeout: datetime.timedelta | None = None):
        self.group, self.timeout = group, timeout
        if group is None and not dist.is_initialized():
            self.rank, self.world = 0, 1
        else:
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    @classmethod
    def local(cls) -> Ring:
        """The one-rank ring, whatever process groups exist."""
        ring = cls.__new__(cls)
        ring.group, ring.rank, ring.world, ring.timeout = None, 0, 1, None
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


def wait_all(requests, ring: Ring) -> None:
    """Block until every request completes (labelled for the profiler), at most ``ring.timeout``
    each; a transfer that fails or times out raises :class:`ContextParallelError`."""
    with torch.profiler.record_function(WAIT_LABEL):
        for r in requests:
            try:
                r.wait() if ring.timeout is None else r.wait(ring.timeout)
            except RuntimeError as exc:
                limit = (f"within {ring.timeout.total_seconds():g} s" if ring.timeout is not None
                         else "within the process group's timeout")
                raise ContextParallelError(
                    f"context parallelism: rank {ring.rank} of {ring.world} got no answer from its peers {limit} "
                    f"({exc}). A peer stopped taking part (it died, or raised outside the attention call). "
                    f"Fix: the peers' own errors say why; timeout= or {TIMEOUT_ENV} bounds this wait."
                ) from exc


def _device(ring: Ring) -> torch.device:
    nccl = dist.get_backend(ring.group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def gather_descriptors(ring: Ring, values: list[int]) -> list[list[int]]:
    """Every rank's list of ints (same length on all ranks), in group-rank order."""
    if ring.world == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.long, device=_device(ring))
    out = [torch.empty_like(mine) for _ in range(ring.world)]
    wait_all([dist.all_gather(out, mine, group=ring.group, async_op=True)], ring)
    return [t.tolist() for t in out]


def exchange_checks(ring: Ring, error: BaseException | None, values: list[int],
                    what: str = "context_parallel_attention") -> list[list[int]]:
    """Every rank's ``values`` after every rank's check: raises this rank's ``error``, or a
    ValueError naming the ranks that had one (so none goes on to wait for them). Collective."""
    everyone = gather_descriptors(ring, [0 if error is not None else 1] + values)
    if error is not None:
        raise error
    failed = [r for r, d in enumerate(everyone) if d[0] == 0]
    if failed:
        raise ValueError(f"{what}: rank(s) {failed} rejected their inputs (their own error says why); every rank "
                         "stops instead of waiting for them.")
    return [d[1:] for d in everyone]


def digest_ints(text: str) -> list[int]:
    """Four non-negative int63s of a string's SHA-256 (to travel in a long tensor)."""
    raw = hashlib.sha256(text.encode()).digest()
    return [int.from_bytes(raw[8 * i:8 * i + 8], "little") >> 1 for i in range(4)]


def agree(ring: Ring, error: BaseException | None, what: str = "context_parallel_attention") -> None:
    """The failure exchange that ends every call: every rank says whether it failed (and why); if
    any did, every rank raises :class:`ContextParallelError` naming the failed ranks and their
    exceptions (on a failed rank, chained to its own exception). Collective: every rank calls it once
    per call, after its last transfer. One rank: re-raises ``error``."""
    if ring.world == 1:
        if error is not None:
            raise error
        return
    text = b"" if error is None else f"{type(error).__name__}: {error}".encode("utf-8", "replace")
    text = text[:_MESSAGE_BYTES - 1]
    mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    mine[0] = int(error is not None)
    mine[1:1 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    everyone = gather_descriptors(ring, mine.long().tolist())
    failed = [r for r, d in enumerate(everyone) if d[0]]
    if not failed:
        return
    reasons = "; ".join(f"rank {r}: {bytes(everyone[r][1:]).rstrip(bytes(1)).decode('utf-8', 'replace')}"
                        for r in failed)
    raise ContextParallelError(
        f"{what} failed on rank(s) {failed} of {ring.world} ({reasons}); every rank of the group stops with this "
        "error instead of waiting for them.", tuple(failed)) from error


def heads_to_seq(ring: Ring, x: Tensor, lengths: list[int]) -> Tensor:
    """``(B, H, T_local, E)`` sequence slices → ``(B, H / P, sum(lengths), E)`` full sequence (in
    rank order) for this rank's heads."""
    P = ring.world
    B, H, T, E = x.shape
    h = H // P
    send = x.reshape(B, P, h, T, E).transpose(0, 1).contiguous()  # (P, B, h, T, E): chunk j goes to rank j
    recv = x.new_empty(sum(B * h * n * E for n in lengths))
    # all_to_all_single(output, input, output_split_sizes, input_split_sizes)
    wait_all([dist.all_to_all_single(recv, send.reshape(-1), [B * h * n * E for n in lengths], [B * h * T * E] * P,
                                     group=ring.group, async_op=True)], ring)
    chunks = recv.split([B * h * n * E for n in lengths])
    return torch.cat([c.view(B, h, n, E) for c, n in zip(chunks, lengths)], dim=2)


def seq_to_heads(ring: Ring, x: Tensor, lengths: list[int]) -> Tensor:
    """The inverse of :func:`heads_to_seq`: ``(B, H / P, sum(lengths), E)`` → ``(B, H, T_local, E)``."""
    P = ring.world
    B, h, _, E = x.shape
    T = lengths[ring.rank]
    send = torch.cat([c.reshape(-1) for c in x.split(lengths, dim=2)])
    recv = x.new_empty(P * B * h * T * E)
    wait_all([dist.all_to_all_single(recv, send, [B * h * T * E] * P, [B * h * n * E for n in lengths],
                                     group=ring.group, async_op=True)], ring)
    return recv.view(P, B, h, T, E).transpose(0, 1).reshape(B, P * h, T, E)  # (B, H, T, E)
