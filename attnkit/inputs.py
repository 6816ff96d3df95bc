"""AttentionInputs: one validated, immutable description of an attention call.

``attention()`` validates its arguments once, here; backends and dispatch read the derived
properties (shapes, dtype, whether gradients are needed) and never re-check them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._validate import broadcast_shapes, check_int, score_scale
from .kv_handle import KVHandle
from .masks import Mask, as_mask
from .score_mods import ScoreMod, as_score_mod, check_sinks

__all__ = ["AttentionInputs", "FLOAT_DTYPES", "split_additive_mask"]

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_INF = float("inf")


def _sdpa_arguments(attn_mask, is_causal, mask, bias, q_offset, kv_offset):
    """``F.scaled_dot_product_attention``'s ``attn_mask``/``is_causal`` as attnkit's ``mask``/``bias``
    (and offsets): a bool ``attn_mask`` (True = attend) is a ``Dense`` mask, a float one an additive
    bias; ``is_causal=True`` is SDPA's top-left causal mask: query ``i`` sees keys ``0..i``."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected True or False, got {type(is_causal).__name__} {is_causal!r}.")
    if is_causal and attn_mask is not None:
        raise ValueError("is_causal=True with attn_mask: expected one of them (as in "
                         "F.scaled_dot_product_attention). Fix: fold the causal mask into attn_mask, or pass "
                         "mask=Causal() & Dense(keep).")
    if is_causal:
        if mask is not None:
            raise ValueError(f"is_causal=True with mask={mask!r}: expected one of them. Fix: pass mask=Causal() & ... "
                             "to combine masks.")
        if q_offset is not None and q_offset != kv_offset:
            raise ValueError(
                f"is_causal=True is top-left aligned (query i sees keys 0..i, as in SDPA), but q_offset={q_offset} "
                f"differs from kv_offset={kv_offset}. Fix: for other alignments pass mask=Causal() with q_offset=."
            )
        from .masks import Causal

        return Causal(), bias, kv_offset, kv_offset
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask: expected a bool or float tensor (as in F.scaled_dot_product_attention), "
                        f"got {type(attn_mask).__name__}.")
    if attn_mask.dtype == torch.bool:
        if mask is not None:
            raise ValueError(f"attn_mask (bool) with mask={mask!r}: expected one of them. Fix: combine them as "
                             "mask=Dense(attn_mask) & ...")
        return attn_mask, bias, q_offset, kv_offset
    if attn_mask.is_floating_point():
        if bias is not None:
            raise ValueError("attn_mask (float, additive) with bias=: expected one of them. "
                             "Fix: pass bias=attn_mask + bias.")
        return mask, attn_mask, q_offset, kv_offset
    raise TypeError(f"attn_mask: expected dtype torch.bool (True = attend) or a float dtype (added to the scores), "
                    f"got {attn_mask.dtype}.")


