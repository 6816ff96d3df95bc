"""``attention()``: the one entry point."""

from __future__ import annotations

from dataclasses import fields

import torch
from torch import Tensor

from .dispatch import select
from .inputs import AttentionInputs
from .masks import Mask

__all__ = ["attention", "attention_weights"]

_AUTOCAST_FROM = (torch.float32, torch.float16, torch.bfloat16)  # dtypes autocast recasts (not float64)


def _check_options(impl, options):
    if options is None:
        return None
    if impl.Options is None:
        raise TypeError(
            f"options: backend {impl.name!r} takes no options, got {type(options).__name__}. Fix: drop options= "
            "or name the backend the options belong to."
        )
    if not isinstance(options, impl.Options):
        raise TypeError(
            f"options: backend {impl.name!r} takes {impl.Options.__name__}, got {type(options).__name__}. "
            f"Fix: pass {impl.Options.__name__}({', '.join(f.name + '=...' for f in fields(impl.Options))})."
        )
    return options


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    q_offset: int | None = None,
    kv_offset: int = 0,
    backend: str = "auto",
    options=None,
    return_lse: bool = False,
    score_mod=None,
    sinks: Tensor | None = None,
):
    """Scaled dot-product attention ``softmax(q kᵀ · scale + bias) v`` under a mask.

    Args:
        q: ``(B, Hq, Tq, D)`` queries. k: ``(B, Hkv, Tk, D)`` keys. v: ``(B, Hkv, Tk, Dv)`` values.
            ``Hq % Hkv == 0`` (grouped-query attention: query head ``h`` uses K/V head ``h // (Hq // Hkv)``).
        mask: where attention is allowed (True = attend): a :class:`~attnkit.masks.Mask`
            (``Causal()``, ``SlidingWindow(...)``, ...) or a bool tensor broadcastable to
            ``(B, Hq, Tq, Tk)``. A query row with no allowed key yields 0.
        bias: additive float scores broadcastable to ``(B, Hq, Tq, Tk)`` (ALiBi, relative positions).
        scale: score scale; ``None`` means ``D ** -0.5``.
        dropout_p: dropout on the attention weights (pass 0 at evaluation).
        q_offset, kv_offset: absolute position of the first query and key. The default
            ``q_offset = kv_offset + Tk - Tq`` aligns the last query with the last key, so
            ``Causal()`` is right for prefill and for decoding with a cache::

                Tq=2, Tk=5, Causal():  [[1,1,1,1,0],
                                        [1,1,1,1,1]]
        backend: ``"auto"`` (the first exact backend that can run the input; see :func:`explain`)
            or a backend name; a named backend that cannot run raises ``NoBackendError``.
        options: the named backend's ``Options`` dataclass (tile sizes, features, ...).
        return_lse: also return the log-sum-exp of the masked scores per query row
            ``(B, Hq, Tq)`` in float32 (float64 for float64 inputs; ``-inf`` for fully masked rows).
            With ``sinks`` the sink's term is part of the sum (a fully masked row's LSE is its sink).
        score_mod: a :class:`~attnkit.score_mods.ScoreMod` (``SoftCap(c)``, ``ALiBi(slopes)``,
            ``RelativeBias(table)``, ``CustomScoreMod(fn)``), a list of them applied in order, or a
            callable ``fn(score, b, h, q_idx, kv_idx)`` over absolute positions; applied after
            ``scale`` and ``bias``, before the mask.
        sinks: ``(Hq,)`` float logits, one per query head (gpt-oss): each joins its rows' softmax
            normaliser and contributes no value, so rows can attend "nothing"; learnable.

    Returns:
        ``out (B, Hq, Tq, Dv)`` in q's dtype, or ``(out, lse)`` with ``return_lse=True``.

    Under ``torch.autocast`` every backend behaves alike, as ``F.scaled_dot_product_attention`` does
    for q, k, v: they are cast to the autocast dtype first and the output has that dtype; the backend
    runs with autocast off, so its softmax statistics and a float32 ``bias`` keep full precision.
    """
    if isinstance(q, Tensor) and q.dtype in _AUTOCAST_FROM and torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        cast = lambda t: t if t.dtype == dtype else t.to(dtype)  # noqa: E731
        with torch.autocast(q.device.type, enabled=False):
            return attention(
                cast(q), cast(k), cast(v), mask=mask, bias=bias, scale=scale, dropout_p=dropout_p,
                q_offset=q_offset, kv_offset=kv_offset, backend=backend, options=options, return_lse=return_lse,
                score_mod=score_mod, sinks=sinks,
            )
    inp = AttentionInputs.create(
        q, k, v, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p, q_offset=q_offset,
        kv_offset=kv_offset, return_lse=return_lse, score_mod=score_mod, sinks=sinks,
    )
    impl = select(inp, backend)
    options = _check_options(impl, options)
    return impl.forward(inp, options)


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    q_offset: int | None = None,
    kv_offset: int = 0,
) -> Tensor:
    """The attention probabilities ``(B, Hq, Tq, Tk)`` (rows sum to 1, fully masked rows are 0),
    computed by the naive backend. Same arguments as :func:`attention`, without ``v``."""
    from .backends.naive import probabilities

    v = k[..., :1]  # a stand-in: the weights do not depend on v
    inp = AttentionInputs.create(q, k, v, mask=mask, bias=bias, scale=scale, q_offset=q_offset, kv_offset=kv_offset)
    keep = inp.materialize_mask()
    k, _ = inp.kv_for(keep, *inp.expand_kv())
    return probabilities(inp, k, keep)[0].to(inp.dtype)
