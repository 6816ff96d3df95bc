"""Backends: capabilities as class data, one ``not_supported_reasons`` function each.

A backend is a stateless class. Its capabilities (devices, dtypes, mask support, GQA, dropout, bias,
backward, offsets, LSE) are checked generically by :meth:`Backend.not_supported_reasons`; a backend
adds input-specific reasons by overriding :meth:`Backend.extra_reasons`. Register with
``@register_backend``; ``attnkit/backends/__init__.py`` imports each module by name.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .inputs import FLOAT_DTYPES, AttentionInputs
from .masks import MaskSupport
from .score_mods import SCORE_MOD_KINDS

__all__ = ["Backend", "Work", "register_backend", "get_backend", "list_backends", "ALL_DEVICES"]

ALL_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu"})

_REGISTRY: dict[str, type[Backend]] = {}
_NAMES: list[tuple[str, ...]] = [()]  # registered names, kept in step with _REGISTRY (hashable, for caches)
_BUILTINS_LOADED = False


@dataclass(frozen=True)
class Work:
    """How a backend computes: its structure, not its speed on any machine. The static order of
    ``auto`` (:mod:`attnkit.dispatch.rule`) is read from it.

    ``fused``: one kernel per call (True) rather than PyTorch ops. ``loop_ops``: PyTorch ops a Python
    loop issues per tile (0: one fused kernel, or ops over whole tensors). ``materializes``: builds
    the whole (B, Hq, Tq, Tk) mask whenever there is a mask (a backend that decides per call says so
    through :meth:`Backend.dense_mask_elements` instead). ``gqa``: grouped K/V heads read in place
    (``"in_place"``) or repeated for each query head of a group first (``"repeats"``)."""

    fused: bool = False
    loop_ops: int = 0
    materializes: bool = False
    gqa: str = "in_place"

    def __post_init__(self):
        if self.gqa not in ("in_place", "repeats"):
            raise ValueError(f"Work.gqa: expected 'in_place' or 'repeats', got {self.gqa!r}.")
        if not isinstance(self.loop_ops, int) or self.loop_ops < 0:
            raise ValueError(f"Work.loop_ops: expected an int >= 0, got {self.loop_ops!r}.")


class Backend:
    """Base class of attention backends. Subclasses set the class data and ``forward``."""

    name: ClassVar[str]
    #: False for approximations (linear, performer, lsh): never chosen by ``auto``.
    exact: ClassVar[bool] = True
    devices: ClassVar[frozenset[str]] = ALL_DEVICES
    dtypes: ClassVar[frozenset[torch.dtype]] = FLOAT_DTYPES
    #: The mask forms the backend honours, checked and printed from one declaration.
    mask_support: ClassVar[MaskSupport] = MaskSupport("any")
    supports_dropout: ClassVar[bool] = False
    supports_bias: ClassVar[bool] = False
    supports_backward: ClassVar[bool] = True
    supports_lse: ClassVar[bool] = False
    #: Applies ``score_mod=`` (soft-capping, ALiBi, relative biases, custom) / ``sinks=``.
    supports_score_mod: ClassVar[bool] = False
    #: With ``supports_score_mod``: the :class:`~attnkit.score_mods.ScoreModTerm` kinds it runs
    #: (``"alibi"``, ``"relative_bias"``, ``"softcap"``, ``"custom"``: an opaque callable).
    score_mod_kinds: ClassVar[frozenset[str]] = SCORE_MOD_KINDS
    supports_sinks: ClassVar[bool] = False
    #: Who keeps the NaN/Inf contract: ``"policy"`` (attnkit.backends.nonfinite, applied by the entry
    #: point: the backend may assume finite q, K, V) or ``"self"`` (the backend's own kernel does).
    #: A backend whose answer depends on the call (a kernel that keeps it, a fallback that does not)
    #: declares ``"policy"`` and overrides :meth:`keeps_nonfinite`.
    nonfinite: ClassVar[str] = "policy"
    #: KV storage formats ``forward`` reads in place (:mod:`attnkit.kv_handle`); for any other the
    #: dispatcher converts a cache handle to dense K/V first (``explain()`` says so).
    kv_formats: ClassVar[frozenset[str]] = frozenset({"dense"})
    #: Optional packages the backend needs (checked with importlib, never imported here).
    requires: ClassVar[tuple[str, ...]] = ()
    #: Dataclass of hyper-parameters accepted through ``attention(..., options=...)``.
    Options: ClassVar[type | None] = None
    #: One line for ``attnkit info``.
    summary: ClassVar[str] = ""
    #: ContextVars its reasons read besides the inputs (e.g. a scope that allows it): the dispatcher
    #: keys its cached choices on their values, so a choice never outlives the scope it was made in.
    reason_contexts: ClassVar[tuple] = ()
    #: True when its first call per device compiles (tens of seconds): ``attnkit bench`` then times it
    #: only when named.
    compiles: ClassVar[bool] = False
    #: Kernelized backends: ``feature_maps(options, head_dim, scale)``, the feature maps of their
    #: recurrent decoding state (:class:`attnkit.RecurrentState`); None: no recurrent state, for the
    #: reason ``no_recurrent_reason`` gives.
    feature_maps: ClassVar[Callable | None] = None
    no_recurrent_reason: ClassVar[str] = "Fix: decode with a KV cache and an exact backend."
    #: What it skips, fuses and materializes (:class:`Work`), read by the dispatcher's static order.
    #: The default (computes every pair with PyTorch ops) ranks a new backend after the fused kernels.
    work: ClassVar[Work] = Work()

    @classmethod
    def available(cls) -> bool:
        return all(importlib.util.find_spec(pkg) is not None for pkg in cls.requires)

    @classmethod
    def not_supported_reasons(cls, inp: AttentionInputs) -> list[str]:
        """Why this backend cannot run ``inp``; an empty list means it can."""
        return list(cls.iter_reasons(inp))

    @classmethod
    def can_run(cls, inp: AttentionInputs) -> bool:
        """``not not_supported_reasons(inp)`` (dispatch's hot path: the class-data checks without
        building a generator; the full reasons only for backends with more to check)."""
        if (
            inp.device.type not in cls.devices
            or inp.dtype not in cls.dtypes
            or (inp.dropout_p > 0 and not cls.supports_dropout)
            or (inp.bias is not None and not cls.supports_bias)
            or (inp.return_lse and not cls.supports_lse)
            or (inp.score_mod is not None and not (cls.supports_score_mod
                                                   and inp.score_mod.kinds() <= cls.score_mod_kinds))
            or (inp.sinks is not None and not cls.supports_sinks)
            or not cls.mask_support.accepts(inp.mask)
            or inp.kv_format not in cls.kv_formats
        ):
            return False
        if cls.requires or not cls.supports_backward or (
            cls.extra_reasons.__func__ is not _NO_EXTRA_REASONS
        ):
            return next(cls.iter_reasons(inp), None) is None
        return True

    @classmethod
    def iter_reasons(cls, inp: AttentionInputs) -> Iterator[str]:
        """Yield each reason lazily, so a backend that can run formats no strings at all."""
        if cls.requires and not cls.available():
            missing = [pkg for pkg in cls.requires if importlib.util.find_spec(pkg) is None]
            yield f"needs the package(s) {', '.join(missing)}"
        if inp.device.type not in cls.devices:
            yield f"runs on {sorted(cls.devices)}, not {inp.device.type}"
        if inp.dtype not in cls.dtypes:
            yield f"supports dtypes {sorted(str(d).removeprefix('torch.') for d in cls.dtypes)}, not {inp.dtype}"
        if inp.kv_format not in cls.kv_formats:
            yield f"reads {' and '.join(sorted(cls.kv_formats))} K/V, not a {inp.kv_format} cache"
        mask_reason = cls.mask_support.reason(inp.mask)
        if mask_reason is not None:
            yield mask_reason
        if inp.dropout_p > 0 and not cls.supports_dropout:
            yield "has no dropout (dropout_p > 0)"
        if inp.bias is not None and not cls.supports_bias:
            yield "takes no additive bias"
        if inp.score_mod is not None and not cls.supports_score_mod:
            yield "cannot apply a score_mod (SoftCap, ALiBi, RelativeBias, CustomScoreMod)"
        elif inp.score_mod is not None and not inp.score_mod.kinds() <= cls.score_mod_kinds:
            missing = ", ".join(sorted(inp.score_mod.kinds() - cls.score_mod_kinds))
            yield (f"runs the score modifiers {', '.join(sorted(cls.score_mod_kinds))}, not {missing} "
                   f"({inp.score_mod!r})")
        if inp.sinks is not None and not cls.supports_sinks:
            yield "has no attention sinks (sinks=)"
        if inp.return_lse and not cls.supports_lse:
            yield "cannot return the log-sum-exp (return_lse=True)"
        if not cls.supports_backward and inp.requires_grad:
            yield "has no backward pass (inputs require grad)"
        yield from cls.extra_reasons(inp)

    @classmethod
    def extra_reasons(cls, inp: AttentionInputs) -> Iterable[str]:
        """Input-specific limits beyond the class data (override in subclasses; a generator or a list)."""
        return ()

    @classmethod
    def keeps_nonfinite(cls, inp: AttentionInputs, options) -> bool:
        """Whether ``forward(inp, options)`` keeps the NaN/Inf contract itself, so the policy
        (:mod:`attnkit.backends.nonfinite`) neither scans q, K, V nor takes its slow path for this
        call. Default: ``nonfinite == "self"``; override when it depends on the call."""
        return cls.nonfinite == "self"

    @classmethod
    def check_options(cls, options):
        """``options`` if it is this backend's ``Options`` (or None), else a ``TypeError`` that says
        what this backend takes."""
        if options is None or (cls.Options is not None and isinstance(options, cls.Options)):
            return options
        if cls.Options is None:
            raise TypeError(
                f"options: backend {cls.name!r} takes no options, got {type(options).__name__}. Fix: drop options= "
                "(or backend_options=) or name the backend the options belong to."
            )
        raise TypeError(
            f"options: backend {cls.name!r} takes {cls.Options.__name__}, got {type(options).__name__}. "
            f"Fix: pass {cls.Options.__name__}({', '.join(f.name + '=...' for f in fields(cls.Options))})."
        )

    @classmethod
    def decodes(cls, inp: AttentionInputs) -> bool:
        """A hint for dispatch's decode rule: whether this backend runs ``inp`` (a few queries over
        a longer K/V) with a kernel built for decoding, reading each K/V row once for every query
        head of its group, and reading the mask's structure (no materialized mask). The dispatcher
        puts such backends first for a decoding step."""
        return False

    @classmethod
    def dense_mask_elements(cls, inp: AttentionInputs) -> int:
        """A cost hint for dispatch: elements of the ``(B, Hq, Tq, Tk)`` mask this backend would
        materialize for ``inp`` (0 when it reads the mask's structure instead)."""
        return 0

    @classmethod
    def describe(cls, inp: AttentionInputs) -> str:
        """One plain sentence on how this backend would run ``inp`` (for ``explain()``)."""
        return cls.summary

    @classmethod
    def forward(cls, inp: AttentionInputs, options) -> Tensor | tuple[Tensor, Tensor]:
        """Return ``out (B, Hq, Tq, Dv)``, or ``(out, lse (B, Hq, Tq))`` when ``inp.return_lse``."""
        raise NotImplementedError

    @classmethod
    def capabilities(cls) -> dict[str, object]:
        """The class data as a plain dict (for ``attnkit info`` and docs)."""
        return {
            "name": cls.name,
            "exact": cls.exact,
            "available": cls.available(),
            "devices": sorted(cls.devices),
            "dtypes": sorted(str(d).removeprefix("torch.") for d in cls.dtypes),
            "masks": str(cls.mask_support),
            "mask_forms": list(cls.mask_support.forms),  # short names of the same declaration
            "dropout": cls.supports_dropout,
            "bias": cls.supports_bias,
            "backward": cls.supports_backward,
            "lse": cls.supports_lse,
            "score_mod": cls.supports_score_mod,
            "sinks": cls.supports_sinks,
            "nonfinite": cls.nonfinite,
            "kv_formats": sorted(cls.kv_formats),
            "work": asdict(cls.work),
            "summary": cls.summary,
        }


_NO_EXTRA_REASONS = Backend.extra_reasons.__func__


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Class decorator adding a backend to the registry under ``cls.name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_backend: {cls.__name__} needs a class attribute `name` (a non-empty str).")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"register_backend: a backend named {name!r} is already registered "
                         f"({_REGISTRY[name].__name__}).")
    if hasattr(cls, "mask_kinds"):  # the old declaration would be ignored: the backend would accept every mask
        raise TypeError(
            f"register_backend: {cls.__name__}.mask_kinds is no longer read. Fix: declare the mask forms it "
            "honours as mask_support = MaskSupport(...), e.g. MaskSupport('none', 'causal')."
        )
    if not isinstance(cls.mask_support, MaskSupport):
        raise TypeError(f"register_backend: {cls.__name__}.mask_support must be a MaskSupport, "
                        f"got {cls.mask_support!r}.")
    if cls.nonfinite not in ("policy", "self"):
        raise TypeError(f"register_backend: {cls.__name__}.nonfinite must be 'policy' or 'self', "
                        f"got {cls.nonfinite!r}.")
    if not isinstance(cls.work, Work):
        raise TypeError(f"register_backend: {cls.__name__}.work must be a Work, got {cls.work!r}.")
    if cls.Options is not None and not is_dataclass(cls.Options):
        raise TypeError(f"register_backend: {cls.__name__}.Options must be a dataclass, got {cls.Options!r}.")
    _REGISTRY[name] = cls
    _NAMES[0] = tuple(_REGISTRY)
    return cls


def list_backends() -> dict[str, type[Backend]]:
    """All registered backends by name, in registration order (the live registry: do not mutate)."""
    global _BUILTINS_LOADED
    # Traced (torch.compile), the import is skipped: ``import attnkit`` has imported the built-ins already.
    if not _BUILTINS_LOADED and not torch.compiler.is_compiling():
        importlib.import_module(f"{__package__}.backends")  # registers the built-in backends
        _BUILTINS_LOADED = True
    return _REGISTRY


def registered_names() -> tuple[str, ...]:
    """Names of all registered backends in registration order (a cheap, hashable snapshot)."""
    list_backends()
    return _NAMES[0]


def names_now() -> tuple[str, ...]:
    """:func:`registered_names` without loading the built-in backends first (an empty tuple until
    they are): a per-call cache compares it by identity, and a new registration replaces it."""
    return _NAMES[0]


def get_backend(name: str) -> type[Backend]:
    """The backend registered as ``name``; ``ValueError`` listing the known names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"backend: expected a backend name (str), got {type(name).__name__}.")
    known = list_backends()
    if name not in known:
        raise ValueError(f"backend: unknown backend {name!r}; expected 'auto' or one of {sorted(known)}.")
    return known[name]
