"""Built-in backends; importing this package registers them (in this order)."""

from . import naive, sdpa  # noqa: F401
from .kernelized import linear  # noqa: F401  (approximate: used only when named)
from . import lsh  # noqa: F401
from .kernelized import performer  # noqa: F401
from . import block_sparse, sliding_window, tiled, topk  # noqa: F401  (exact at scale)
from . import decode  # noqa: F401  (few queries over a long cache)
from . import native, flex  # noqa: F401  (fused kernels; native first: flex on CPU compiles per mask kind)
