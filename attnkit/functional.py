"""``attention()``: the one entry point."""

from __future__ import annotations

import torch
from torch import Tensor

from .backends import nonfinite
from .dispatch import resolve, resolve_call
from .inputs import AttentionInputs
from .kv_handle import KVHandle
from .masks import Mask

__all__ = ["attention", "attention_weights"]

_AUTOCAST_FROM = (torch.float32, torch.float16, torch.bfloat16)  # dtypes autocast recasts (not float64)
# Whether autocast is on for any device: one C call, where reading ``q.device.type`` alone costs more.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | None = None,
    q_offset: int | None = None,
    kv_offset: int = 0,
    backend: str = "auto",
    options=None,
    return_lse: bool = False,
    score_mod=None,
    sinks: Tensor | None = None,
    enable_gqa: bool = True,
    kv_finite: bool | None = None,
):
    """Scaled dot-product attention ``softmax(q kᵀ · scale + bias) v`` under a mask.

    Args:
        q: ``(B, Hq, Tq, D)`` queries. k: ``(B, Hkv, Tk, D)`` keys. v: ``(B, Hkv, Tk, Dv)`` values.
            ``Hq % Hkv == 0`` (grouped-query attention: query head ``h`` uses K/V head ``h // (Hq // Hkv)``).
        mask: where attention is allowed (True = attend): a :class:`~attnkit.masks.Mask`
            (``Causal()``, ``SlidingWindow(...)``, ...) or a bool tensor broadcastable to
            ``(B, Hq, Tq, Tk)``. A query row with no allowed key yields 0.
        bias: additive float scores broadcastable to ``(B, Hq, Tq, Tk)`` (at least 2-D; ALiBi,
            relative positions). A float32 bias on float16/bfloat16 inputs is used in float32.
            With a ``score_mod``, its ``-inf`` entries (and those at the dtype's lowest finite value,
            transformers' "masked" fill) are a mask applied after the modifier, like ``mask=``.
        scale: score scale, a finite float; ``None`` means ``D ** -0.5``.
        dropout_p: dropout on the attention weights (pass 0 at evaluation).
        q_offset, kv_offset: absolute position of the first query and key. The default
            ``q_offset = kv_offset + Tk - Tq`` aligns the last query with the last key, so
            ``Causal()`` is right for prefill and for decoding with a cache::

                Tq=2, Tk=5, Causal():  [[1,1,1,1,0],
                                        [1,1,1,1,1]]
        attn_mask, is_causal: ``F.scaled_dot_product_attention``'s arguments, with its semantics, so
            code written for SDPA runs unchanged (positionally too): a bool ``attn_mask`` (True =
            attend) acts as ``mask=``, a float one is added to the scores as ``bias=``.
            ``is_causal=True`` is SDPA's **top-left** causal mask (query ``i`` sees keys ``0..i``,
            i.e. ``mask=Causal()`` with ``q_offset=kv_offset``), unlike ``Causal()``'s bottom-right
            default when ``Tq != Tk``::

                Tq=2, Tk=5, is_causal=True:  [[1,0,0,0,0],
                                              [1,1,0,0,0]]

            As in SDPA, ``is_causal`` together with ``attn_mask`` (or ``mask=``) is an error.
        backend: ``"auto"`` (the first exact backend that can run the input; see :func:`explain`)
            or a backend name; a named backend that cannot run raises ``NoBackendError``.
        options: the named backend's ``Options`` dataclass (tile sizes, features, ...).
        return_lse: also return the log-sum-exp of the masked scores per query row
            ``(B, Hq, Tq)`` in float32 (float64 for float64 inputs; ``-inf`` for fully masked rows).
            With ``sinks`` the sink's term is part of the sum (a fully masked row's LSE is its sink).
        score_mod: a :class:`~attnkit.score_mods.ScoreMod` (``SoftCap(c)``, ``ALiBi(slopes)``,
            ``RelativeBias(table)``, ``CustomScoreMod(fn)``), a list of them applied in order, or a
            callable ``fn(score, b, h, q_idx, kv_idx)`` over absolute positions; applied after
            ``scale`` and the finite part of ``bias`` (or a float ``attn_mask``), before the mask::

                softmax(where(keep, score_mod(q kᵀ · scale + bias), -inf))
        sinks: ``(Hq,)`` float logits, one per query head (gpt-oss): each joins its rows' softmax
            normaliser and contributes no value, so rows can attend "nothing"; learnable.
        enable_gqa: accepted for SDPA compatibility; grouped K/V heads are always supported.
        kv_finite: ``True`` vouches that every entry of ``k`` and ``v`` is finite (a KV cache that
            checks each token as it is written), so the call skips its finiteness scan of K/V.
            ``None`` (default): K/V are scanned (one read each). Passing True for K/V that
            do hold NaN/Inf voids the guarantee below for the rows that may not see them.

    K/V from a KV cache: ``k`` and ``v`` may both be the :class:`~attnkit.kv_handle.KVHandle` an int8
    or paged cache's ``update()`` returns. Backends that declare its format read it in place (the
    ``decode`` backend); otherwise it is converted to contiguous K/V first (``explain()`` says
    which). Row ``b`` of a handle holds ``lengths[b]`` keys at positions ``0 ..``; its queries are
    its last ``Tq`` positions, and mask, bias, score modifiers and sinks apply at those positions
    even when rows hold different lengths.

    NaN and Inf (every backend):
        NaN in what a query row may attend — its query, or the key, value or bias entry of a key
        it may see — makes that row NaN; an Inf there gives what IEEE arithmetic gives (NaN,
        ±Inf, or weight 0 for a key whose score is -Inf). NaN/Inf in what a row may not see
        (masked keys, keys only later queries see, padding) changes nothing in that row, and a
        row with no allowed key is 0 whatever its inputs hold. ``scale`` NaN/±Inf is refused.
        The native prefill and decode kernels keep this inside the kernel, at no extra read; other
        backends' finite inputs pay one read-only scan of q, K and V (see
        :mod:`attnkit.backends.nonfinite`); only a call whose inputs hold NaN/Inf takes the slow path.

    Returns:
        ``out (B, Hq, Tq, Dv)`` in q's dtype, or ``(out, lse)`` with ``return_lse=True``.

    Under ``torch.autocast`` every backend behaves alike, as ``F.scaled_dot_product_attention`` does
    for q, k, v: they are cast to the autocast dtype first and the output has that dtype; the backend
    runs with autocast off, so its softmax statistics and a float32 ``bias`` keep full precision.
    """
    if enable_gqa is not True and not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa: expected True or False, got {type(enable_gqa).__name__} {enable_gqa!r}.")
    if (_any_autocast() and isinstance(q, Tensor) and q.dtype in _AUTOCAST_FROM
            and torch.is_autocast_enabled(q.device.type)):
        dtype = torch.get_autocast_dtype(q.device.type)
        cast = lambda t: t if t.dtype == dtype else t.to(dtype)  # noqa: E731
        with torch.autocast(q.device.type, enabled=False):
            return attention(
                cast(q), cast(k), cast(v), attn_mask, dropout_p, is_causal, scale, mask=mask, bias=bias,
                q_offset=q_offset, kv_offset=kv_offset, backend=backend, options=options, return_lse=return_lse,
                score_mod=score_mod, sinks=sinks, kv_finite=kv_finite,
            )
    if type(k) is KVHandle and k.ragged and score_mod is not None:
        return _ragged_rows(q, k, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p, backend=backend,
                            options=options, return_lse=return_lse, score_mod=score_mod, sinks=sinks,
                            kv_finite=kv_finite)
    if attn_mask is None and is_causal is False and bias is None:
        # the common call: validation and selection cached per call class (dispatch.resolve_call)
        impl, inp, host = resolve_call(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite,
                                       backend, score_mod, sinks)
    else:
        inp = AttentionInputs.create(
            q, k, v, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p, q_offset=q_offset,
            kv_offset=kv_offset, return_lse=return_lse, attn_mask=attn_mask, is_causal=is_causal,
            score_mod=score_mod, sinks=sinks, kv_finite=kv_finite,
        )
        impl, inp = resolve(inp, backend)
        host = None
    if options is not None:
        options = impl.check_options(options)
    return nonfinite.run(impl, inp, options, host)


