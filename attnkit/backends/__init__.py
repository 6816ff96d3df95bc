"""Built-in backends; importing this package registers them (in this order)."""

from . import naive, sdpa, sliding_window, tiled  # noqa: F401
