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

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..inputs import AttentionInputs
from ..masks import BlockStatus, Mask, as_mask
from .comm import Ring, agree, digest_ints, exchange_checks, heads_to_seq, resolve_timeout, seq_to_heads
from .layout import SequenceLayout, check_layout
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
    #: this rank's non-EMPTY pairs at each of the ``steps`` ring steps (what the ring computes)
    pairs: tuple[tuple[BlockPair, ...], ...] = field(default=(), repr=False, compare=False)

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
    if mask is not None and mask.depends_on_head:
        reasons.append(f"Ulysses gives each rank a subset of heads, but the mask {mask!r} may differ per head")
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


def _pairs(layout: SequenceLayout, rank: int, src: int, mask: Mask | None, B: int, Hq: int
           ) -> tuple[list[BlockPair], int]:
    """The non-EMPTY (query segment of ``rank``, key segment of ``src``) pairs, and how many are EMPTY."""
    pairs, skipped = [], 0
    for q0, q1, a0, a1 in layout.local_ranges(rank):
        for k0, k1, b0, b1 in layout.local_ranges(src):
            status = (BlockStatus.FULL if mask is None
                      else mask.block_status((a0, a1), (b0, b1), batch_size=B, num_heads=Hq))
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
        raise ValueError(f"dropout_p: context_parallel_attention computes exact attention; got {dropout_p}. "
                         "Fix: pass 0.0.")
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
    timeout=None,
):
    """Exact attention over a sequence split across the ranks of ``group``.

    Args:
        q, k, v: this rank's slices ``(B, Hq, T_local, D)``, ``(B, Hkv, T_local, D)``,
            ``(B, Hkv, T_local, Dv)``: the positions ``layout.positions(rank)`` of the sequence.
        mask: over absolute positions ``0 .. T-1`` of the whole sequence, the same on every rank
            (``Causal()``, ``SlidingWindow``, ``Document(ids)`` with ids for all ``T`` positions,
            ``KeyPadding`` with every row's length, ``Padding``, ``Custom``, combinations, or a
            bool tensor ``(.., T, T)`` for the whole sequence). The ranks compare their masks
            (:meth:`~attnkit.masks.Mask.content_digest`) and layouts, and refuse to run when they differ.
        group: the ``torch.distributed`` process group holding the sequence (``None``: the default
            group; without an initialized group, one rank).
        layout: which positions each rank holds; ``None`` = contiguous slices in rank order, with
            each rank's length read from its tensors (lengths may differ).
        strategy: ``"ring"``, ``"ulysses"`` or ``"auto"`` (see :func:`explain_context_parallel`).
        scale, backend, options: as in :func:`attnkit.attention`; ``backend`` runs each block
            (it must return the LSE, e.g. ``"tiled"`` or ``"naive"``; ``"auto"`` picks one).
        return_lse: also return the log-sum-exp ``(B, Hq, T_local)`` (``-inf`` for rows that
            see no key); it is differentiable.
        timeout: seconds (or a ``timedelta``) any wait for a peer may last before this rank raises
            :class:`~attnkit.distributed.ContextParallelError`; ``None``: the environment variable
            ``ATTNKIT_CP_TIMEOUT`` (seconds) if set, else the process group's timeout.

    Returns:
        ``out (B, Hq, T_local, Dv)`` in q's dtype (rows that see no key are 0), or ``(out, lse)``.

    Every rank must call it with the same mask, layout and strategy. Input errors found on one
    rank raise on every rank (collectives run before any transfer). A rank that fails during the
    exchange (forward or backward) keeps exchanging to the end of the pass, then every rank raises
    :class:`~attnkit.distributed.ContextParallelError` naming that rank and its exception; a rank
    that stops taking part altogether is bounded by ``timeout``.
    """
    plan, ring, mask, scale = _plan(q, k, v, mask, group, layout, strategy, scale, dropout_p, timeout)
    if plan.strategy == "ulysses":
        out, lse = _Ulysses.apply(q, k, v, plan, ring, mask, scale, backend, options)
    else:
        out, lse = ring_attention(q, k, v, _ring_plan(plan, ring, mask, scale, backend, options))
    return (out, lse) if return_lse else out