def split_additive_mask(bias: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """An additive float mask as ``(keep, finite)``: ``keep`` (bool, True = attend) is False where
    ``bias`` is ``-inf`` or the dtype's lowest finite value (the fill transformers and others use for
    "masked"), ``finite`` is ``bias`` with those entries 0. Either is None when it would change
    nothing (everything kept; no nonzero finite entry). ``softmax(s + bias)`` equals
    ``softmax(s + finite)`` under ``keep``; the split lets a score modifier run between the two,
    so a masked key stays masked (soft-capping ``-inf`` would give ``-cap``, a finite score)."""
    keep = ~(bias <= torch.finfo(bias.dtype).min)  # NaN stays in ``finite``: it must still poison its row
    finite = torch.where(keep, bias, torch.zeros((), dtype=bias.dtype, device=bias.device))
    return (None if bool(keep.all()) else keep), (finite if bool(finite.any()) else None)


def _check_tensor(name: str, x, expected: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape {expected}, got {type(x).__name__}.")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}. "
            f"Fix: convert with {name}.float()."
        )
    if x.dim() != 4:
        raise ValueError(
            f"{name}: expected 4 dims {expected}, got shape {tuple(x.shape)}. "
            "Fix: attnkit uses (batch, heads, length, head_dim); from (B, T, H, D) use .transpose(1, 2)."
        )


def _read_handle(q, k, v, mask, q_offset, kv_offset, score_mod, kv_finite):
    """Check a :class:`KVHandle` passed as ``k`` and ``v``; for ragged rows (continuous batching)
    turn ``mask`` into the per-row keep it means at each row's positions."""
    if not (type(k) is KVHandle and (v is k or v is None)):
        raise TypeError(f"k, v: a KV cache handle goes in as both k and v (attention(q, h, h), as a cache's "
                        f"update() returns it), got k {type(k).__name__} and v {type(v).__name__}.")
    if kv_offset != 0:
        raise ValueError(f"kv_offset: a KV cache handle holds every key from position 0, got kv_offset={kv_offset}.")
    if k.ragged:
        if q_offset is not None:
            raise ValueError(f"q_offset: the rows of this cache hold different lengths {list(k.lengths)}, so each "
                             f"row's queries sit at its own positions; got q_offset={q_offset}. Fix: pass None.")
        if score_mod is not None:
            raise ValueError("score_mod: with rows of different lengths attention() evaluates score modifiers per "
                             "group of equal lengths; AttentionInputs cannot. Fix: call attention().")
        mask = k.row_mask(None if mask is None else as_mask(mask, "mask"), q.shape[2])
    if kv_finite is None:
        kv_finite = k.finite
    return k, k, mask, kv_finite


class _derived:
    """``functools.cached_property`` without its lock: Python 3.11's takes an ``RLock``, which
    ``torch.compile`` cannot trace (every backend's read of ``inp.Tq`` became a graph break)."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@dataclass(frozen=True, eq=False)
class AttentionInputs:
    """Validated attention arguments. Shapes: q ``(B, Hq, Tq, D)``, k ``(B, Hkv, Tk, D)``,
    v ``(B, Hkv, Tk, Dv)``; ``bias`` broadcastable to ``(B, Hq, Tq, Tk)``.

    Queries sit at absolute positions ``q_offset .. q_offset+Tq-1`` and keys at
    ``kv_offset .. kv_offset+Tk-1``."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Mask | None
    bias: Tensor | None
    scale: float
    dropout_p: float
    q_offset: int
    kv_offset: int
    return_lse: bool
    #: A :class:`~attnkit.score_mods.ScoreMod` applied to the scores before masking, or None.
    score_mod: ScoreMod | None = None
    #: Per-head sink logits ``(Hq,)`` joining each row's softmax normaliser, or None.
    sinks: Tensor | None = None
    #: True when the caller knows every K/V entry read is finite (a KV cache checks each token as
    #: it is written), so the NaN/Inf policy need not look; None: unknown.
    kv_finite: bool | None = None
    #: How K/V are stored: ``"dense"`` (tensors) or a :class:`~attnkit.kv_handle.KVHandle` format
    #: (``k`` and ``v`` are then that handle).
    kv_format: str = "dense"

    @classmethod
    def create(
        cls,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask=None,
        bias: Tensor | None = None,
        scale: float | None = None,
        dropout_p: float = 0.0,
        q_offset: int | None = None,
        kv_offset: int = 0,
        return_lse: bool = False,
        score_mod=None,
        sinks: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        kv_finite: bool | None = None,
    ) -> AttentionInputs:
        """Validate the arguments of ``attention()`` and fill in defaults (``attn_mask``/``is_causal``
        are SDPA's spellings, turned into ``mask``/``bias`` here)."""
        if attn_mask is not None or is_causal is not False:
            mask, bias, q_offset, kv_offset = _sdpa_arguments(attn_mask, is_causal, mask, bias, q_offset, kv_offset)
        kv_format = "dense"
        if type(k) is KVHandle or type(v) is KVHandle:
            k, v, mask, kv_finite = _read_handle(q, k, v, mask, q_offset, kv_offset, score_mod, kv_finite)
            kv_format = k.format
        # attention() runs per layer per token: read each tensor attribute once, and spell out what
        # was wrong only when the quick check fails.
        try:
            B, Hq, Tq, D = q.shape
            Bk, Hkv, Tk, Dk = k.shape
            Bv, Hv, Tv, Dv = v.shape if kv_format == "dense" else (Bk, Hkv, Tk, v.value_dim)
            dtype = q.dtype
            well_typed = dtype in FLOAT_DTYPES and k.dtype is dtype and v.dtype is dtype and isinstance(q, Tensor)
        except (AttributeError, TypeError, ValueError):
            well_typed = False
        if not well_typed:
            if kv_format != "dense":
                _check_tensor("q", q, "(B, Hq, Tq, D)")
                raise TypeError(f"q: expected the dtype of the cached keys, {k.dtype}, got {q.dtype}. "
                                f"Fix: decode in the dtype the cache was filled with (q.to({k.dtype})).")
            _check_tensor("q", q, "(B, Hq, Tq, D)")
            _check_tensor("k", k, "(B, Hkv, Tk, D)")
            _check_tensor("v", v, "(B, Hkv, Tk, Dv)")
            raise TypeError(
                f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}. Fix: cast them to one dtype."
            )
        device = q.device
        if k.device != device or v.device != device:
            raise ValueError(
                f"q, k, v: expected one device, got q on {q.device}, k on {k.device}, v on {v.device}. "
                "Fix: move them with .to(q.device)."
            )
        if Bk != B or Bv != B:
            raise ValueError(
                f"batch size: q has {B}, k has {Bk}, v has {Bv}; expected one batch size. "
                "Fix: broadcast with .expand() before the call."
            )
        if Dk != D:
            raise ValueError(f"head dim: q has D={D} but k has D={Dk}; expected q and k to share the head dim. "
                "Fix: project q and k to the same width (v may differ).")
        if Hv != Hkv or Tv != Tk:
            raise ValueError(
                f"v: expected shape (B, Hkv, Tk, Dv) with Hkv={Hkv}, Tk={Tk} like k, got {tuple(v.shape)}."
            )
        if Hkv == 0 or Hq % Hkv != 0:
            raise ValueError(
                f"heads: q has Hq={Hq} heads, k/v have Hkv={Hkv}; grouped-query attention needs Hq % Hkv == 0. "
                f"Fix: use a number of key/value heads that divides {Hq}."
            )
        if not (Tq and Tk and D and Dv):
            for name, size in (("Tq (q.shape[2])", Tq), ("Tk (k.shape[2])", Tk), ("D (q.shape[3])", D),
                               ("Dv (v.shape[3])", Dv)):
                if size == 0:
                    raise ValueError(f"{name}: expected at least 1, got 0. Fix: skip the call for empty inputs.")
        if scale is None:
            scale = D**-0.5
        elif type(scale) is not float or not -_INF < scale < _INF:
            scale = score_scale(scale, D)
        if dropout_p != 0.0 or type(dropout_p) is not float:
            if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
                raise TypeError(f"dropout_p: expected a float in [0, 1), got {type(dropout_p).__name__}.")
            if not 0.0 <= dropout_p < 1.0:
                raise ValueError(f"dropout_p: expected a value in [0, 1), got {dropout_p}. "
                                 "Fix: use 0.0 for no dropout.")
            dropout_p = float(dropout_p)
        if type(kv_offset) is not int or kv_offset < 0:
            check_int("kv_offset", kv_offset, minimum=0)
        if q_offset is None:
            q_offset = kv_offset + Tk - Tq  # bottom-right: the last query sees the last key
        else:
            # The default may be negative (Tq > Tk: the first Tq - Tk queries precede every key
            # and a causal mask hides all keys from them); an explicit offset is a position.
            check_int("q_offset", q_offset, minimum=0)
        if return_lse is not False and return_lse is not True:
            raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}.")
        if mask is not None:
            if not isinstance(mask, Mask):
                mask = as_mask(mask, "mask")
            mask.validate(B, Hq, Tq, Tk, q_offset, kv_offset)
        if bias is not None:
            if not isinstance(bias, Tensor):
                raise TypeError("bias: expected a float tensor broadcastable to (B, Hq, Tq, Tk), "
                                f"got {type(bias).__name__}.")
            if not bias.is_floating_point():
                raise TypeError(
                    f"bias: expected a floating dtype (an additive score bias), got {bias.dtype}. "
                    "Fix: boolean masks go to mask=, not bias=."
                )
            if bias.device != device:
                raise ValueError(f"bias: expected device {device} like q, got {bias.device}.")
            if bias.dim() < 2:
                # SDPA documents attn_mask as (..., Tq, Tk); a 1-D (Tk,) or 0-D bias is ambiguous to
                # read and not what SDPA accepts, so it is refused rather than guessed.
                raise ValueError(
                    "bias: expected at least 2 dims (Tq, Tk) broadcastable to (B, Hq, Tq, Tk) = "
                    f"({B}, {Hq}, {Tq}, {Tk}), got shape {tuple(bias.shape)}. "
                    "Fix: a per-key bias is bias.view(1, 1, 1, Tk); "
                    "a constant changes nothing under softmax (drop it)."
                )
            try:
                shape = broadcast_shapes(bias.shape, (B, Hq, Tq, Tk))
            except RuntimeError:
                shape = None
            if shape != (B, Hq, Tq, Tk) or bias.dim() > 4:
                raise ValueError(
                    f"bias: shape {tuple(bias.shape)} does not broadcast to (B, Hq, Tq, Tk) = ({B}, {Hq}, {Tq}, {Tk})."
                )
        if score_mod is not None:
            score_mod = as_score_mod(score_mod)
            score_mod.validate(B, Hq, device)
            if bias is not None:
                # Masking comes after the modifier: the bias's -inf entries are a mask, not scores
                # to modify (SoftCap would turn them into -cap).
                keep, bias = split_additive_mask(bias)
                if keep is not None:
                    extra = as_mask(keep, "bias")
                    extra.validate(B, Hq, Tq, Tk, q_offset, kv_offset)
                    mask = extra if mask is None else mask & extra
        if sinks is not None:
            sinks = check_sinks(sinks, Hq, device)
        if kv_finite is not None and kv_finite is not True and kv_finite is not False:
            raise TypeError(f"kv_finite: expected True, False or None, got {type(kv_finite).__name__} {kv_finite!r}. "
                            "Fix: pass True only when every K/V entry is known to be finite.")
        # A frozen dataclass's __init__ sets each field through object.__setattr__ (~2 us for ten
        # fields); filling the instance dict directly is ~0.3 us and the instance stays frozen.
        self = object.__new__(cls)
        self.__dict__.update(q=q, k=k, v=v, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p,
                             q_offset=q_offset, kv_offset=kv_offset, return_lse=return_lse,
                             score_mod=score_mod, sinks=sinks, kv_finite=kv_finite, kv_format=kv_format,
                             B=B, Hq=Hq, Hkv=Hkv, Tq=Tq, Tk=Tk, D=D, Dv=Dv, groups=Hq // Hkv, dtype=dtype,
                             device=device)
        return self

    @classmethod
    def trusted(cls, fields: dict, q: Tensor, k: Tensor, v: Tensor) -> AttentionInputs:
        """Inputs from ``fields`` (an instance's ``__dict__`` with q, k and v set to None:
        :meth:`cache_fields`) that :meth:`create` validated for tensors of the same shapes, dtypes
        and devices and the same other arguments: no validation (the dispatcher's per-shape-class
        cache of ``attention()`` calls)."""
        self = object.__new__(cls)
        own = self.__dict__
        own.update(fields)  # its keys include q, k, v: the stores below grow nothing
        own["q"], own["k"], own["v"] = q, k, v
        return self

    def cache_fields(self) -> dict:
        """What :meth:`trusted` takes: the instance's ``__dict__`` with q, k and v set to None (a
        cache of it keeps no tensor alive)."""
        return {**self.__dict__, "q": None, "k": None, "v": None}

    def memo(self) -> dict | None:
        """The dispatcher's memo for this call's class (:func:`attnkit.dispatch.resolve_call`): a dict
        shared by every call with the same cache key, where a backend keeps what it derives from that
        key alone (never from tensor contents, nor from anything outside the key, such as the thread
        count, unless it keys on it); None for inputs built outside that cache."""
        return self.__dict__.get("_memo")

    def dense(self) -> AttentionInputs:
        """These inputs with a KV handle replaced by contiguous K/V in the query dtype (the one
        declared conversion, :meth:`KVHandle.dense`); themselves when K/V are tensors."""
        if self.kv_format == "dense":
            return self
        k, v = self.k.dense(self.dtype)
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, k=k, v=v, kv_format="dense")
        new.__dict__.pop("_memo", None)  # another call class
        return new

    def __repr__(self) -> str:  # shapes, not tensor contents
        return (
            f"AttentionInputs(q={tuple(self.q.shape)}, k={tuple(self.k.shape)}, v={tuple(self.v.shape)}, "
            f"{self.dtype}, {self.device}, mask={self.mask!r}, "
            f"bias={None if self.bias is None else tuple(self.bias.shape)}, "
            f"scale={self.scale:g}, dropout_p={self.dropout_p}, q_offset={self.q_offset}, kv_offset={self.kv_offset}, "
            f"return_lse={self.return_lse})"
        )

    # -- derived properties -----------------------------------------------------------------
    # _derived: computed once per instance (``create`` fills them in up front, since it has
    # read the shapes anyway), so dispatch and backends read plain attributes on the hot path.
    @_derived
    def B(self) -> int:
        return self.q.shape[0]

    @_derived
    def Hq(self) -> int:
        return self.q.shape[1]

    @_derived
    def Hkv(self) -> int:
        return self.k.shape[1]

    @_derived
    def Tq(self) -> int:
        return self.q.shape[2]

    @_derived
    def Tk(self) -> int:
        return self.k.shape[2]

    @_derived
    def D(self) -> int:
        return self.q.shape[3]

    @_derived
    def Dv(self) -> int:
        return self.v.shape[3]

    @_derived
    def groups(self) -> int:
        """Query heads per key/value head (1 = plain multi-head)."""
        return self.Hq // self.Hkv

    @_derived
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @_derived
    def device(self) -> torch.device:
        return self.q.device

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and (
            self.q.requires_grad
            or self.k.requires_grad
            or self.v.requires_grad
            or (self.bias is not None and self.bias.requires_grad)
        )

    def materialize_mask(self) -> Tensor | None:
        """The mask as a bool tensor broadcastable to ``(B, Hq, Tq, Tk)``, or None."""
        if self.mask is None:
            return None
        return self.mask.materialize(self.Tq, self.Tk, q_offset=self.q_offset, kv_offset=self.kv_offset,
                                     device=self.device, batch_size=self.B, num_heads=self.Hq)

    def expand_kv(self) -> tuple[Tensor, Tensor]:
        """K and V with their heads repeated to ``Hq`` (for backends without native GQA)."""
        if self.groups == 1:
            return self.k, self.v
        return self.k.repeat_interleave(self.groups, dim=1), self.v.repeat_interleave(self.groups, dim=1)
