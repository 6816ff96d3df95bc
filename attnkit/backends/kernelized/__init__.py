"""Kernelized attention (``linear``, ``performer``): one home for the family, as in
flash-linear-attention — feature maps (``features``), prefix sums and the quadratic naive twin
(``ops``), the recurrent decoding state (``state``), the shared backend body (``base``) and the
two registered backends. Imports run one way: features, ops <- state <- base <- backends.
"""

from .linear import LinearBackend, LinearOptions
from .performer import PerformerBackend, PerformerOptions, PerformerProjection, draw_projection, kernel_estimate
from .state import RecurrentState

__all__ = [
    "LinearBackend",
    "LinearOptions",
    "PerformerBackend",
    "PerformerOptions",
    "PerformerProjection",
    "draw_projection",
    "kernel_estimate",
    "RecurrentState",
]