def explain_context_parallel(q: Tensor, k: Tensor, v: Tensor, *, mask=None, group=None,
                             layout: SequenceLayout | None = None, strategy: str = "auto", timeout=None) -> str:
    """The plan :func:`context_parallel_attention` follows for these inputs, in words (a
    collective: call it on every rank)."""
    return _plan(q, k, v, mask, group, layout, strategy, None, 0.0, timeout)[0].describe()


def _plan(q, k, v, mask, group, layout, strategy, scale, dropout_p, timeout):
    ring = Ring(group)
    error = None
    try:
        ring.timeout = resolve_timeout(timeout)
        inp = _check_local(q, k, v, dropout_p)
        B, Hq, Hkv, T = inp.B, inp.Hq, inp.Hkv, inp.Tq
        check_layout(layout, ring.world, ring.rank, T)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}.")
        mine = [B, Hq, Hkv, inp.D, inp.Dv, T, _DTYPE_CODES[inp.dtype], STRATEGIES.index(strategy)]
    except (TypeError, ValueError) as exc:
        error, mine = exc, [0] * 8
    everyone = exchange_checks(ring, error, mine)
    same = lambda d: d[:5] + d[6:]  # noqa: E731 - all but this rank's length
    differ = [r for r, d in enumerate(everyone) if same(d) != same(mine)]
    if differ:
        raise ValueError(
            f"context_parallel_attention: ranks disagree on (B, Hq, Hkv, D, Dv, dtype, strategy): rank {ring.rank} has "
            f"{same(mine)}, rank(s) {differ} have {[same(everyone[r]) for r in differ]}. "
            "Fix: every rank passes its slice of the same q, k, v."
        )
    # The mask and the layout: checked and planned on every rank, then compared. Any failure here
    # (a Custom mask's function raising included) is exchanged before a single block moves.
    plan = error = None
    digests = [0] * 8
    try:
        if layout is None:
            layout = SequenceLayout.contiguous([d[5] for d in everyone])
        Tfull = layout.total_len
        if mask is not None:
            mask = as_mask(mask, "mask")
            mask.validate(B, Hq, Tfull, Tfull, 0, 0)
        chosen, reason = _choose(strategy, Hq, Hkv, ring.world, mask)
        pairs, steps, computed, skipped = (), 1, 0, 0
        if chosen == "ring":
            pairs, steps, computed, skipped = _ring_pairs(layout, ring.rank, mask, B, Hq)
        plan = ContextParallelPlan(chosen, reason, ring.world, layout, steps, computed, skipped, pairs)
        mask_digest = "none" if mask is None else mask.content_digest(Tfull, Tfull, batch_size=B, num_heads=Hq)
        digests = digest_ints(mask_digest) + digest_ints(repr(layout.segments))
    except Exception as exc:  # noqa: BLE001 - exchanged, then raised on this rank by exchange_checks
        error = exc
    everyone = exchange_checks(ring, error, digests)
    for what, part, fix in (
        ("mask", slice(0, 4), "every rank passes the same mask over the whole sequence (a KeyPadding with "
                              "every row's length, a Document with every position's id, not this rank's own)"),
        ("layout", slice(4, 8), "every rank passes the same SequenceLayout (or None on every rank)"),
    ):
        differ = [r for r, d in enumerate(everyone) if d[part] != everyone[0][part]]
        if differ:
            raise ValueError(f"{what}: the ranks of the group pass different values: rank(s) {differ} differ from "
                             f"rank 0 (this is rank {ring.rank}, with {mask if what == 'mask' else layout!r}). "
                             f"Fix: {fix}.")
    return plan, ring, mask, inp.scale if scale is None else scale


def _ring_pairs(layout: SequenceLayout, rank: int, mask: Mask | None, B: int, Hq: int):
    """``(pairs, steps, computed, skipped)``: this rank's non-EMPTY pairs at each ring step up to
    the last step at which any rank has one (the same ``steps`` on every rank)."""
    P = layout.world
    table = [[_pairs(layout, r, (r - s) % P, mask, B, Hq) for s in range(P)] for r in range(P)]
    steps = 1 + max((s for s in range(P) for r in range(P) if table[r][s][0]), default=0)
    mine = table[rank]
    return (tuple(tuple(mine[s][0]) for s in range(steps)), steps, sum(len(p) for p, _ in mine),
            sum(n for _, n in mine))


