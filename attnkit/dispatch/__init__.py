"""Choosing a backend: the rule, the measured table, selection, ``explain()`` and ``autotune()``.

``rule`` (the order ``auto`` tries), ``table`` (this machine's measured rankings), ``calls``
(``select``, ``resolve``, ``use_backend``, the per-call cache), ``explain`` and ``tuning`` (``autotune()``).
"""

from .tuning import autotune
from .calls import NoBackendError, resolve, resolve_call, select, use_backend
from .explain import Explanation, explain
from .rule import DECODE_QUERIES, MATERIALIZE_LIMIT, builtin_order, priority

__all__ = ["NoBackendError", "select", "resolve", "resolve_call", "explain", "use_backend", "priority", "Explanation",
           "builtin_order", "autotune", "MATERIALIZE_LIMIT", "DECODE_QUERIES"]
