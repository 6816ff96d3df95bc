"""Score modifiers: functions of the raw attention score, applied before masking.

A score modifier maps the scaled (and biased) score of query ``i`` and key ``j`` to a new score,
FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` convention over *absolute* positions
(the same positions masks use). They are values like masks: composable (``a >> b`` applies ``a``
first, then ``b``; a list does the same), printable, drawable (:meth:`ScoreMod.to_string`) and
readable by backends (:meth:`ScoreMod.parts`, :meth:`ScoreMod.parameters`, and as data a kernel
reads: :func:`score_mod_spec`, a :class:`ScoreModSpec` of :class:`ScoreModTerm` s in chain order
plus the sinks). Masking comes after
every modifier, so a masked pair stays masked whatever the modifier does::

    attention(q, k, v, mask=Causal(), score_mod=ALiBi.geometric(8) >> SoftCap(50.0))

* ``SoftCap(c)``: ``c * tanh(s / c)`` (Gemma-2/3 logit soft-capping);
* ``ALiBi(slopes)``: ``s - slope[h] * |pos(q) - pos(k)|`` (Press et al. 2022), per head, no
  ``(Tq, Tk)`` tensor; learnable when ``slopes`` requires grad;
* ``RelativeBias(table, ...)``: ``s + table[h, bucket(pos(k) - pos(q))]``, T5's bucketed
  relative positions, learnable;
* ``CustomScoreMod(fn)``: any ``fn(score, b, h, q_idx, kv_idx)`` made of tensor operations.

Attention sinks (gpt-oss) are not a score modifier but an extra logit per head that joins every
row's softmax normaliser without contributing a value: ``attention(..., sinks=logits)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ScoreMod", "SoftCap", "ALiBi", "RelativeBias", "CustomScoreMod", "Chain", "as_score_mod",
           "ScoreModTerm", "ScoreModSpec", "score_mod_spec", "SCORE_MOD_KINDS"]

#: The kinds of :class:`ScoreModTerm`: what a backend declares it runs (``Backend.score_mod_kinds``).
SCORE_MOD_KINDS = frozenset({"alibi", "relative_bias", "softcap", "custom"})


@dataclass(frozen=True, eq=False)
class ScoreModTerm:
    """One primitive modifier as data, the fields of its ``kind`` set and the others None:

    * ``"alibi"``: ``score - slopes[h] * |pos(q) - pos(k)|``; ``slopes (H,)``;
    * ``"relative_bias"``: ``score + table[h, bucket(pos(k) - pos(q))]``; ``table (H, num_buckets)``,
      ``max_distance``, ``bidirectional`` (T5's bucket rule, :func:`t5_bucket`; :meth:`buckets`
      evaluates it, so a kernel reads a bucket per relative distance rather than re-deriving it);
    * ``"softcap"``: ``cap * tanh(score / cap)``; ``cap``;
    * ``"custom"``: an opaque callable.

    ``mod`` is the primitive :class:`ScoreMod` the term describes (to call, for a backend that runs
    Python score functions). ``slopes`` and ``table`` are its own tensors (learnable when they
    require grad)."""

    kind: str
    slopes: Tensor | None = None
    table: Tensor | None = None
    max_distance: int | None = None
    bidirectional: bool | None = None
    cap: float | None = None
    mod: ScoreMod | None = None

    @property
    def additive(self) -> bool:
        """The term adds something independent of the score (its derivative by the score is 1)."""
        return self.kind in ("alibi", "relative_bias")

    def distance_bias(self, relative: Tensor, num_heads: int, dtype: torch.dtype) -> Tensor:
        """An additive term as ``(num_heads, len(relative))``: what it adds to a score whose
        ``pos(k) - pos(q)`` is ``relative`` (differentiable in ``slopes`` / ``table``)."""
        if self.kind == "alibi":
            bias = -self.slopes.to(dtype)[:, None] * relative.abs().to(dtype)[None, :]
        elif self.kind == "relative_bias":
            bias = self.table.to(dtype)[:, self.buckets(relative)]
        else:
            raise ValueError(f"distance_bias: a {self.kind!r} term is not additive")
        return bias.expand(num_heads, -1)

    def buckets(self, relative: Tensor) -> Tensor:
        """``relative_bias`` only: the table column of each ``pos(k) - pos(q)`` (int64)."""
        assert self.kind == "relative_bias", self.kind
        return t5_bucket(relative, num_buckets=self.table.shape[1], max_distance=self.max_distance,
                         bidirectional=self.bidirectional)


@dataclass(frozen=True, eq=False)
class ScoreModSpec:
    """A call's score modifiers and sinks as data: ``terms`` in the order they apply (empty: no
    modifier), then masking, then ``sinks (Hq,)`` (or None) join each row's softmax normaliser."""

    terms: tuple[ScoreModTerm, ...] = ()
    sinks: Tensor | None = None

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(t.kind for t in self.terms)

    @property
    def additive(self) -> bool:
        return all(t.additive for t in self.terms)

    def distance_form(self, q_offset: int, Tq: int, kv_offset: int, Tk: int, num_heads: int, dtype: torch.dtype,
                      device=None) -> tuple[Tensor | None, int, list[int], list[float]]:
        """The chain as a kernel runs it without calling Python: ``(dist, dmin, ops, caps)`` where
        ``ops`` lists ``0`` (add the next row of ``dist``) and ``1`` (soft-cap with the next
        ``caps`` value) in chain order, and ``dist (n_add, num_heads, Tq + Tk - 1)`` holds each run
        of consecutive additive terms summed per head and relative distance ``d = pos(k) - pos(q)``
        at index ``d - dmin`` (differentiable in the terms' tensors; None without additive terms).
        ``custom`` terms have no such form (``ValueError``)."""
        dmin = kv_offset - (q_offset + Tq - 1)
        relative = torch.arange(dmin, kv_offset + Tk - q_offset, device=device)
        rows: list[Tensor] = []
        ops: list[int] = []
        caps: list[float] = []
        for t in self.terms:
            if t.kind == "softcap":
                ops.append(1)
                caps.append(t.cap)
            elif t.additive:
                bias = t.distance_bias(relative, num_heads, dtype)
                if ops and ops[-1] == 0:
                    rows[-1] = rows[-1] + bias
                else:
                    ops.append(0)
                    rows.append(bias)
            else:
                raise ValueError(f"distance_form: a {t.kind!r} term ({t.mod!r}) is an opaque callable")
        dist = torch.stack(rows).contiguous() if rows else None
        return dist, dmin, ops, caps

    def parameters(self) -> tuple[Tensor, ...]:
        """The tensors the terms read (the same objects as ``ScoreMod.parameters``), in term order."""
        out: list[Tensor] = []
        for t in self.terms:
            out.extend(x for x in (t.slopes, t.table) if x is not None)
            if t.kind == "custom":
                out.extend(t.mod.parameters())
        return tuple(out)


