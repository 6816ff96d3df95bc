"""Gated linear attention: the gated delta rule, KDA and Mamba2's SSD, chunked and recurrent.

One module per rule (``gated_delta``, ``kda``, ``ssd``) over a shared chunk scan (``scan``); the
naive twin of all three is the recurrence (``recurrence``); ``kernel`` runs the native C++ kernel
(the chunked gated delta rule and SSD, the recurrent step of every rule) where it is built;
``state`` holds the decoding state. Imports run one way: recurrence, scan <- rules, kernel <- rule
(the entry point, ``rule``) <- state. The public entry point is
``attnkit.gated_linear_attention``.
"""

from .gated_delta import chunk_gated_delta_rule
from .kda import chunk_kda
from .recurrence import recurrent_rule
from .rule import explain_gated, gated_linear_attention
from .ssd import chunk_ssd
from .state import GatedLinearState

__all__ = ["chunk_gated_delta_rule", "chunk_kda", "chunk_ssd", "recurrent_rule", "gated_linear_attention",
           "explain_gated", "GatedLinearState"]