def _ragged_rows(q: Tensor, handle: KVHandle, *, mask, bias, return_lse, **kwargs):
    """Score modifiers read absolute positions, which differ per row when a cache's rows hold
    different lengths: each group of equal-length rows is attended at its own offsets (the mask
    evaluated at each row's positions first, as for any ragged call)."""
    from .masks import as_mask

    keep = handle.row_keep(None if mask is None else as_mask(mask, "mask"), q.shape[2])  # (B, H|1, Tq, Tk)
    groups: dict[int, list[int]] = {}
    for row, L in enumerate(handle.lengths):
        groups.setdefault(L, []).append(row)
    outs, lses, order = [], [], []
    for L, rows in groups.items():
        idx = torch.tensor(rows, device=q.device)
        sub = handle.rows(rows)
        m = None if keep is None else keep.index_select(0, idx)[..., :L]
        b = bias if bias is None or bias.dim() < 4 or bias.shape[0] == 1 else bias.index_select(0, idx)
        b = b if b is None else b[..., :L]
        result = attention(q.index_select(0, idx), sub, sub, mask=m, bias=b, return_lse=return_lse, **kwargs)
        outs.append(result[0] if return_lse else result)
        lses.append(result[1] if return_lse else None)
        order += rows
    inverse = torch.empty(len(order), dtype=torch.long, device=q.device)
    inverse[torch.tensor(order, device=q.device)] = torch.arange(len(order), device=q.device)
    out = torch.cat(outs).index_select(0, inverse)
    return (out, torch.cat(lses).index_select(0, inverse)) if return_lse else out


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    q_offset: int | None = None,
    kv_offset: int = 0,
    score_mod=None,
    sinks: Tensor | None = None,
) -> Tensor:
    """The attention probabilities ``(B, Hq, Tq, Tk)`` (rows sum to 1, fully masked rows are 0;
    with ``sinks`` a row sums to ``1 - p(sink)`` < 1, as gpt-oss's eager weights), computed by the
    naive backend in float32 (float64 for float64 inputs). Same arguments as :func:`attention`,
    without ``v``."""
    from .backends.naive import NaiveBackend, NaiveOptions

    v = k[..., :1]  # a stand-in: the weights do not depend on v
    inp = AttentionInputs.create(q, k, v, mask=mask, bias=bias, scale=scale, q_offset=q_offset, kv_offset=kv_offset,
                                 score_mod=score_mod, sinks=sinks)
    # Through the NaN/Inf policy like attention(): rows that may attend a NaN/Inf key are NaN.
    return nonfinite.run(NaiveBackend, inp, NaiveOptions(return_weights=True))[-1]