class ScoreMod:
    """Base class. Subclasses implement :meth:`apply` with broadcasting index tensors: ``b``
    ``(B|1, 1, 1, 1)``, ``h`` ``(1, H|1, 1, 1)``, ``q_idx`` ``(1, 1, Tq, 1)`` and ``kv_idx``
    ``(1, 1, 1, Tk)`` holding absolute positions; ``score`` broadcasts against them."""

    #: Heads the modifier distinguishes (None: the same for every head).
    num_heads: int | None = None
    #: True when the modifier adds a term that does not depend on the score (ALiBi, relative
    #: biases): its derivative by the score is 1, so a backward pass can skip differentiating it.
    additive: bool = False

    def apply(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.apply(score, b, h, q_idx, kv_idx)

    def parts(self) -> tuple[ScoreMod, ...]:
        """The primitive modifiers in the order they apply."""
        return (self,)

    def parameters(self) -> tuple[Tensor, ...]:
        """Tensors the modifier reads (learnable ones receive gradients)."""
        return ()

    def terms(self) -> tuple[ScoreModTerm, ...]:
        """The modifier as data, in the order its parts apply (:class:`ScoreModTerm`)."""
        return tuple(t for part in self.parts() for t in part._term())

    def kinds(self) -> frozenset[str]:
        """The :class:`ScoreModTerm` kinds of the parts (what a backend must run)."""
        return frozenset(t.kind for t in self.terms())

    def _term(self) -> tuple[ScoreModTerm, ...]:
        """A primitive's own data form; a subclass without one is an opaque callable."""
        return (ScoreModTerm("custom", mod=self),)

    def __rshift__(self, other: ScoreMod) -> ScoreMod:
        return Chain(self, as_score_mod(other, "other"))

    def call_key(self) -> tuple:
        """What validation and backend selection read of this modifier, for the dispatcher's per-call
        cache: the object (its terms never change) and each tensor's shape, dtype, device and
        whether it requires grad (a table that starts requiring grad, or is moved to another dtype or
        device, keys anew)."""
        return (self, *[(t.shape, t.dtype, t.device, t.requires_grad) for t in self.parameters()])

    def validate(self, B: int, H: int, device: torch.device) -> None:
        """Raise ``ValueError`` if the modifier cannot serve a call with ``H`` query heads on ``device``."""
        if self.num_heads not in (None, 1, H):
            raise ValueError(
                f"score_mod {self!r} has {self.num_heads} heads, but q has {H} heads. "
                "Fix: give one value per query head."
            )
        for t in self.parameters():
            if t.device != device:
                raise ValueError(f"score_mod {self!r}: its tensors are on {t.device}, q is on {device}. "
                                 "Fix: .to(q.device).")

    def evaluate(self, score: Tensor, q_range: tuple[int, int], kv_range: tuple[int, int],
                 B: int = 1, H: int = 1) -> Tensor:
        """Apply to ``score`` ``(B|1, H|1, n, m)`` for absolute query/key ranges (one tile or a whole call)."""
        dev = score.device
        b = torch.arange(B, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(H, device=dev).view(1, -1, 1, 1)
        q_idx = torch.arange(*q_range, device=dev).view(1, 1, -1, 1)
        kv_idx = torch.arange(*kv_range, device=dev).view(1, 1, 1, -1)
        return self.apply(score, b, h, q_idx, kv_idx)

    def to_string(self, Tq: int, Tk: int, *, head: int = 0, q_offset: int | None = None, kv_offset: int = 0) -> str:
        """The modified score of a zero raw score on a small grid (one head), one number per cell."""
        q_offset = kv_offset + Tk - Tq if q_offset is None else q_offset
        H = head + 1
        grid = self.evaluate(torch.zeros(1, H, Tq, Tk), (q_offset, q_offset + Tq), (kv_offset, kv_offset + Tk), 1, H)
        rows = grid.expand(1, H, Tq, Tk)[0, head].tolist()
        return "\n".join(" ".join(f"{x:6.2f}" for x in row) for row in rows)


def _number(value, name: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: expected a finite number.")
    if positive and value <= 0:
        raise ValueError(f"{name}={value!r}: expected a positive number, e.g. 50.0.")
    return float(value)


@dataclass(frozen=True)
class SoftCap(ScoreMod):
    """``cap * tanh(score / cap)``: scores squashed into ``(-cap, cap)`` (Gemma-2 uses 50 for
    attention logits)."""

    cap: float

    def __post_init__(self):
        object.__setattr__(self, "cap", _number(self.cap, "SoftCap(cap)", positive=True))

    def apply(self, score, b, h, q_idx, kv_idx):
        return torch.tanh(score / self.cap) * self.cap

    def _term(self):
        return (ScoreModTerm("softcap", cap=self.cap, mod=self),)


def _per_head(values, name: str) -> Tensor:
    if not isinstance(values, Tensor):
        try:
            values = torch.tensor([float(x) for x in values])
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name}: expected a 1-D float tensor or a sequence of numbers, got {values!r}.") from exc
    if not values.is_floating_point() or values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty 1-D float tensor (one value per head), got "
                         f"{values.dtype} {tuple(values.shape)}.")
    return values


@dataclass(frozen=True, eq=False)
class ALiBi(ScoreMod):
    """``score - slopes[h] * |pos(q) - pos(k)|`` (Press et al. 2022, https://arxiv.org/abs/2108.12409).
    Positions are absolute, so a KV cache needs no special case; no ``(Tq, Tk)`` tensor is ever
    built. ``slopes`` may require grad (learned slopes). For 4 heads, ``ALiBi.geometric(4)`` on a
    3×3 grid, head 0::

        0.00  -0.25  -0.50
       -0.25   0.00  -0.25
       -0.50  -0.25   0.00
    """

    slopes: Tensor
    additive = True

    def __post_init__(self):
        slopes = _per_head(self.slopes, "ALiBi(slopes)")
        object.__setattr__(self, "slopes", slopes)
        object.__setattr__(self, "num_heads", slopes.numel())

    @classmethod
    def geometric(cls, num_heads: int) -> ALiBi:
        """The paper's slopes ``2 ** (-8 i / n)``, ``i = 1..n`` (for a power of two ``n``; other
        ``n`` interleave the next power's slopes as in the reference implementation)."""
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"ALiBi.geometric(num_heads={num_heads!r}): expected a positive int.")

        def powers(n):
            start = 2 ** (-8 / n)
            return [start ** (i + 1) for i in range(n)]

        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = powers(closest) + powers(2 * closest)[0::2][: num_heads - closest]
        return cls(torch.tensor(slopes))

    def apply(self, score, b, h, q_idx, kv_idx):
        slopes = self.slopes.to(score.dtype)[h]  # (1, H, 1, 1)
        return score - slopes * (q_idx - kv_idx).abs().to(score.dtype)

    def parameters(self):
        return (self.slopes,)

    def _term(self):
        return (ScoreModTerm("alibi", slopes=self.slopes, mod=self),)

    def __repr__(self):
        return f"ALiBi(heads={self.slopes.numel()})"


