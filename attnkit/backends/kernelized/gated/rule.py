"""The entry point of gated linear attention: validation, head sharing, normalization, packing.

:func:`gated_linear_attention` reads like ``attnkit.attention``: layout ``(B, H, T, D)``, ``scale=None``
meaning ``Dk ** -0.5``, keyword-only options. Which rule runs follows from the gates::

    beta given, g (B, Hv, T)        gated delta rule  (Gated DeltaNet: Qwen3-Next, Qwen3.5)
    beta given, g (B, Hv, T, Dk)    KDA               (Kimi-Linear)
    beta None,  g (B, Hv, T)        SSD               (Mamba2; gated linear attention)
    beta None,  g (B, Hv, T, Dk)    GLA               (gated linear attention with per-channel gates)

Queries and keys may have fewer heads than values (``Hv % Hk == 0``; value head ``h`` reads key
head ``h // (Hv // Hk)``, as Qwen3-Next). Inputs of any float dtype are computed in float32
(float64 stays float64), the state is float32 and the output comes back in q's dtype.

NaN/Inf in a token reach only what can see it (the policy of ``attnkit.attention``, see
``attnkit.backends.nonfinite``): finite inputs cost one read-only scan of q, k and v (and of g and
beta when ``check_gates=False`` leaves them unread); otherwise the flagged tokens are zeroed, the
rule runs on the clean inputs, and the outputs that can see a flagged token are set to NaN: a bad
query poisons its own output only, a bad key, value, gate or beta the token's output, every later
output of its sequence and that sequence's final state (the state carries it forward), in the value
heads that read it. ``g = -inf`` is a decay of 0, not a bad token.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import Tensor

from ...._validate import finite_only, positive_int, score_scale
from ..._common import finite_rows, poison_rows
from . import kernel
from .gated_delta import chunk_gated_delta_rule
from .kda import chunk_kda
from .recurrence import recurrent_rule
from .scan import forgetting_gates
from .ssd import chunk_ssd

__all__ = ["gated_linear_attention", "explain_gated", "rule_name", "prepare"]

_METHODS = ("auto", "chunked", "recurrent")


def rule_name(g: Tensor, beta: Tensor | None) -> str:
    """``"gated_delta"``, ``"kda"``, ``"ssd"`` or ``"gla"`` for these gates (see the module docstring)."""
    if beta is None:
        return "gla" if g.dim() == 4 else "ssd"
    return "kda" if g.dim() == 4 else "gated_delta"


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, *, check_gates: bool = True) -> None:
    """``ValueError``/``TypeError`` naming the argument for anything the rules cannot take."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}.")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[0] != q.shape[0] or v.shape[2] != q.shape[2]:
        raise ValueError(f"q, k, v: expected q and k (B, Hk, T, Dk) and v (B, Hv, T, Dv), got q {_shape(q)}, "
                         f"k {_shape(k)}, v {_shape(v)}. Fix: pass the (B, H, T, D) layout, e.g. x.transpose(1, 2).")
    B, Hk, T, Dk = q.shape
    Hv = v.shape[1]
    if Hk == 0 or Hv % Hk:
        raise ValueError(f"v: {Hv} value heads for {Hk} key heads; expected Hk >= 1 and Hv % Hk == 0 (each key "
                         "head serves Hv // Hk value heads).")
    if not (Dk and v.shape[-1]):
        raise ValueError(f"q, k, v: expected head dims Dk, Dv >= 1, got q {_shape(q)}, v {_shape(v)}. Fix: skip the "
                         "call for empty inputs.")
    if tuple(g.shape) not in ((B, Hv, T), (B, Hv, T, Dk)) and Hv != T and tuple(g.shape[:3]) == (B, T, Hv):
        # q's dims 1 and 2 are g's swapped: q, k, v in (B, T, H, D), or g in (B, T, H). Heads are usually
        # fewer than tokens, so a larger dim 1 points at q, k, v; the message names both fixes.
        layout = (f"q, k, v: they look like the (B, T, H, D) layout: dims 1 and 2 of q {_shape(q)}, k {_shape(k)} "
                  f"and v {_shape(v)} are those of g {_shape(g)} swapped. Fix: pass q, k, v as (B, H, T, D), e.g. "
                  "q.transpose(1, 2), and transpose the output back with .transpose(1, 2)")
        gate = (f"g: expected (B, Hv, T) = {(B, Hv, T)} (or (B, Hv, T, Dk)), got {_shape(g)}, which looks like "
                "(B, T, H). Fix: g.transpose(1, 2)")
        first, second = (layout, gate) if Hv > T else (gate, layout)
        raise ValueError(f"{first}. Or, if those are right: {second[0].lower()}{second[1:]}.")
    if tuple(g.shape) not in ((B, Hv, T), (B, Hv, T, Dk)):
        raise ValueError(f"g: expected (B, Hv, T) = {(B, Hv, T)} (one gate per head) or (B, Hv, T, Dk) = "
                         f"{(B, Hv, T, Dk)} (one per key channel), got {_shape(g)}.")
    if beta is not None and (not isinstance(beta, Tensor) or tuple(beta.shape) != (B, Hv, T)):
        raise ValueError(f"beta: expected None (no delta rule: SSD) or a tensor (B, Hv, T) = {(B, Hv, T)}, "
                         f"got {_shape(beta)}.")
    if check_gates and g.numel():
        bad = ~(g <= 0) | ~torch.isfinite(g)
        if bool(bad.any()):
            raise ValueError(f"g: expected finite log-decays <= 0 (the state is multiplied by exp(g)), got values "
                             f"such as {g[bad].flatten()[:3].tolist()}. Fix: g = -softplus(...) or -exp(A_log) * dt; "
                             "check_gates=False skips this check.")
    if check_gates and beta is not None and beta.numel():
        bad = ~((beta >= 0) & (beta <= 1))
        if bool(bad.any()):
            raise ValueError(f"beta: expected values in [0, 1] (the delta rule's step size), got values such as "
                             f"{beta[bad].flatten()[:3].tolist()}. Fix: beta = sigmoid(...); check_gates=False "
                             "skips this check.")
    rows = B if cu_seqlens is None else cu_seqlens.numel() - 1 if isinstance(cu_seqlens, Tensor) else None
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point \
                or cu_seqlens.numel() < 2:
            raise TypeError(f"cu_seqlens: expected a 1-D integer tensor [0, end_1, ..., T], got {_shape(cu_seqlens)}.")
        offsets = cu_seqlens.tolist()
        if B != 1 or offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T={T} over a batch of 1 "
                             f"packed sequence, got {offsets} with B={B}.")
    if initial_state is not None:
        want = (rows, Hv, Dk, v.shape[-1])
        if not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state: expected (B or sequences, Hv, Dk, Dv) = {want}, got "
                             f"{_shape(initial_state)}.")


def prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, *, scale: float,
            qk_l2norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Compute dtype, key heads repeated to the value heads, optional L2 norm, q scaled."""
    acc = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    q, k, v, g = (x.to(acc) for x in (q, k, v, g))
    beta = None if beta is None else beta.to(acc)
    if qk_l2norm:  # as flash-linear-attention's l2norm: x / sqrt(|x|² + 1e-6), in the compute dtype
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    groups = v.shape[1] // k.shape[1]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)  # (B, Hv, T, Dk)
    q = q * scale
    return q, k, v, g, beta


def _recurrent(method: str, T: int) -> bool:
    return method == "recurrent" or (method == "auto" and T == 1) or T == 0


def native_reason(device: torch.device, dtype: torch.dtype, T: int, grad: bool, method: str,
                  native: bool | None) -> str | None:
    """Why the native gated kernel does not run inputs of this compute ``dtype`` (None: it runs them);
    ``grad``: autograd records the call."""
    if native is False:
        return "native=False asks for the PyTorch path"
    if T == 0:
        return "no tokens"
    if _recurrent(method, T):
        return kernel.step_reason(device, dtype, grad)
    return kernel.chunked_reason(device, dtype)


def _run(q, k, v, g, beta, state, method: str, chunk_size: int | None,
         recompute_segment: int | None = None, native: bool | None = None,
         in_place: bool = False) -> tuple[Tensor, Tensor]:
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, state))
    why_not = native_reason(q.device, q.dtype, q.shape[2], grad, method, native)
    if native and why_not is not None:
        raise ValueError(f"native=True: the native gated kernel declines these inputs ({why_not}). Fix: "
                         "native=None runs the PyTorch path where the kernel declines.")
    if _recurrent(method, q.shape[2]):
        if why_not is None:
            if in_place and state is not None and state.is_contiguous():
                S = state  # the caller's state, written in place (no copy)
            else:
                S = q.new_zeros(q.shape[:2] + (q.shape[-1], v.shape[-1])) if state is None \
                    else state.clone(memory_format=torch.contiguous_format)
            return kernel.step(q, k, v, g, beta, S), S  # S updated in place
        return recurrent_rule(q, k, v, g, beta, state)
    T = q.shape[2]
    if recompute_segment is not None and T > recompute_segment and torch.is_grad_enabled():
        # Activation checkpointing per segment: backward keeps only each segment's starting state
        # and recomputes the segment's chunked forward, so the peak holds one segment's tensors.
        outs = []
        # split, not slices: autograd joins the pieces' gradients once (a slice's backward fills a
        # full-size zero tensor per piece)
        pieces = zip(*(x.split(recompute_segment, dim=2) for x in (q, k, v, g)),
                     beta.split(recompute_segment, dim=2) if beta is not None else [None] * T)
        for q_s, k_s, v_s, g_s, b_s in pieces:
            o, state = torch.utils.checkpoint.checkpoint(_run, q_s, k_s, v_s, g_s, b_s, state, method, chunk_size,
                                                         None, native, use_reentrant=False)
            outs.append(o)
        return torch.cat(outs, dim=2), state
    rule = rule_name(g, beta)
    if why_not is None:  # every rule in the native kernel
        return kernel.chunked(q, k, v, forgetting_gates(g), beta, state, chunk_size)
    opts = {} if chunk_size is None else {"chunk_size": chunk_size}
    if rule == "ssd":
        return chunk_ssd(q, k, v, g, initial_state=state, **opts)
    fn = chunk_gated_delta_rule if rule == "gated_delta" else chunk_kda  # KDA, and GLA without beta
    return fn(q, k, v, g, beta, initial_state=state, **opts)


def _nonfinite_tokens(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, *, gates_read: bool):
    """The NaN/Inf policy's flags (see the module docstring): None when every input is finite (one
    read-only scan of each; g and beta only unless ``gates_read``: check_gates has read them), else
    ``(read, absorbed)``, ``(B, Hv, T)`` bool: the tokens whose query is bad, and those whose key,
    value, gate or beta is (a NaN or +inf gate; -inf is a decay of 0)."""
    scanned = (q, k, v) if gates_read else (q, k, v, g) + (() if beta is None else (beta,))
    if all(finite_only(x) for x in scanned):
        return None
    groups = v.shape[1] // k.shape[1]
    read = ~finite_rows(q)
    absorbed = ~finite_rows(k)
    if groups > 1:
        read, absorbed = read.repeat_interleave(groups, 1), absorbed.repeat_interleave(groups, 1)
    absorbed |= ~finite_rows(v) | ~((g.amax(-1) if g.dim() == 4 else g) < float("inf"))
    if beta is not None:
        absorbed |= ~torch.isfinite(beta)
    return None if not bool((read | absorbed).any()) else (read, absorbed)


def _zero_nonfinite(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None):
    """The inputs with every NaN/Inf entry 0 (a gate's -inf kept: a decay of 0), so that no ``0 · NaN``
    of the chunk products reaches a token that cannot see them."""
    q, k, v = (x.masked_fill(~torch.isfinite(x), 0) for x in (q, k, v))
    g = g.masked_fill(~(g < float("inf")), 0)
    return q, k, v, g, None if beta is None else beta.masked_fill(~torch.isfinite(beta), 0)


def _poison(o: Tensor, final: Tensor, read: Tensor, absorbed: Tensor, offsets: list[int] | None):
    """``o (B, Hv, T, Dv)`` NaN at the rows that can see a flagged token: the bad queries' own rows,
    and every row at or after an absorbed token of its sequence; ``final`` NaN for the sequences and
    heads that absorbed one."""
    count = torch.nn.functional.pad(absorbed.cumsum(-1), (1, 0))  # absorbed tokens before each position
    if offsets is None:
        before, lengths, ends = count[..., :1], None, count[..., -1:]
    else:
        at = torch.tensor(offsets, device=o.device)
        before, lengths, ends = count[..., at[:-1]], at.diff(), count[..., at[1:]]
    rows = count[..., 1:] > (before if lengths is None else before.repeat_interleave(lengths, dim=-1))
    hit = ends > before  # (B, Hv, 1) or (1, Hv, sequences)
    o = poison_rows(o, None, rows | read)[0]
    return o, poison_rows(final, None, hit if offsets is None else hit[0].T[..., None])[0]


def gated_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None = None, *,
    scale: float | None = None, qk_l2norm: bool = False, initial_state: Tensor | None = None,
    return_state: bool = False, cu_seqlens: Tensor | None = None, method: str = "auto",
    chunk_size: int | None = None, recompute_segment: int | None = None, check_gates: bool = True,
    native: bool | None = None, state_in_place: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal gated linear attention: the gated delta rule, KDA or SSD (chosen by ``g`` and ``beta``).

    Shapes: ``q, k (B, Hk, T, Dk)``, ``v (B, Hv, T, Dv)``, ``g (B, Hv, T)`` or ``(B, Hv, T, Dk)``
    (log-decays <= 0), ``beta (B, Hv, T)`` in [0, 1] or None. Per token, with ``q`` scaled by
    ``scale`` (default ``Dk ** -0.5``) after the optional L2 norm::

        S_t = (I - β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ
        (β None: S_t = exp(g_t) S_{t-1} + k_t v_tᵀ)
        o_t = S_tᵀ q_t                                                       S: (B, Hv, Dk, Dv)

    ``initial_state (B, Hv, Dk, Dv)`` starts the recurrence (gradients flow into it);
    ``return_state=True`` also returns the final state (float32), so a prompt processed in pieces
    equals one call. ``cu_seqlens`` (``[0, end_1, ..., T]``, with ``B = 1``) packs sequences: the
    state restarts at each boundary, ``initial_state`` and the returned state then hold one row per
    sequence. ``method``: ``"chunked"`` (O(T) memory, the fast path), ``"recurrent"`` (token by
    token, the naive twin) or ``"auto"`` (recurrent for one token, else chunked).
    ``recompute_segment`` (tokens) trades time for memory in training: backward recomputes each
    segment from its starting state instead of keeping every chunk's intermediates (the result is
    the same). ``native``: None (default) runs the native gated kernel (``attnkit build``) where it
    can — every rule chunked, forward and backward, in float32 (bf16/fp16 inputs are computed in
    float32), and the recurrent step outside autograd — and the PyTorch path otherwise (float64, a
    step under autograd, an unbuilt kernel: :func:`explain_gated` says why); False always runs the
    PyTorch path; True requires the kernel (``ValueError`` with the reason where it declines). Both
    paths compute the same function. ``state_in_place=True`` overwrites ``initial_state`` (float32)
    with the final state instead of returning a new tensor (decoding: the kernel's step then
    writes it directly, no copy); not under autograd. Returns ``o (B, Hv, T, Dv)`` in q's dtype (and
    the state).

    NaN/Inf in one token reach only what can see it, on either method: a bad query makes its own
    output NaN; a bad key, value, gate (NaN or +inf; ``-inf`` is a decay of 0) or beta makes that
    token's output and every later output of its sequence (or batch row) NaN in the value heads that
    read it, and that sequence's final state; every other output and state keeps its value, and the
    gradients of the outputs that cannot see the token stay finite. ``scale`` must be finite (NaN
    and ±Inf raise ``ValueError``, as in ``attnkit.attention``)."""
    if method not in _METHODS:
        raise ValueError(f"method: expected one of {_METHODS}, got {method!r}.")
    if native not in (None, True, False):
        raise TypeError(f"native: expected None (the kernel where it runs), True or False, got {native!r}.")
    if state_in_place and (not isinstance(initial_state, Tensor) or initial_state.dtype != torch.float32
                           or (torch.is_grad_enabled() and initial_state.requires_grad)):
        raise ValueError(f"state_in_place=True: expected a float32 initial_state outside autograd to overwrite, got "
                         f"{getattr(initial_state, 'dtype', initial_state)!r}. Fix: pass the state (e.g. the "
                         "final state of the previous call) or drop state_in_place.")
    positive_int(chunk_size, "chunk_size", allow_none=True)
    positive_int(recompute_segment, "recompute_segment", allow_none=True)
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, check_gates=check_gates)
    scale = score_scale(scale, q.shape[-1])
    out_dtype = q.dtype
    flags = _nonfinite_tokens(q, k, v, g, beta, gates_read=check_gates)
    if flags is not None:
        q, k, v, g, beta = _zero_nonfinite(q, k, v, g, beta)
    q, k, v, g, beta = prepare(q, k, v, g, beta, scale=scale, qk_l2norm=qk_l2norm)
    state = None if initial_state is None else initial_state.to(q.dtype)
    offsets = None if cu_seqlens is None else cu_seqlens.tolist()
    if offsets is None:
        o, final = _run(q, k, v, g, beta, state, method, chunk_size, recompute_segment, native,
                        state_in_place and state is initial_state)
    else:
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        pieces = zip(*(x.split(lengths, dim=2) for x in (q, k, v, g)),
                     beta.split(lengths, dim=2) if beta is not None else [None] * len(lengths))
        outs, finals = [], []
        for i, (q_s, k_s, v_s, g_s, b_s) in enumerate(pieces):  # split, not slices (see _run)
            o_i, f_i = _run(q_s, k_s, v_s, g_s, b_s, None if state is None else state[i : i + 1], method,
                            chunk_size, recompute_segment, native)
            outs.append(o_i)
            finals.append(f_i)
        o, final = torch.cat(outs, dim=2), torch.cat(finals, dim=0)
    if flags is not None:
        o, final = _poison(o, final, *flags, offsets)
    if state_in_place and final is not initial_state:
        final = initial_state.copy_(final)
    o = o.to(out_dtype)
    return (o, final) if return_state else o


