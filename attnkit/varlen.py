"""``varlen_attention()``: packed variable-length sequences, flash-attn's ``flash_attn_varlen_func`` layout.

Sequences are concatenated along the token axis, without padding: ``q (total_q, Hq, D)`` holds
sequence ``i`` at rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1``, and likewise ``k``/``v`` with
``cu_seqlens_k``. Each query attends only the keys of its own sequence, under ``mask`` read in
that sequence's own positions, with the last query aligned to the last key (bottom-right, as
flash-attn): for a sequence with 2 queries and 5 keys, ``Causal()`` keeps::

    ████·
    █████

The call is one :func:`attnkit.attention` over the packed stream, so every exact backend, the
dispatcher and ``explain`` see it as they see any call: with one ``cu_seqlens`` for queries and keys
(self-attention over packed sequences, the training case) it is ``Document(ids) & mask``, whose tiles
across two sequences the tiled and native kernels skip; with different query and key offsets it is a
mask evaluated from the offsets.

A sequence may be empty on either side, as in flash-attn's layout: one without keys gives its queries
zero rows (LSE ``-inf``, or the sink's logit with ``sinks``) and zero gradients, one without queries
gives no rows, and so does a call whose whole query or key stream is empty.

Built-in score modifiers (``SoftCap``, ``ALiBi``, ``RelativeBias`` and chains of them) reach the backend as
themselves, so the native kernel runs them: within one sequence a packed distance is that sequence's
own. With different query and key offsets, ALiBi and relative biases run with each sequence in a slot of
``max(len_q, len_k)`` positions on both sides (queries and keys right-aligned, the padding masked), where
that holds again; this reads the offsets on the host, so on another device or under ``torch.compile``
they are evaluated at each sequence's positions as any other callable is (a ``CustomScoreMod``, which
backends that call Python score functions run).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._validate import check_int_at_least
from .functional import attention
from .masks import UNBOUNDED, Causal, Custom, Document, Mask, Padding, as_mask
from .score_mods import CustomScoreMod, as_score_mod

__all__ = ["varlen_attention", "seq_ids", "check_packed_offsets", "packed_positions"]


def seq_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """``(total,)`` long: the sequence index of every packed token (no host read: the output size is given)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths,
                                   output_size=total)


def packed_positions(cu_seqlens: Tensor, total: int, start: Tensor | None = None) -> Tensor:
    """``(total,)`` long: each packed token's position in its own sequence, plus ``start[i]`` (the
    tokens sequence ``i`` already holds, e.g. in a KV cache) when given."""
    sq = seq_ids(cu_seqlens, total)
    pos = torch.arange(total, device=cu_seqlens.device) - cu_seqlens[:-1].long()[sq]
    return pos if start is None else pos + start.to(pos.device)[sq]