def _check_max_distance(max_distance: int, num_buckets: int, bidirectional: bool) -> None:
    """The logarithmic buckets span ``exact .. max_distance`` (``exact`` = half the buckets of one
    direction), so ``max_distance`` must exceed ``exact``: at or below it ``log(max_distance / exact)``
    is 0 or negative and the buckets would be garbage (an IndexError, or negative ones that wrap)."""
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if max_distance <= exact:
        raise ValueError(
            f"RelativeBias(max_distance={max_distance}): with {num_buckets} buckets "
            f"({'bidirectional' if bidirectional else 'one direction'}) distances below {exact} get exact buckets, "
            f"so max_distance must be greater than {exact}. Fix: pass max_distance > {exact} (T5 uses 128 with "
            "32 buckets), or fewer buckets."
        )


def t5_bucket(relative: Tensor, *, num_buckets: int, max_distance: int, bidirectional: bool) -> Tensor:
    """T5's relative-position bucket of ``relative = pos(k) - pos(q)`` (Raffel et al. 2020): exact
    buckets for small distances, logarithmic ones up to ``max_distance``."""
    _check_max_distance(max_distance, num_buckets, bidirectional)
    buckets = torch.zeros_like(relative)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets = buckets + (relative > 0).long() * n
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = n // 2
    is_small = distance < exact
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (n - exact)).long()).clamp(max=n - 1)
    return buckets + torch.where(is_small, distance, large)


