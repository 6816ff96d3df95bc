"""attnkit: every attention behind one API and one mask contract.

Shape legend (used in every docstring and shape comment)::

    B   batch size                 Hq / Hkv  query heads / key-value heads (Hq % Hkv == 0)
    Tq  query length               Tk        key/value length
    D   query/key head dim         Dv        value head dim

Tour::

    import torch, attnkit
    q = torch.randn(1, 8, 128, 64); k = v = torch.randn(1, 2, 128, 64)    # GQA: 8 query, 2 kv heads
    out = attnkit.attention(q, k, v, mask=attnkit.Causal())              # (1, 8, 128, 64)
    print(attnkit.explain(q, k, v, mask=attnkit.Causal()))               # which backend, and why
    out = attnkit.attention(q, k, v, mask=attnkit.SlidingWindow(32, 0), backend="naive")
    with attnkit.use_backend("naive"):                                   # scoped choice
        out, lse = attnkit.attention(q, k, v, return_lse=True)
    keep = torch.rand(1, 1, 128, 128) > 0.5                              # True = attend
    out = attnkit.attention(q, k, v, mask=keep & attnkit.Causal().materialize(128, 128))
"""

from .approximation import approximation_error
from .dispatch import NoBackendError, autotune, explain, use_backend
from .functional import attention, attention_weights
from .varlen import varlen_attention
from .mla import mla_decode
from .inputs import AttentionInputs
from .kv_handle import KVHandle
from .masks import (
    And,
    Band,
    BlockSparse,
    BlockStatus,
    Causal,
    Custom,
    Dense,
    Document,
    GlobalTokens,
    KeyPadding,
    Mask,
    MaskSupport,
    Or,
    Padding,
    SlidingWindow,
    TopK,
    as_mask,
    from_key_padding_mask,
    longformer,
)
from .backends.kernelized import RecurrentState
from .backends.kernelized.gated import GatedLinearState, explain_gated, gated_linear_attention
from .registry import Backend, get_backend, list_backends, register_backend
from .cache import DynamicLayerCache, KVCache, SlidingWindowLayerCache, StateCache, StaticLayerCache
from .generation import generate
from ._version import __version__ as __version__

__all__ = [
    "attention",
    "varlen_attention",
    "mla_decode",
    "attention_weights",
    "explain",
    "use_backend",
    "autotune",
    "NoBackendError",
    "AttentionInputs",
    "KVHandle",
    "Mask",
    "BlockStatus",
    "Band",
    "MaskSupport",
    "Causal",
    "SlidingWindow",
    "KeyPadding",
    "Padding",
    "Document",
    "Dense",
    "Custom",
    "BlockSparse",
    "GlobalTokens",
    "longformer",
    "TopK",
    "And",
    "Or",
    "as_mask",
    "from_key_padding_mask",
    "Backend",
    "list_backends",
    "get_backend",
    "register_backend",
    "approximation_error",
    "RecurrentState",
    "gated_linear_attention",
    "explain_gated",
    "GatedLinearState",
    "KVCache",
    "DynamicLayerCache",
    "StaticLayerCache",
    "SlidingWindowLayerCache",
    "StateCache",
    "generate",
]
