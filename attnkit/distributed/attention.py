"""``context_parallel_attention``: one sequence split across the ranks of a process group.

Each rank passes its own slice of ``q``, ``k`` and ``v`` (the positions its
:class:`~attnkit.distributed.SequenceLayout` assigns it) and gets back its slice of the output of
``attention(q_full, k_full, v_full, mask=mask)`` over the whole sequence — exactly, forward and
backward. Two strategies:

* ``"ring"`` (pass-KV, :mod:`attnkit.distributed.ring`): works for every head count and skips
  the shard pairs the mask leaves empty;
* ``"ulysses"`` (DeepSpeed Ulysses): two all-to-all exchanges turn sequence slices into head
  slices, one rank attends over the full sequence for ``Hq / P`` heads, and the result goes back.
  Needs ``Hq`` and ``Hkv`` divisible by the group size and a mask that does not tell heads apart.

``strategy="auto"`` takes Ulysses where it applies and the ring otherwise;
:func:`explain_context_parallel` says which, and why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..inputs import AttentionInputs
from ..masks import BlockStatus, Mask, as_mask
from .comm import Ring, all_to_all_heads_to_seq, all_to_all_seq_to_heads, gather_descriptors
from .layout import SequenceLayout
from .ring import BlockPair, RingPlan, ring_attention

__all__ = ["context_parallel_attention", "explain_context_parallel", "ContextParallelPlan", "STRATEGIES"]

STRATEGIES = ("auto", "ring", "ulysses")

# Masks whose mask_mod reads absolute positions only (Mask.offset_free) are handed to per-pair
# attention() calls as they are, so backends keep their structure (SDPA's is_causal, the band of a
# window). Any other mask is wrapped in _SequenceFrame, which evaluates it in the frame of the whole
# sequence.

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


class _SequenceFrame(Mask):
    """A mask evaluated as if the call covered the whole sequence (``q_offset = kv_offset = 0``),
    whatever the per-pair call's offsets: masks defined relative to the call (``Dense``) then
    index the full-sequence tensor they were built for."""

    def __init__(self, inner: Mask):
        self.inner = inner
        self.batch_size, self.num_heads = inner.batch_size, inner.num_heads

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        return self.inner.mask_mod(b, h, q_idx, kv_idx, q_offset=0, kv_offset=0)

    def evaluate(self, q_range, kv_range, *, q_offset, kv_offset, device=None, **sizes):
        return self.inner.evaluate(q_range, kv_range, q_offset=0, kv_offset=0, device=device, **sizes)

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0, **sizes):
        return self.inner.block_status(q_range, kv_range, q_offset=0, kv_offset=0, **sizes)

    @property
    def depends_on_batch(self):
        return self.inner.depends_on_batch

    @property
    def depends_on_head(self):
        return self.inner.depends_on_head

    def validate(self, B, H, Tq, Tk, q_offset, kv_offset):
        Mask.validate(self, B, H, Tq, Tk, q_offset, kv_offset)  # sizes were checked for the whole sequence

    def __repr__(self):
        return repr(self.inner)


@dataclass(frozen=True)
class ContextParallelPlan:
    """How one call runs (the same on every rank): the strategy, why, and the ring's work."""

    strategy: str
    reason: str
    world: int
    layout: SequenceLayout
    steps: int  # ring steps (1 = no K/V leaves its rank); Ulysses: 1
    pairs_computed: int  # (query segment, key segment) attention calls on this rank
    pairs_skipped: int  # pairs the mask leaves EMPTY (never computed)

    def describe(self) -> str:
        head = f"context parallel over {self.world} rank(s), {self.layout.total_len} positions: {self.strategy}"
        if self.strategy == "ring":
            work = (f"{self.steps} of {self.world} ring step(s); this rank computes {self.pairs_computed} "
                    f"shard pair(s) and skips {self.pairs_skipped} empty one(s)")
        else:
            work = "all-to-all over heads, full-sequence attention on Hq / P heads per rank"
        return f"{head} ({self.reason}); {work}"


def _ulysses_reasons(Hq: int, Hkv: int, world: int, mask: Mask | None) -> list[str]:
    reasons = []
    if Hq % world or Hkv % world:
        reasons.append(f"Ulysses needs Hq and Hkv divisible by the {world} ranks, got Hq={Hq}, Hkv={Hkv}")
    if mask is not None and mask.num_heads not in (None, 1):
        reasons.append(f"Ulysses gives each rank a subset of heads, but the mask {mask!r} differs per head")
    return reasons