def _ring_plan(plan: ContextParallelPlan, ring: Ring, mask, scale, backend, options) -> RingPlan:
    P, rank = ring.world, ring.rank
    steps = plan.pairs
    lengths = tuple(plan.layout.local_len((rank - s) % P) for s in range(plan.steps))
    block_mask = mask if mask is None or mask.offset_free else _SequenceFrame(mask)
    return RingPlan(ring, plan.steps, steps, lengths, mask, block_mask, scale, backend, options)


class _Ulysses(torch.autograd.Function):
    """All-to-all to head slices, full-sequence attention (the one-rank ring, so the LSE is
    differentiable), all-to-all back; the backward runs the same exchanges in reverse. A rank whose
    attention fails still takes part in every exchange (with zeros), and the pass ends with the
    failure exchange (:func:`~attnkit.distributed.comm.agree`)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: ContextParallelPlan, ring: Ring, mask, scale, backend, options):
        layout = plan.layout
        lengths = [layout.local_len(r) for r in range(layout.world)]
        natural = torch.argsort(layout.order(q.device))  # rank order -> position order
        back = layout.order(q.device)  # position order -> rank order
        heads = [heads_to_seq(ring, x, lengths).index_select(2, natural) for x in (q, k, v)]  # (B, H / P, T, E)
        B, h, T, _ = heads[0].shape
        error, graph = None, None
        try:
            with torch.enable_grad():
                inputs = [x.detach().requires_grad_(need) for x, need in zip(heads, ctx.needs_input_grad[:3])]
                one = SequenceLayout.contiguous([T])
                pairs, steps, computed, skipped = _ring_pairs(one, 0, mask, B, h)
                local = ContextParallelPlan("ring", "one rank", 1, one, steps, computed, skipped, pairs)
                out_h, lse_h = ring_attention(*inputs, _ring_plan(local, Ring.local(), mask, scale, backend, options))
            graph = (inputs, out_h, lse_h)
            out_h, lse_h = out_h.detach(), lse_h.detach()
        except Exception as exc:  # noqa: BLE001 - every rank raises it after the exchanges (agree)
            error = exc
            out_h = q.new_zeros(B, h, T, v.shape[-1])
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # the ring's LSE dtype
            lse_h = q.new_full((B, h, T), float("-inf"), dtype=acc)
        out = seq_to_heads(ring, out_h.index_select(2, back), lengths)
        lse = seq_to_heads(ring, lse_h.index_select(2, back).unsqueeze(-1), lengths).squeeze(-1)
        agree(ring, error)
        ctx.graph, ctx.ring, ctx.lengths, ctx.natural, ctx.back = graph, ring, lengths, natural, back
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        ring, lengths = ctx.ring, ctx.lengths
        inputs, out_h, lse_h = ctx.graph
        dout_h = heads_to_seq(ring, dout.contiguous(), lengths).index_select(2, ctx.natural)
        dlse_h = heads_to_seq(ring, dlse.unsqueeze(-1).contiguous(), lengths).squeeze(-1).index_select(2, ctx.natural)
        wanted = [x for x in inputs if x.requires_grad]
        error, grads = None, [torch.zeros_like(x) for x in inputs]
        try:
            found = torch.autograd.grad((out_h, lse_h), wanted, (dout_h, dlse_h), allow_unused=True)
            found = iter(found)
            grads = [next(found) if x.requires_grad else g for x, g in zip(inputs, grads)]
            grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
        except Exception as exc:  # noqa: BLE001 - every rank raises it after the exchanges (agree)
            error = exc
        result = [seq_to_heads(ring, g.index_select(2, ctx.back).contiguous(), lengths) for g in grads]
        agree(ring, error)
        ctx.graph = None
        return (*result, None, None, None, None, None, None)
