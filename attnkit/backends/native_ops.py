"""The native kernel's operators, ``torch.ops.attnkit_native.forward`` and ``.backward``, made traceable.

The C++ file defines the operators and their CPU kernels; this module builds their grouped mask and
score-modifier arguments (:func:`kernel_spec`, the one builder of the kernel spec that the prefill and
the decode kernel both read, ``attnkit/csrc/spec.h``) and registers, through ``torch.library``, what
PyTorch needs beyond that:

* **fake (meta) kernels**, so ``torch.compile`` (and ``torch.export``) trace the operators without
  running them: output shapes and dtypes come from the inputs alone (:func:`forward_outputs`, the
  one place to edit when the schema changes, with :func:`backward_outputs`);
* **autograd**: the forward's backward is the ``backward`` operator, fed the saved log-sum-exp
  (FlashAttention-2's recomputation), so eager autograd, ``torch.compile`` and ``torch.func`` all
  differentiate through one formula. The backward also returns the gradients of the additive bias
  and of the score modifiers' distance vectors; the sinks' gradient is computed here from the LSE.
  Eager calls that need gradients take the same two functions as a plain ``autograd.Function``
  (:func:`forward`), which skips ``torch.library``'s per-call argument handling.

:func:`register` runs once, right after the extension's library is loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["forward", "forward_outputs", "backward_outputs", "register", "kernel_spec", "KernelSpec", "relative_values",
           "tensor_state", "FORWARD", "BACKWARD"]

FORWARD = "attnkit_native::forward"
BACKWARD = "attnkit_native::backward"
_REGISTERED: list[bool] = []

# The kernel spec's slots (attnkit/csrc/spec.h holds the same lists): tensors, ints, floats.
(GRID, LENGTHS, VALID, DOC, LAYOUT, EXTRA_INDEX, EXTRA, KEEP, BIAS, DIST, SLOPES, REL_VALUES, SINKS) = range(13)
NUM_SLOTS = 13
Q_OFFSET, KV_OFFSET, HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, LAYOUT_BS, DMIN = range(8)
NUM_INTS_CHAIN_START = 8  # the chain's (op, a, b) triples follow the position ints
SCALE = 0
# The score modifiers' chain ops (triples (op, a, b) after the position ints).
ADD, CAP, ALIBI, REL = 0, 1, 2, 3

_EMPTY = torch.empty(0)


@dataclass(frozen=True)
class KernelSpec:
    """A call's mask structure and score modifiers as every kernel reads them (``attnkit/csrc/spec.h``):
    three grouped operator arguments, ``tensors`` (one per slot, empty when absent), ``ints`` (positions,
    band bounds, then the modifier chain as ``(op, a, b)`` triples) and ``floats`` (the scale, then the
    soft-caps)."""

    tensors: list
    ints: list
    floats: list


def kernel_spec(scale: float, *, q_offset=0, kv_offset=0, left=None, right=None, grid=None, lengths=None,
                valid=None, doc=None, layout=None, layout_bs: int = 0, extra_index=None, extra=None,
                keep: Tensor | None = None, bias: Tensor | None = None, score_mod=None, sinks: Tensor | None = None,
                num_heads: int = 0, Tq: int = 0, Tk: int = 0, stat: torch.dtype = torch.float32,
                distance_vectors: bool = False) -> KernelSpec:
    """The kernel spec of one call, for the prefill and the decode kernel alike.

    Masks: band bounds ``left``/``right`` (None: unbounded) and the parts the prefill reads per tile
    (``grid``, ``lengths``, ``valid``, ``doc``, ``layout``, ``extra_index``/``extra``) or the decode
    kernel's broadcast ``keep (B, Hq, Tq, Tk)``. Score modifiers (``bias`` already a ``(B, Hq, Tq, Tk)``
    view of ``stat``, ``score_mod``, ``sinks``): with ``distance_vectors`` (the prefill: gradients reach
    slopes and tables through autograd) ALiBi and relative biases become per-(head, distance) vectors of
    ``Tq + Tk - 1`` values (:meth:`~attnkit.score_mods.ScoreModSpec.distance_form`); without (decode:
    nothing per call grows with Tk), ALiBi runs from its slopes and a relative bias from its values per
    clamped distance (T5's buckets are constant past ``max_distance``), both computed in the kernel."""
    t = [_EMPTY] * NUM_SLOTS
    for slot, x in ((GRID, grid), (LENGTHS, lengths), (VALID, valid), (DOC, doc), (LAYOUT, layout),
                    (EXTRA_INDEX, extra_index), (EXTRA, extra), (KEEP, keep), (BIAS, bias)):
        if x is not None:
            t[slot] = x
    if sinks is not None:
        t[SINKS] = sinks.to(stat).contiguous()
    ints = [q_offset, kv_offset, int(left is not None), left or 0, int(right is not None), right or 0, layout_bs, 0]
    floats = [float(scale)]
    if score_mod is not None:
        if distance_vectors:
            from ..score_mods import score_mod_spec

            dist, dmin, ops, caps = score_mod_spec(score_mod).distance_form(q_offset, Tq, kv_offset, Tk, num_heads,
                                                                            stat)
            ints[DMIN] = dmin
            rank = 0
            for op in ops:
                ints += [op, rank if op == ADD else 0, 0]
                rank += op == ADD
            floats += caps
            if dist is not None:
                t[DIST] = dist
        else:
            slopes, rel, used = [], [], 0
            for term in score_mod.terms():
                if term.kind == "softcap":
                    ints += [CAP, 0, 0]
                    floats.append(term.cap)
                elif term.kind == "alibi":
                    ints += [ALIBI, len(slopes), 0]
                    slopes.append(term.slopes.detach().to(stat).expand(num_heads).reshape(1, num_heads))
                elif term.kind == "relative_bias":
                    values = relative_values(term, num_heads, stat)
                    ints += [REL, used, term.max_distance]
                    rel.append(values.reshape(-1))
                    used += values.numel()
                else:
                    raise ValueError(f"kernel_spec: a {term.kind!r} term ({term.mod!r}) has no kernel form")
            if slopes:  # one ALiBi term (the usual case): its own slopes, viewed (no per-call copy)
                t[SLOPES] = (slopes[0] if len(slopes) == 1 else torch.cat(slopes)).contiguous()
            if rel:
                t[REL_VALUES] = rel[0] if len(rel) == 1 else torch.cat(rel)
    return KernelSpec(t, ints, floats)


def relative_values(term, num_heads: int, dtype: torch.dtype) -> Tensor:
    """A ``relative_bias`` term's value per clamped distance ``d = pos(k) - pos(q)`` in
    ``-max_distance .. max_distance``, ``(num_heads, 2 max_distance + 1)``: T5's bucket is the same for
    every distance past ``max_distance`` on either side, so the kernel reads ``values[h, clamp(d)]``."""
    table = term.table
    state = tensor_state(table)
    key = (id(table), state, num_heads, dtype, term.max_distance, term.bidirectional)
    found = None if state is None else _RELATIVE.get(key)
    if found is None or found[0] is not table:  # held with its values: its id is not reused meanwhile
        values = table.detach().to(dtype)[:, _clamped_buckets(table.shape[1], term.max_distance, term.bidirectional)]
        found = (table, values.expand(num_heads, -1).contiguous())
        if state is not None:
            if len(_RELATIVE) >= 16:
                _RELATIVE.clear()
            _RELATIVE[key] = found
    return found[1]


def tensor_state(t: Tensor) -> tuple | None:
    """What tells ``t``'s current values apart, for a cache of something derived from them: its storage
    address (``.data = other`` moves it) and version counter (every in-place op bumps it); None for an
    inference tensor, which has no counter (never cached). Edits through ``t.data`` bypass the counter,
    as they bypass autograd's own checks."""
    if t.is_inference():
        return None
    return t.data_ptr(), t._version


# table -> its values per clamped distance, kept while the table is unchanged (its version counter)
_RELATIVE: dict = {}


@functools.lru_cache(maxsize=16)
def _clamped_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> Tensor:
    """T5's bucket of every distance in ``-max_distance .. max_distance`` (a function of the three
    settings alone: computed once, then one gather of the table per call)."""
    from ..score_mods import t5_bucket

    return t5_bucket(torch.arange(-max_distance, max_distance + 1), num_buckets=num_buckets,
                     max_distance=max_distance, bidirectional=bidirectional)


def _stat_dtype(q: Tensor) -> torch.dtype:
    """The scores', statistics' and modifiers' dtype: float32 for 16-bit inputs, else q's."""
    return torch.promote_types(q.dtype, torch.float32)


def forward_outputs(q: Tensor, k: Tensor, v: Tensor, bad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Empty tensors shaped like the forward's outputs: ``out (B, Hq, Tq, Dv)`` in q's dtype, ``lse
    (B, Hq, Tq)`` (float32 for 16-bit inputs, else q's dtype) and ``hit``, the rows that saw a flagged
    key: ``(B, Hq, Tq)`` uint8, or ``(0,)`` when no key flags are passed (``bad`` empty)."""
    B, Hq, Tq = q.shape[:3]
    hit_shape = (B, Hq, Tq) if bad.numel() else (0,)
    return (q.new_empty((B, Hq, Tq, v.shape[-1])), q.new_empty((B, Hq, Tq), dtype=_stat_dtype(q)),
            bad.new_empty(hit_shape))


def backward_outputs(q: Tensor, k: Tensor, v: Tensor, dist: Tensor, need_dist: bool,
                     need_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Empty tensors shaped like the backward's outputs: ``dq, dk, dv`` like q, k, v; ``d_dist`` like
    ``dist (n_add, Hq, ndist)`` when ``need_dist`` and there is one, and ``dbias (B, Hq, Tq, Tk)`` when
    ``need_dbias`` (both in the statistics' dtype; ``(0,)`` when not computed)."""
    stat = _stat_dtype(q)
    d_dist = q.new_empty(tuple(dist.shape) if need_dist and dist.dim() == 3 else (0,), dtype=stat)
    dbias = q.new_empty((*q.shape[:3], k.shape[2]) if need_dbias else (0,), dtype=stat)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), d_dist, dbias


def _forward_fake(q, k, v, spec, ints, floats, block_q, block_k, bad):
    return forward_outputs(q, k, v, bad)


def _backward_fake(q, k, v, dout, lse, delta, spec, ints, floats, block_q, block_k, need_dist, need_dbias):
    return backward_outputs(q, k, v, spec[DIST], need_dist, need_dbias)


def _save(ctx, q, k, v, spec, output, rest) -> None:
    """Keep what the backward reads: q, k, v, out, lse and the spec's tensors (saved as autograd saves
    them), and the other arguments (``rest``: ints, floats, block_q, block_k)."""
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse, *spec)
    ctx.rest = rest


def _grads(ctx, dout, dlse, need_spec) -> tuple[Tensor, Tensor, Tensor, list]:
    """``(dq, dk, dv, the spec tensors' gradients)``; ``need_spec``: which spec tensors want one."""
    q, k, v, out, lse, *spec = ctx.saved_tensors
    ints, floats, block_q, block_k = ctx.rest
    need_bias, need_dist, need_sinks = (bool(need_spec[slot]) for slot in (BIAS, DIST, SINKS))
    # delta_i = sum_j p_ij dp_ij = rowsum(dout * out), in the statistics' type (float32 for bfloat16/float16
    # tiles); the LSE's own gradient enters as -dlse.
    if dout is None:
        dout = torch.zeros_like(out)
    dout = dout.contiguous()
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    dq, dk, dv, d_dist, dbias = torch.ops.attnkit_native.backward(q, k, v, dout, lse, delta.contiguous(), spec, ints,
                                                                  floats, block_q, block_k, need_dist, need_bias)
    grads: list = [None] * NUM_SLOTS
    if need_bias:  # (B, Hq, Tq, Tk): autograd reduces it to the bias's own shape through its expand
        grads[BIAS] = dbias
    if need_dist:  # (n_add, Hq, ndist): autograd carries it on to ALiBi slopes and relative-bias tables
        grads[DIST] = d_dist
    if need_sinks:  # d loss / d sink_h = -sum over h's rows of p_sink delta, p_sink = exp(sink - lse)
        p_sink = torch.exp(spec[SINKS].view(1, -1, 1) - lse)
        p_sink = torch.where(lse == float("-inf"), torch.zeros_like(p_sink), p_sink)  # a -inf sink, no key
        grads[SINKS] = -(p_sink * delta).sum(dim=(0, 2))
    return dq, dk, dv, grads


def _setup_context(ctx, inputs, output):
    q, k, v, spec, *rest = inputs
    _save(ctx, q, k, v, spec, output, tuple(rest[:4]))


def _backward(ctx, dout, dlse, _dhit):
    dq, dk, dv, grads = _grads(ctx, dout, dlse, ctx.needs_input_grad[3])
    return dq, dk, dv, grads, None, None, None, None, None


class _Eager(torch.autograd.Function):
    """The registered autograd of the forward operator, as a plain ``autograd.Function``: the same
    :func:`_setup_context` and :func:`_backward`, without the per-call argument handling of
    ``torch.library``'s wrapper (which rebuilds the schema's argument list: about 0.2 ms a call,
    the whole kernel's time at small sizes). Inside ``forward`` grad mode is off, so the operator's
    own autograd is not entered."""

    @staticmethod
    def forward(ctx, q, k, v, ints, floats, block_q, block_k, bad, *spec):  # the spec's tensors last: tracked
        output = torch.ops.attnkit_native.forward(q, k, v, list(spec), ints, floats, block_q, block_k, bad)
        _save(ctx, q, k, v, spec, output, (ints, floats, block_q, block_k))
        return output

    @staticmethod
    def backward(ctx, dout, dlse, _dhit):
        dq, dk, dv, grads = _grads(ctx, dout, dlse, ctx.needs_input_grad[8:])
        return dq, dk, dv, None, None, None, None, None, *grads


def forward(q: Tensor, k: Tensor, v: Tensor, spec: KernelSpec, block_q: int, block_k: int,
            bad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.attnkit_native.forward`` on ``spec``'s grouped arguments, differentiable: eager
    calls that need gradients go through :class:`_Eager`; ``torch.compile``, ``torch.func`` transforms
    and calls without gradients call the operator (and its registered autograd) itself."""
    if (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, *spec.tensors))
            and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()):
        return _Eager.apply(q, k, v, spec.ints, spec.floats, block_q, block_k, bad, *spec.tensors)
    return torch.ops.attnkit_native.forward(q, k, v, spec.tensors, spec.ints, spec.floats, block_q, block_k, bad)


def register() -> None:
    """Register the fake kernels and autograd of the loaded operators (once per process)."""
    if _REGISTERED:
        return
    torch.library.register_fake(FORWARD)(_forward_fake)
    torch.library.register_fake(BACKWARD)(_backward_fake)
    torch.library.register_autograd(FORWARD, _backward, setup_context=_setup_context)
    _REGISTERED.append(True)