def _choose(strategy: str, Hq: int, Hkv: int, world: int, mask: Mask | None) -> tuple[str, str]:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}.")
    if world == 1:
        return "ring", "one rank: plain attention"
    reasons = _ulysses_reasons(Hq, Hkv, world, mask)
    if strategy == "ulysses":
        if reasons:
            raise ValueError(f"strategy='ulysses' cannot run: {'; '.join(reasons)}. Fix: use strategy='ring' "
                             "(any head count and mask) or 'auto'.")
        return "ulysses", "requested"
    if strategy == "ring":
        return "ring", "requested"
    if reasons:
        return "ring", "auto: " + "; ".join(reasons) + ", so the ring"
    return "ulysses", f"auto: Hq={Hq} and Hkv={Hkv} divide over {world} ranks"


def _pairs(layout: SequenceLayout, rank: int, src: int, mask: Mask | None) -> tuple[list[BlockPair], int]:
    pairs, skipped = [], 0
    for q0, q1, a0, a1 in layout.local_ranges(rank):
        for k0, k1, b0, b1 in layout.local_ranges(src):
            status = BlockStatus.FULL if mask is None else mask.block_status((a0, a1), (b0, b1))
            if status is BlockStatus.EMPTY:
                skipped += 1
            else:
                pairs.append(BlockPair((q0, q1), (k0, k1), (a0, a1), (b0, b1), status))
    return pairs, skipped


def _check_local(q, k, v, dropout_p) -> AttentionInputs:
    inp = AttentionInputs.create(q, k, v, mask=None, q_offset=0, kv_offset=0)  # shapes, dtypes, devices
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q, k: context parallelism is self-attention over one split sequence, so each rank holds the same "
            f"positions of q and k/v; got {q.shape[2]} query and {k.shape[2]} key positions on this rank."
        )
    if dropout_p:
        raise ValueError(f"dropout_p: context_parallel_attention computes exact attention; got {dropout_p}. Fix: pass 0.0.")
    return inp


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    group=None,
    layout: SequenceLayout | None = None,
    strategy: str = "auto",
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    options=None,
    return_lse: bool = False,
):
    """Exact attention over a sequence split across the ranks of ``group``.

    Args:
        q, k, v: this rank's slices ``(B, Hq, T_local, D)``, ``(B, Hkv, T_local, D)``,
            ``(B, Hkv, T_local, Dv)``: the positions ``layout.positions(rank)`` of the sequence.
        mask: over absolute positions ``0 .. T-1`` of the whole sequence, the same on every rank
            (``Causal()``, ``SlidingWindow``, ``Document(ids)`` with ids for all ``T`` positions,
            ``Padding``, combinations, or a bool tensor ``(.., T, T)`` for the whole sequence).
        group: the ``torch.distributed`` process group holding the sequence (``None``: the default
            group; without an initialized group, one rank).
        layout: which positions each rank holds; ``None`` = contiguous slices in rank order, with
            each rank's length read from its tensors (lengths may differ).
        strategy: ``"ring"``, ``"ulysses"`` or ``"auto"`` (see :func:`explain_context_parallel`).
        scale, backend, options: as in :func:`attnkit.attention`; ``backend`` runs each block
            (it must return the LSE, e.g. ``"tiled"`` or ``"naive"``; ``"auto"`` picks one).
        return_lse: also return the log-sum-exp ``(B, Hq, T_local)`` (``-inf`` for rows that
            see no key); it is differentiable.

    Returns:
        ``out (B, Hq, T_local, Dv)`` in q's dtype (rows that see no key are 0), or ``(out, lse)``.

    Every rank must call it with the same mask, layout and strategy. Input errors found on one
    rank raise on every rank (a collective runs before any transfer); the process group's
    ``timeout`` bounds the wait for a rank that died.
    """
    plan, ring, mask, scale = _plan(q, k, v, mask, group, layout, strategy, scale, dropout_p)
    if plan.strategy == "ulysses":
        out, lse = _ulysses(q, k, v, plan, ring, mask, scale, backend, options)
    else:
        out, lse = ring_attention(q, k, v, _ring_plan(plan, ring, mask, scale, backend, options))
    return (out, lse) if return_lse else out


def explain_context_parallel(q: Tensor, k: Tensor, v: Tensor, *, mask=None, group=None,
                             layout: SequenceLayout | None = None, strategy: str = "auto") -> str:
    """The plan :func:`context_parallel_attention` follows for these inputs, in words (a
    collective: call it on every rank)."""
    return _plan(q, k, v, mask, group, layout, strategy, None, 0.0)[0].describe()