@dataclass(frozen=True, eq=False)
class RelativeBias(ScoreMod):
    """``score + table[h, bucket(pos(k) - pos(q))]``: T5-style learned relative-position bias.
    ``table`` is ``(H, num_buckets)``; gradients flow into it. ``bidirectional=False`` for decoders."""

    table: Tensor
    max_distance: int = 128
    bidirectional: bool = True
    additive = True

    def __post_init__(self):
        t = self.table
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.dim() != 2 or 0 in t.shape:
            raise ValueError(
                f"RelativeBias(table): expected a float tensor (H, num_buckets), got "
                f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}."
            )
        if isinstance(self.max_distance, bool) or not isinstance(self.max_distance, int) or self.max_distance < 2:
            raise ValueError(f"RelativeBias(max_distance={self.max_distance!r}): expected an int >= 2, e.g. 128.")
        if not isinstance(self.bidirectional, bool):
            raise TypeError(f"RelativeBias(bidirectional={self.bidirectional!r}): expected a bool.")
        buckets = t.shape[1] // 2 if self.bidirectional else t.shape[1]
        if buckets < 2:
            raise ValueError(f"RelativeBias(table): {t.shape[1]} buckets are too few; expected at least "
                             f"{4 if self.bidirectional else 2}.")
        _check_max_distance(self.max_distance, t.shape[1], self.bidirectional)
        object.__setattr__(self, "num_heads", t.shape[0])

    def buckets(self, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return t5_bucket(kv_idx - q_idx, num_buckets=self.table.shape[1], max_distance=self.max_distance,
                         bidirectional=self.bidirectional)

    def apply(self, score, b, h, q_idx, kv_idx):
        return score + self.table.to(score.dtype)[h, self.buckets(q_idx, kv_idx)]

    def parameters(self):
        return (self.table,)

    def _term(self):
        return (ScoreModTerm("relative_bias", table=self.table, max_distance=self.max_distance,
                             bidirectional=self.bidirectional, mod=self),)

    def __repr__(self):
        return (f"RelativeBias(heads={self.table.shape[0]}, buckets={self.table.shape[1]}, "
                f"bidirectional={self.bidirectional})")


@dataclass(frozen=True)
class CustomScoreMod(ScoreMod):
    """Escape hatch: ``fn(score, b, h, q_idx, kv_idx) -> score`` over absolute positions, made of
    differentiable tensor operations (FlexAttention's ``score_mod``). ``params`` lists tensors
    ``fn`` closes over, so backends that need them (and their gradients) can find them."""

    fn: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
    name: str = "custom"
    params: tuple[Tensor, ...] = ()

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError("CustomScoreMod(fn): expected a callable fn(score, b, h, q_idx, kv_idx), "
                            f"got {type(self.fn).__name__}.")
        object.__setattr__(self, "params", tuple(self.params))

    def apply(self, score, b, h, q_idx, kv_idx):
        out = self.fn(score, b, h, q_idx, kv_idx)
        if not isinstance(out, Tensor) or not out.is_floating_point():
            raise TypeError(f"score_mod: CustomScoreMod({self.name}) returned {type(out).__name__}; "
                            "expected a float tensor.")
        if out.shape != score.shape:  # a broadcast would silently grow the output (or fail deep in a kernel)
            raise ValueError(
                f"score_mod: CustomScoreMod({self.name}) returned shape {tuple(out.shape)} for scores of shape "
                f"{tuple(score.shape)}; expected the scores' shape (one new score per score). Fix: compute "
                "elementwise from score and the index tensors, e.g. `score - (q_idx - kv_idx).abs()`, without "
                "reducing, indexing or adding dimensions."
            )
        return out

    def parameters(self):
        return self.params

    def __repr__(self):
        return f"CustomScoreMod({self.name})"


class Chain(ScoreMod):
    """Modifiers applied left to right (``a >> b`` or a list)."""

    def __init__(self, *mods: ScoreMod):
        flat: list[ScoreMod] = []
        for i, mod in enumerate(mods):
            flat.extend(as_score_mod(mod, f"score_mod[{i}]").parts())
        if not flat:
            raise ValueError("score_mod: expected at least one modifier, got an empty chain.")
        self._parts = tuple(flat)
        heads = {m.num_heads for m in flat if m.num_heads not in (None, 1)}
        if len(heads) > 1:
            raise ValueError(f"score_mod: the modifiers disagree on the number of heads {sorted(heads)}.")
        self.num_heads = heads.pop() if heads else None
        self.additive = all(m.additive for m in flat)

    def apply(self, score, b, h, q_idx, kv_idx):
        for mod in self._parts:
            score = mod.apply(score, b, h, q_idx, kv_idx)
        return score

    def parts(self):
        return self._parts

    def parameters(self):
        return tuple(t for m in self._parts for t in m.parameters())

    def validate(self, B, H, device):
        for m in self._parts:
            m.validate(B, H, device)

    def __repr__(self):
        return " >> ".join(map(repr, self._parts))


def as_score_mod(mod, name: str = "score_mod") -> ScoreMod:
    """``mod`` as a :class:`ScoreMod`: a modifier, a list of them (applied in order) or a plain
    callable ``fn(score, b, h, q_idx, kv_idx)``."""
    if isinstance(mod, ScoreMod):
        return mod
    if isinstance(mod, Sequence) and not isinstance(mod, (str, bytes)):
        return mod[0] if len(mod) == 1 else Chain(*mod)
    if callable(mod):
        return CustomScoreMod(mod)
    raise TypeError(
        f"{name}: expected a ScoreMod (SoftCap(c), ALiBi(slopes), RelativeBias(table), CustomScoreMod(fn)), a list "
        f"of them or a callable fn(score, b, h, q_idx, kv_idx), got {type(mod).__name__}."
    )


def check_sinks(sinks, H: int, device: torch.device) -> Tensor:
    """Validate ``attention(..., sinks=)``: a float ``(Hq,)`` tensor of per-head sink logits."""
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        raise TypeError("sinks: expected a float tensor (Hq,) of per-head logits, "
                        f"got {getattr(sinks, 'dtype', type(sinks).__name__)}.")
    if sinks.shape != (H,):
        raise ValueError(f"sinks: expected shape ({H},) (one logit per query head), got {tuple(sinks.shape)}.")
    if sinks.device != device:
        raise ValueError(f"sinks: expected device {device} like q, got {sinks.device}. Fix: sinks.to(q.device).")
    return sinks


def score_mod_spec(score_mod: ScoreMod | None, sinks: Tensor | None = None) -> ScoreModSpec:
    """The data form of a call's ``score_mod`` (validated, or None) and ``sinks``."""
    return ScoreModSpec(() if score_mod is None else score_mod.terms(), sinks)
