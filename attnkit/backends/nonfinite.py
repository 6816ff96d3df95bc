"""The NaN/Inf contract of :func:`attnkit.attention`, kept in one place for every backend.

The contract (docs/guide/nonfinite.md):

* NaN in what a query row may attend (its query, or the key, value or bias entry of a key it may
  see) makes that row NaN; an Inf there gives what IEEE arithmetic gives, in that row only;
* NaN/Inf in what a row may not see (masked keys, keys only later queries see, padding) changes
  nothing in that row; a row with no allowed key is 0 whatever its inputs hold.

Gradients follow the forward (:func:`poison`, applied when the call is differentiated):

* a NaN row gets NaN gradients for what it read: its query row, the K and V rows of every key it may
  see (the mask says which; with GQA, in its key/value head) and its head's sink — whatever its own
  upstream gradient, as IEEE arithmetic (0 × NaN) and PyTorch's math path give;
* its upstream gradient is dropped, so nothing else changes: dq of every row that cannot see the bad
  element is bitwise what the same backend gives on the same inputs without it with the NaN rows'
  upstream gradient zeroed (same GEMM shapes, the NaN rows add exact zeros), and dK/dV of keys no
  NaN row reads are those (summed over rows in the backend's order: equal up to that rounding);
* a NaN/Inf no row may see changes no gradient. A bias's and score modifiers' own gradients get the
  other rows' contributions only.

A backend declares ``nonfinite = "policy"`` (the default: this module keeps the contract for it)
or ``"self"`` (its kernel keeps it itself); one whose kernel keeps it for some calls only (the
``decode`` backend: its native kernel does, its PyTorch-op twin does not) says so per call with
``Backend.keeps_nonfinite(inp, options)``. For a call the policy keeps, :func:`run`:

1. **Finite inputs (the common case) cost one read-only scan** of q, K and V (K and V skipped
   when the caller vouches for them with ``kv_finite=True``, as a cache that checks each token when
   it is written does): :func:`attnkit._validate.finite_only`, a bit test per element in C with the
   built extension, else a sum (a finite sum proves every entry finite). The backend then runs on
   the inputs as given, with no copy and no per-row work.
2. **Otherwise the exact slow path**: the query rows and keys holding NaN/Inf are zeroed, the same
   backend runs on the zeroed tensors (same shapes, same GEMMs, so every other row is bitwise what
   it would have been), and the rows that may attend a flagged key (the mask evaluated at the
   flagged key columns only), or whose own query was flagged and that see any key, are set to NaN.
   Differentiated, the keys those rows read are found too (the mask at those rows only) for the
   gradient rule; finite inputs never reach this path, so they pay nothing for it.

A bias is not scanned: every backend adds it before masking, so NaN/Inf at hidden positions is
masked away and at visible positions reaches exactly the rows that see it.

On the CPU the host branches on the one check (no device to stall). Elsewhere, and under
``torch.compile`` or ``torch.func`` transforms, the slow path runs unconditionally in a form that
never reads a value on the host (no ``.item()``, no ``nonzero``): it zeroes by flags and evaluates
the mask over all (query, key) pairs, a chunk of query rows at a time. A kernel that drops bad keys
per tile itself (the way to make that form free) declares ``nonfinite = "self"``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .._validate import finite_only
from ..inputs import AttentionInputs
from ._common import finite_rows, nonfinite_queries, poison_rows, zero_keys

__all__ = ["run", "all_finite", "host_may_branch"]

#: Mask entries evaluated at once when finding the rows that see a flagged key (bounds the memory).
_CHUNK_ELEMENTS = 2**24


def run(impl, inp: AttentionInputs, options, host: bool | None = None):
    """``impl.forward(inp, options)`` under the NaN/Inf contract (see the module docstring).
    ``host``: :func:`host_may_branch` of ``inp`` when the caller knows it (None: asked here)."""
    if impl.nonfinite == "self" or impl.keeps_nonfinite(inp, options):
        return impl.forward(inp, options)
    if host if host is not None else host_may_branch(inp):
        if all_finite(inp):
            return impl.forward(inp, options)
        return _exact(impl, inp, options, host=True)
    return _exact(impl, inp, options, host=False)


def host_may_branch(inp: AttentionInputs) -> bool:
    """True when reading one value on the host is free: CPU tensors, eager, outside ``torch.func``."""
    if not inp.q.is_cpu or torch.compiler.is_compiling():  # is_cpu: no device object built per call
        return False
    if not torch._C._are_functorch_transforms_active():  # no transform: no wrapped tensor (the hot path)
        return True
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return not any(isinstance(x, Tensor) and wrapped(x) for x in (inp.q, inp.k, inp.v))


def all_finite(inp: AttentionInputs) -> bool:
    """Whether q (and K, V unless ``inp.kv_finite``) hold finite values only: one read-only scan of
    each distinct tensor (``attention(x, x, x)`` reads x once), :func:`attnkit._validate.finite_only`."""
    q = inp.q
    if not finite_only(q):
        return False
    if inp.kv_finite:
        return True
    k, v = inp.k, inp.v
    return (k is q or finite_only(k)) and (v is k or v is q or finite_only(v))


def _exact(impl, inp: AttentionInputs, options, host: bool):
    """The slow path: zero the flagged query rows and keys, run ``impl``, poison the affected rows."""
    bad_q = nonfinite_queries(inp.q)  # (B, Hq, Tq)
    bad_k = None if inp.kv_finite else ~(finite_rows(inp.k) & finite_rows(inp.v))  # (B, Hkv, Tk)
    if host:  # the host may look: skip what is clean
        bad_q = bad_q if bool(bad_q.any()) else None
        bad_k = bad_k if bad_k is not None and bool(bad_k.any()) else None
    q, k, v = inp.q, inp.k, inp.v
    if bad_q is not None:
        q = q.masked_fill(bad_q[..., None], 0)
    if bad_k is not None:
        k, v = zero_keys(k, v, bad_k)
    clean = dataclasses.replace(inp, q=q, k=k, v=v, kv_finite=True)
    result = impl.forward(clean, options)
    rows = _poisoned_rows(inp, bad_q, bad_k, host)
    if rows is None:
        return result
    if isinstance(result, Tensor):
        return poison(inp, rows, host, [result])[0]
    # ``out``, the LSE, and further 4-D results (the naive backend's attention weights) are per query row.
    per_row = [i for i, x in enumerate(result)
               if i == 0 or (i == 1 and inp.return_lse) or (isinstance(x, Tensor) and x.dim() == 4)]
    result = list(result)
    for i, x in zip(per_row, poison(inp, rows, host, [result[i] for i in per_row])):
        result[i] = x
    return tuple(result)


def poison(inp: AttentionInputs, rows: Tensor, host: bool, results: list[Tensor]) -> list[Tensor]:
    """``results`` (per query row: ``(B, Hq, Tq, ...)``, the LSE ``(B, Hq, Tq)``) with the ``rows``
    ``(B, Hq, Tq)`` set to NaN, and the gradient rule of the contract when the call is differentiated:
    a NaN row's upstream gradient is dropped (its zeroed inputs gave a finite row that must not feed
    the gradients of keys it does not read), and NaN is added to the gradients of what it read — its
    query row, the K and V rows of the keys it may see, its head's sink. ``inp`` holds the caller's
    tensors (the ones that require grad); ``host`` as for :func:`run`."""
    q, k, v, sinks = inp.q, inp.k, inp.v, inp.sinks
    grads = [t if isinstance(t, Tensor) and t.requires_grad else None for t in (q, k, v, sinks)]
    if not torch.is_grad_enabled() or all(t is None for t in grads):
        return [poison_rows(x, None, rows)[0] if x.dim() == 4 else x.masked_fill(rows, float("nan")) for x in results]
    reads = _keys_read(inp, rows, host) if grads[1] is not None or grads[2] is not None else None
    return list(_PoisonRows.apply(rows, reads, *grads, *results))


class _PoisonRows(torch.autograd.Function):
    """``results`` with ``rows`` NaN; backward: their gradients with ``rows`` zeroed, and NaN added
    (``-0.0`` elsewhere: ``x + -0.0`` is ``x``, bit for bit) to q's ``rows``, the K/V rows of the
    keys in ``reads (B, Hkv, Tk)`` and the sinks of the heads with a NaN row."""

    generate_vmap_rule = True

    @staticmethod
    def forward(rows, reads, q, k, v, sinks, *results):
        return tuple(poison_rows(x, None, rows)[0] if x.dim() == 4 else x.masked_fill(rows, float("nan"))
                     for x in results)

    @staticmethod
    def setup_context(ctx, inputs, output):
        rows, reads = inputs[:2]
        ctx.save_for_backward(rows, reads)
        ctx.shapes = [None if t is None else (t.shape, t.dtype) for t in inputs[2:6]]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        rows, reads = ctx.saved_tensors
        g_results = [None if g is None else g.masked_fill(rows[..., None] if g.dim() == 4 else rows, 0)
                     for g in grads]
        flags = [rows, reads, reads, None if ctx.shapes[3] is None else rows.any(dim=2).any(dim=0)]
        g_inputs = []
        for needs, shape, flag in zip(ctx.needs_input_grad[2:6], ctx.shapes, flags):
            if not needs or shape is None or flag is None:
                g_inputs.append(None)
                continue
            size, dtype = shape
            nan = torch.full((), -0.0, dtype=dtype, device=rows.device).masked_fill(flag, float("nan"))
            g_inputs.append((nan[..., None] if len(size) == 4 else nan).expand(size))
        return (None, None, *g_inputs, *g_results)


def _poisoned_rows(inp: AttentionInputs, bad_q: Tensor | None, bad_k: Tensor | None, host: bool) -> Tensor | None:
    """``(B, Hq, Tq)`` bool: rows that may attend a flagged key, or whose query is flagged and that
    may attend any key (a row with no allowed key stays 0). None when nothing is flagged."""
    if bad_q is None and bad_k is None:
        return None
    rows = None
    if bad_k is not None:
        bad = bad_k.repeat_interleave(inp.groups, dim=1) if inp.groups > 1 else bad_k  # (B, Hq, Tk)
        if inp.mask is None:
            rows = bad.any(dim=-1, keepdim=True).expand(inp.B, inp.Hq, inp.Tq)
        elif host:  # the mask at the flagged key columns only
            cols = bad.any(dim=1).any(dim=0).nonzero().flatten()  # (n,)
            rows = _any_seen(inp, torch.arange(inp.Tq, device=inp.device), cols, bad[..., cols])
        else:
            rows = _any_seen(inp, torch.arange(inp.Tq, device=inp.device), torch.arange(inp.Tk, device=inp.device), bad)
    if bad_q is not None:
        if inp.mask is None:
            sees_any = bad_q
        elif host:  # the mask at the flagged query rows only
            at = bad_q.any(dim=1).any(dim=0).nonzero().flatten()  # (n,)
            sees_any = torch.zeros_like(bad_q)
            sees_any[..., at] = _any_seen(inp, at, torch.arange(inp.Tk, device=inp.device), None)
            sees_any &= bad_q
        else:
            sees_any = bad_q & _any_seen(inp, torch.arange(inp.Tq, device=inp.device),
                                         torch.arange(inp.Tk, device=inp.device), None)
        rows = sees_any if rows is None else rows | sees_any
    return rows


def _keys_read(inp: AttentionInputs, rows: Tensor, host: bool) -> Tensor:
    """``(B, Hkv, Tk)`` bool: the keys some row flagged in ``rows (B, Hq, Tq)`` may attend (any query
    head of the key's group). Eager on the CPU the mask is evaluated at the flagged rows only."""
    if inp.mask is None:
        seen = rows.any(dim=-1, keepdim=True).expand(inp.B, inp.Hq, inp.Tk)
    else:
        q_idx = rows.any(dim=1).any(dim=0).nonzero().flatten() if host else torch.arange(inp.Tq, device=inp.device)
        seen = _any_seen(inp, q_idx, torch.arange(inp.Tk, device=inp.device), None, rows[..., q_idx])
    return seen.view(inp.B, inp.Hkv, inp.groups, inp.Tk).any(dim=2) if inp.groups > 1 else seen


def _any_seen(inp: AttentionInputs, q_idx: Tensor, k_idx: Tensor, flagged: Tensor | None,
              rows: Tensor | None = None) -> Tensor:
    """``(B, Hq, len(q_idx))`` bool: the query rows ``q_idx`` may attend a key of ``k_idx`` (indices
    into the call's queries and keys) that is flagged in ``flagged (B, Hq, len(k_idx))`` (None: any
    key). With ``rows (B, Hq, len(q_idx))`` the transpose instead: ``(B, Hq, len(k_idx))``, the keys
    some row flagged in ``rows`` may attend. The mask is evaluated a bounded chunk of query rows at a time."""
    mask = inp.mask
    b, h = mask.batch_head_index(inp.B, inp.Hq, device=inp.device)
    kv_pos = (k_idx + inp.kv_offset).view(1, 1, 1, -1)
    if torch.compiler.is_compiling():  # one piece: a loop over a traced length would specialize the graph on it
        starts, step = [0], q_idx.numel()
    else:
        step = max(1, _CHUNK_ELEMENTS // max(1, inp.B * inp.Hq * k_idx.numel()))
        starts = range(0, q_idx.numel(), step)
    parts = []
    for i in starts:
        chunk = q_idx[i:i + step]
        q_pos = (chunk + inp.q_offset).view(1, 1, -1, 1)
        keep = mask.mask_mod(b, h, q_pos, kv_pos, q_offset=inp.q_offset, kv_offset=inp.kv_offset)
        keep = keep.expand(*keep.shape[:2], q_pos.shape[2], kv_pos.shape[3])  # (B|1, Hq|1, n, m)
        if rows is not None:
            parts.append((keep & rows[..., i:i + step, None]).any(dim=-2))
            continue
        if flagged is not None:
            keep = keep & flagged[:, :, None, :]
        parts.append(keep.any(dim=-1).expand(inp.B, inp.Hq, -1))
    if rows is not None:
        seen = parts[0] if parts else torch.zeros((inp.B, inp.Hq, k_idx.numel()), dtype=torch.bool, device=inp.device)
        for part in parts[1:]:
            seen = seen | part
        return seen
    if not parts:
        return torch.zeros((inp.B, inp.Hq, 0), dtype=torch.bool, device=inp.device)
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