def _check_cu(cu: Tensor, total: int, name: str) -> None:
    if not isinstance(cu, Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 2:
        raise TypeError(f"{name}: expected a 1-D int32/int64 tensor of offsets [0, len_0, len_0+len_1, ..., total], "
                        f"got {getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}.")
    if cu.device.type != "cpu" or torch.compiler.is_compiling():
        return  # values are read on the host only where that costs no device stall and no graph break
    check_packed_offsets(cu, total, name)


def check_packed_offsets(cu: Tensor, total: int, name: str = "cu_seqlens") -> list[int]:
    """The sequence lengths of offsets ``cu`` over ``total`` packed tokens, read on the host, or a
    ``TypeError``/``ValueError`` naming ``name`` that says what is wrong and how to build them."""
    if not isinstance(cu, Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 2:
        _check_cu(cu, total, name)  # raises
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets from 0 to the packed length {total}, got "
                         f"{values[:8]}{' ...' if len(values) > 8 else ''}. Fix: cu_seqlens = "
                         "torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).")
    return [b - a for a, b in zip(values, values[1:])]


def _check_packed(x: Tensor, name: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"{name}: expected a packed (total_tokens, H, D) tensor, got "
                         f"{tuple(getattr(x, 'shape', ()))}. Fix: concatenate the sequences along the token axis "
                         "(flash-attn's varlen layout), or call attnkit.attention for (B, H, T, D).")


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """The checks whose ``attention()`` message would name a dimension of its ``(B, H, T, D)`` layout,
    made here in the packed ``(total_tokens, H, D)`` one."""
    if v.shape[0] != k.shape[0] or v.shape[1] != k.shape[1]:
        raise ValueError(f"v: expected shape (total_k, Hkv, Dv) with total_k={k.shape[0]}, Hkv={k.shape[1]} like k, "
                         f"got {tuple(v.shape)}. Fix: pack v's tokens and heads as k's.")
    for name, size in (("D (q.shape[2])", q.shape[2]), ("D (k.shape[2])", k.shape[2]),
                       ("Dv (v.shape[2])", v.shape[2])):
        if size == 0:
            raise ValueError(f"{name}: expected a head dim of at least 1, got 0. Fix: give every head >= 1 feature.")


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    mask: Mask | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    score_mod=None,
    sinks: Tensor | None = None,
    backend: str = "auto",
    options=None,
    return_lse: bool = False,
):
    """Attention over packed sequences of different lengths, each on its own.

    Args:
        q: ``(total_q, Hq, D)``; k: ``(total_k, Hkv, D)``; v: ``(total_k, Hkv, Dv)`` (``Hq % Hkv == 0``).
        cu_seqlens_q, cu_seqlens_k: ``(N+1,)`` int32/int64 offsets ``[0, len_0, len_0+len_1, ..., total]``.
            Pass the *same* tensor for both in packed self-attention: that call is the fast one.
        max_seqlen_q, max_seqlen_k: accepted for flash-attn compatibility (ints); the call does not
            need them and reads ``cu_seqlens`` on the host only for validation, on the CPU, outside
            ``torch.compile``.
        mask: a per-sequence mask made of band masks (``Causal()``, ``SlidingWindow(left, right)``,
            and ``&``/``|`` of them), in each sequence's own positions, bottom-right aligned.
            ``causal=True`` is flash-attn's spelling of ``mask=Causal()``.
        scale, dropout_p, score_mod, sinks, backend, options: as in :func:`attnkit.attention`; a score
            modifier sees each sequence's own positions (ALiBi and relative biases restart per sequence);
            the built-in ones run on every backend that takes them in ``attention()``, native included.
        return_lse: also return the log-sum-exp ``(Hq, total_q)`` in float32 (flash-attn's layout).

    Returns:
        ``out (total_q, Hq, Dv)``, or ``(out, lse)``. A query whose sequence has no keys gets a zero row
        and LSE ``-inf`` (zero gradients); either stream may be empty (``total_q`` or ``total_k`` 0).
    """
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_packed(x, name)
    _check_shapes(q, k, v)
    _check_cu(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    _check_cu(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    check_int_at_least("max_seqlen_q", max_seqlen_q, 0, allow_none=True)  # the longest sequence
    check_int_at_least("max_seqlen_k", max_seqlen_k, 0, allow_none=True)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel() - 1} sequences, cu_seqlens_k "
                         f"{cu_seqlens_k.numel() - 1}. Fix: one offset list per side over the same sequences.")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {type(causal).__name__} {causal!r}.")
    if causal and mask is not None:
        raise ValueError("causal=True together with mask=: give one of them (causal=True means mask=Causal()).")
    if causal:
        mask = Causal()
    if mask is not None:
        mask = as_mask(mask)
        if not isinstance(mask, Mask) or any(leaf.band() == UNBOUNDED for leaf in mask.leaves()):
            raise ValueError(f"mask: varlen_attention reads the mask in each sequence's own positions, so it must be "
                             f"made of band masks (Causal(), SlidingWindow(left, right), & and | of them); got "
                             f"{mask!r}. Fix: per-sequence padding needs no mask here (each sequence has its own "
                             "length); for anything else call attnkit.attention with a Document mask.")
    total_q = q.shape[0]
    same = cu_seqlens_q is cu_seqlens_k or (
        total_q == k.shape[0] and cu_seqlens_q.device.type == "cpu" and not torch.compiler.is_compiling()
        and torch.equal(cu_seqlens_q, cu_seqlens_k))
    if total_q == 0 or k.shape[0] == 0:
        # attention() takes at least one query and one key: a zero token in a sequence of its own
        # (no real query sees it; its output row is dropped), so the call stays one call on any backend.
        add_q, add_k = int(total_q == 0), int(k.shape[0] == 0)
        q, cu_q = _append_zero_token(q, cu_seqlens_q, add_q)
        k, cu_seqlens_k = _append_zero_token(k, cu_seqlens_k, add_k)
        v, _ = _append_zero_token(v, cu_seqlens_k, add_k)
        cu_seqlens_q = cu_seqlens_k if same else cu_q
    inner = None if score_mod is None else as_score_mod(score_mod)
    native_mod = inner is not None and "custom" not in inner.kinds()  # ScoreModTerms a kernel reads as data
    q_rows = valid_k = None
    if (native_mod and not same and inner.kinds() & _DISTANCE_KINDS and cu_seqlens_q.device.type == "cpu"
            and cu_seqlens_k.device.type == "cpu" and not torch.compiler.is_compiling()):
        # Distances differ from packed ones by a shift per sequence: in common slots they do not.
        q, k, v, cu_seqlens_q, q_rows, valid_k = _common_slots(q, k, v, cu_seqlens_q, cu_seqlens_k)
        cu_seqlens_k, same = cu_seqlens_q, True
    qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, total, D)
    sq = seq_ids(cu_seqlens_q, q.shape[0])
    sk = sq if same else seq_ids(cu_seqlens_k, k.shape[0])
    # Each sequence's own positions, as attention() would give them: keys 0..len_k-1, queries
    # bottom-right aligned (the last query at the last key).
    pos_k = torch.arange(k.shape[0], device=sk.device) - cu_seqlens_k[:-1][sk]
    lengths_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    pos_q = torch.arange(q.shape[0], device=sq.device) - cu_seqlens_q[1:][sq] + lengths_k[sq]
    if same:
        # One coordinate system: a band within one document is the band of its own sequence, and
        # Document's tiles across two sequences are skipped by the tiled and native kernels.
        full = Document(sq)
        if valid_k is not None:
            full = full & Padding(valid_k[None])
        full = full if mask is None else full & mask
    else:
        def keep(b, h, qi, ki):
            inside = sq[qi] == sk[ki]
            return inside if mask is None else inside & mask.mask_mod(b, h, pos_q[qi], pos_k[ki])

        full = Custom(keep, name="packed sequences")
    mod = None
    if inner is not None and native_mod and (same or not inner.kinds() & _DISTANCE_KINDS):
        mod = inner  # within one sequence, packed distances are the sequence's own: every backend runs it as is
    elif inner is not None:
        mod = CustomScoreMod(lambda s, b, h, qi, ki: inner.apply(s, b, h, pos_q[qi], pos_k[ki]),
                             name=f"per-sequence {inner!r}", params=tuple(inner.parameters()))
    result = attention(qb, kb, vb, mask=full, q_offset=0, kv_offset=0, scale=scale, dropout_p=dropout_p,
                       score_mod=mod, sinks=sinks, backend=backend, options=options, return_lse=return_lse)
    out, lse = result if return_lse else (result, None)
    out = out.squeeze(0).transpose(0, 1)  # (total_q, Hq, Dv)
    if q_rows is not None:
        out, lse = out.index_select(0, q_rows), None if lse is None else lse.index_select(2, q_rows)
    elif out.shape[0] != total_q:
        out, lse = out[:total_q], None if lse is None else lse[..., :total_q]
    return (out, lse.squeeze(0)) if return_lse else out


