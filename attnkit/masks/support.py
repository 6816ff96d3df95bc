"""Which masks a backend honours, declared as data and answered from the structure API.

A backend sets ``mask_support = MaskSupport("causal", "per_key")`` (say); ``str()`` of it is what
capability tables print and :meth:`MaskSupport.reason` is what dispatch reports, so the two cannot
disagree. A mask is supported when it has at least one of the declared forms:

==============  ===================================================================================
form            the mask (``None`` = no mask) ...
==============  ===================================================================================
``any``         anything, including no mask
``none``        no mask
``causal``      is exactly causal (``Causal()``, repeated, or ``SlidingWindow(None, 0)``)
``per_key``     is an ``And`` of causal parts and query-independent parts (``KeyPadding``,
                ``Padding``, ``Dense (B|1, H|1, 1, Tk)``): one keep per key, plus causality
``band``        has a bounded band (``SlidingWindow`` with both bounds, or with ``Causal()``),
                possibly ``& any masks`` and ``| GlobalTokens(...)``
``layout``      has a ``BlockSparse`` conjunct (alone or ``& any masks``)
``key_lists``   has a ``TopK`` conjunct (per-query key lists, alone or ``& any masks``)
==============  ===================================================================================
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Mask

__all__ = ["MaskSupport"]


def _per_key(mask: Mask) -> bool:
    return all(part.is_causal() or part.query_independent for part in mask.conjuncts())


def _band(mask: Mask) -> bool:
    core, _ = mask.split_globals()
    return core.band().bounded


#: form -> (short name for capability tables, detail for reasons, predicate)
_FORMS: dict[str, tuple[str, str, Callable[[Mask | None], bool]]] = {
    "any": ("any mask", "", lambda m: True),
    "none": ("no mask", "", lambda m: m is None),
    "causal": ("causal", "Causal(), also repeated, or SlidingWindow(None, 0)",
               lambda m: m is not None and m.is_causal()),
    "per_key": ("per-key", "masks that are causal and/or the same for every query (KeyPadding, Padding, "
                "Dense (B|1, H|1, 1, Tk)) and their And: it sums over keys and cannot drop single pairs",
                lambda m: m is not None and _per_key(m)),
    "band": ("banded", "SlidingWindow(left, right) with finite bounds (or with Causal()), optionally & other "
             "masks and | GlobalTokens(...)", lambda m: m is not None and _band(m)),
    "layout": ("BlockSparse layout", "alone or in an And, e.g. BlockSparse.bigbird(...)",
               lambda m: m is not None and m.block_layout() is not None),
    "key_lists": ("TopK key lists", "alone or in an And, e.g. TopK(indices) & Causal()",
             lambda m: m is not None and m.topk() is not None),
}


class MaskSupport:
    """The mask forms a backend honours (see the module docstring for the forms)."""

    __slots__ = ("forms", "_checks")

    def __init__(self, *forms: str):
        unknown = [f for f in forms if f not in _FORMS]
        if not forms or unknown:
            raise ValueError(
                f"MaskSupport{forms!r}: unknown or missing form(s) {unknown}; expected some of {sorted(_FORMS)}."
            )
        self.forms = tuple(dict.fromkeys(forms))
        # "any" accepts everything: no checks at all on dispatch's hot path (one call per layer per token)
        self._checks = () if "any" in self.forms else tuple(_FORMS[form][2] for form in self.forms)

    def accepts(self, mask: Mask | None) -> bool:
        """True when ``mask`` (None = no mask) has one of the declared forms."""
        return not self._checks or any(check(mask) for check in self._checks)

    def reason(self, mask: Mask | None) -> str | None:
        """Why ``mask`` is not supported (one sentence naming the requirement), or None."""
        if self.accepts(mask):
            return None
        got = "no mask" if mask is None else mask.structure_key()
        details = "; ".join(f"{_FORMS[f][0]}: {_FORMS[f][1]}" for f in self.forms if _FORMS[f][1])
        return f"needs {self}" + (f" ({details})" if details else "") + f"; got {got}"

    def __str__(self) -> str:
        """The short form names, e.g. ``"no mask or causal"`` (what capability tables print)."""
        return " or ".join(_FORMS[form][0] for form in self.forms)

    def __repr__(self) -> str:
        return f"MaskSupport({', '.join(map(repr, self.forms))})"

    def __eq__(self, other) -> bool:
        return isinstance(other, MaskSupport) and set(self.forms) == set(other.forms)

    def __hash__(self) -> int:
        return hash(frozenset(self.forms))
