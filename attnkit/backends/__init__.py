"""Built-in backends; importing this package registers them (in this order)."""

from . import block_sparse, naive, sdpa, sliding_window, tiled  # noqa: F401
from . import linear, lsh, performer  # noqa: F401  (approximate: used only when named)
