"""Built-in backends; importing this package registers them (in this order)."""

from . import naive, sdpa  # noqa: F401
from . import linear, lsh, performer  # noqa: F401  (approximate: used only when named)