def explain_gated(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None = None, *,
                  method: str = "auto", cu_seqlens: Tensor | None = None, native: bool | None = None) -> str:
    """What :func:`gated_linear_attention` would run for these inputs, in one paragraph (no compute)."""
    check_inputs(q, k, v, g, beta, None, cu_seqlens, check_gates=False)
    rule = rule_name(g, beta)
    T = q.shape[2]
    recurrent = _recurrent(method, T)
    how = "recurrent (token by token)" if recurrent else "chunked"
    dtype = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    groups = v.shape[1] // k.shape[1]
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta))
    why_not = native_reason(q.device, dtype, T, grad, method, native)
    lines = [f"rule: {rule} ({'per-channel' if g.dim() == 4 else 'per-head'} gates, "
             f"{'delta rule' if beta is not None else 'no delta'})",
             f"method: {how}, compute dtype {str(dtype).removeprefix('torch.')}",
             f"heads: {k.shape[1]} key heads" + (f", each shared by {groups} value heads" if groups > 1 else "")]
    what = "the recurrent step" if recurrent else "the chunked kernel"
    if why_not is None:
        lines.append(f"kernel: native gated kernel ({what}, attnkit_gated)")
    else:
        lines.append(f"kernel: PyTorch path (the native gated kernel declines: {why_not})")
    if cu_seqlens is not None:
        lines.append(f"packed: {cu_seqlens.numel() - 1} sequences, state reset at each boundary")
    return "\n".join(lines)