def _plan(q, k, v, mask, group, layout, strategy, scale, dropout_p):
    ring = Ring(group)
    error = None
    try:
        inp = _check_local(q, k, v, dropout_p)
        B, Hq, Hkv, T = inp.B, inp.Hq, inp.Hkv, inp.Tq
        if layout is not None:
            if not isinstance(layout, SequenceLayout):
                raise TypeError(f"layout: expected a SequenceLayout or None, got {type(layout).__name__}.")
            if layout.world != ring.world:
                raise ValueError(f"layout: built for {layout.world} ranks, but the group has {ring.world}. "
                                 f"Fix: SequenceLayout.zigzag(T, {ring.world}) or similar.")
            if layout.local_len(ring.rank) != T:
                raise ValueError(f"q: rank {ring.rank} holds {T} positions, but the layout gives it "
                                 f"{layout.local_len(ring.rank)}. Fix: pass layout.shard(x, rank) of the full tensors.")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}.")
        mine = [1, B, Hq, Hkv, inp.D, inp.Dv, T, _DTYPE_CODES[inp.dtype], STRATEGIES.index(strategy)]
    except (TypeError, ValueError) as exc:
        error, mine = exc, [0] + [0] * 8
    everyone = gather_descriptors(ring, mine)
    if error is not None:
        raise error
    failed = [r for r, d in enumerate(everyone) if d[0] == 0]
    if failed:
        raise ValueError(f"context_parallel_attention: rank(s) {failed} rejected their inputs (their own error "
                         "says why); every rank stops instead of waiting for them.")
    differ = [r for r, d in enumerate(everyone) if d[1:6] + d[7:] != mine[1:6] + mine[7:]]
    if differ:
        raise ValueError(
            f"context_parallel_attention: ranks disagree on (B, Hq, Hkv, D, Dv, dtype, strategy): rank {ring.rank} has "
            f"{mine[1:6] + mine[7:]}, rank(s) {differ} have {[everyone[r][1:6] + everyone[r][7:] for r in differ]}. "
            "Fix: every rank passes its slice of the same q, k, v."
        )
    lengths = [d[6] for d in everyone]
    if layout is None:
        layout = SequenceLayout.contiguous(lengths)
    Tfull = layout.total_len
    if mask is not None:
        mask = as_mask(mask, "mask")
        mask.validate(B, Hq, Tfull, Tfull, 0, 0)
    chosen, reason = _choose(strategy, Hq, Hkv, ring.world, mask)
    computed = skipped = 0
    steps = 1
    if chosen == "ring":
        steps = _ring_steps(layout, mask)
        for s in range(ring.world):
            pairs, skip = _pairs(layout, ring.rank, (ring.rank - s) % ring.world, mask)
            computed, skipped = computed + len(pairs), skipped + skip
    plan = ContextParallelPlan(chosen, reason, ring.world, layout, steps, computed, skipped)
    return plan, ring, mask, inp.scale if scale is None else scale


def _ring_steps(layout: SequenceLayout, mask: Mask | None) -> int:
    """1 + the last ring step at which any rank has a non-EMPTY pair (the same on every rank)."""
    P = layout.world
    for s in range(P - 1, 0, -1):
        if any(_pairs(layout, r, (r - s) % P, mask)[0] for r in range(P)):
            return s + 1
    return 1


def _ring_plan(plan: ContextParallelPlan, ring: Ring, mask, scale, backend, options) -> RingPlan:
    P, rank = ring.world, ring.rank
    steps = tuple(tuple(_pairs(plan.layout, rank, (rank - s) % P, mask)[0]) for s in range(plan.steps))
    lengths = tuple(plan.layout.local_len((rank - s) % P) for s in range(plan.steps))
    block_mask = mask if mask is None or mask.offset_free else _SequenceFrame(mask)
    return RingPlan(ring, plan.steps, steps, lengths, mask, block_mask, scale, backend, options)


def _ulysses(q, k, v, plan: ContextParallelPlan, ring: Ring, mask, scale, backend, options):
    """All-to-all to head slices, full-sequence attention (the one-rank ring, so the LSE is
    differentiable), all-to-all back."""
    layout = plan.layout
    lengths = [layout.local_len(r) for r in range(layout.world)]
    natural = torch.argsort(layout.order(q.device))  # rank order -> position order
    back = layout.order(q.device)  # position order -> rank order

    def gather(x):  # (B, H, T_local, E) -> (B, H / P, T, E) in position order
        return all_to_all_heads_to_seq(ring, x, lengths).index_select(2, natural)

    qh, kh, vh = gather(q), gather(k), gather(v)
    T = layout.total_len
    one = SequenceLayout.contiguous([T])
    local = ContextParallelPlan("ring", "one rank", 1, one, 1, 1, 0)
    out, lse = ring_attention(qh, kh, vh, _ring_plan(local, Ring.local(), mask, scale, backend, options))
    out = all_to_all_seq_to_heads(ring, out.index_select(2, back), lengths)
    lse = all_to_all_seq_to_heads(ring, lse.index_select(2, back).unsqueeze(-1), lengths).squeeze(-1)
    return out, lse