#: ScoreModTerm kinds that read positions (through their distance only).
_DISTANCE_KINDS = frozenset({"alibi", "relative_bias"})


def _append_zero_token(x: Tensor, cu: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``x`` with ``n`` (0 or 1) zero tokens appended as a sequence of their own, and its offsets."""
    return (torch.cat([x, x.new_zeros(n, *x.shape[1:])]) if n else x), torch.cat([cu, cu[-1:] + n])


def _common_slots(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor):
    """Packed cross-attention laid out as packed self-attention: sequence ``i`` gets a slot of
    ``max(len_q, len_k)`` positions in both streams, its queries and keys right-aligned in it (so
    a query's distance to a key is the one in its own sequence, bottom-right) and zeros elsewhere.
    Returns ``q, k, v`` so placed, the slots' offsets, the slot row of each query and the ``(T,)``
    bool of the real keys."""
    slot = torch.maximum(cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]).long()
    cu = torch.nn.functional.pad(slot.cumsum(0), (1, 0))
    total = int(cu[-1])
    sq, sk = seq_ids(cu_q, q.shape[0]), seq_ids(cu_k, k.shape[0])
    q_rows = torch.arange(q.shape[0]) - cu_q[1:].long()[sq] + cu[1:][sq]
    k_rows = torch.arange(k.shape[0]) - cu_k[1:].long()[sk] + cu[1:][sk]

    def place(x, rows):
        return x.new_zeros(total, *x.shape[1:]).index_copy(0, rows, x)

    valid = torch.zeros(total, dtype=torch.bool).index_fill_(0, k_rows, True)
    return place(q, q_rows), place(k, k_rows), place(v, k_rows), cu, q_rows, valid
