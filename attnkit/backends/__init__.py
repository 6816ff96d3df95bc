"""Built-in backends; importing this package registers them (in this order)."""

from . import naive, sdpa, tiled  # noqa: F401
