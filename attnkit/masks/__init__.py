"""Masks: where attention is allowed (True = attend), over absolute positions.

``base`` holds the :class:`Mask` protocol, its structure API and ``And``/``Or``; ``positional``
the masks defined by positions and a few integers or index vectors; ``tensor`` the masks given as
data (``Dense``, ``Custom``); ``sparse`` block layouts and global tokens; ``topk`` per-query key
lists (``TopK``); ``support`` the mask forms a backend declares it honours (:class:`MaskSupport`);
``export`` the structure as data a kernel reads (:func:`tile_grid`, :func:`mask_params`).
"""

from .base import And, Dense, Mask, Or, as_mask
from .structure import UNBOUNDED, Band, BlockStatus, Range
from .export import MaskParams, Tiles, mask_params, tile_grid
from .positional import Causal, Document, KeyPadding, Padding, SlidingWindow
from .sparse import BlockSparse, GlobalTokens, longformer
from .topk import TopK
from .support import MaskSupport
from .tensor import Custom, from_key_padding_mask

__all__ = [
    "BlockStatus",
    "Band",
    "UNBOUNDED",
    "Range",
    "Mask",
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
    "MaskSupport",
    "from_key_padding_mask",
    "Tiles",
    "MaskParams",
    "tile_grid",
    "mask_params",
]
