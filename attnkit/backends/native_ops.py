"""The native kernel's operators, ``torch.ops.attnkit_native.forward`` and ``.backward``, made traceable.

The C++ file defines the operators and their CPU kernels; this module registers, through
``torch.library``, what PyTorch needs beyond that:

* **fake (meta) kernels**, so ``torch.compile`` (and ``torch.export``) trace the operators without
  running them: output shapes and dtypes come from the inputs alone (:func:`forward_outputs`, the
  one place to edit when the schema changes);
* **autograd**: the forward's backward is the ``backward`` operator, fed the saved log-sum-exp
  (FlashAttention-2's recomputation), so eager autograd, ``torch.compile`` and ``torch.func`` all
  differentiate through one formula.

:func:`register` runs once, right after the extension's library is loaded.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["forward_outputs", "register", "FORWARD", "BACKWARD"]

FORWARD = "attnkit_native::forward"
BACKWARD = "attnkit_native::backward"
_REGISTERED: list[bool] = []

# The forward's arguments after (q, k, v) are the kernel's settings (scale, offsets, tile sizes, the
# mask's structure as data) and last the key flags ``bad``; the backward takes the same settings, in the
# same order, after (q, k, v, dout, lse, delta). A new setting is one more argument in both schemas.
_SETTINGS = slice(3, -1)


def forward_outputs(q: Tensor, k: Tensor, v: Tensor, bad: Tensor) -> list[Tensor]:
    """Empty tensors shaped like the forward's outputs: ``out (B, Hq, Tq, Dv)`` in q's dtype, ``lse
    (B, Hq, Tq)`` (float32 for 16-bit inputs, else q's dtype) and ``hit``, the rows that saw a flagged
    key: ``(B, Hq, Tq)`` uint8, or ``(0,)`` when no key flags are passed (``bad`` empty)."""
    B, Hq, Tq = q.shape[:3]
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    hit_shape = (B, Hq, Tq) if bad.numel() else (0,)
    return [q.new_empty((B, Hq, Tq, v.shape[-1])), q.new_empty((B, Hq, Tq), dtype=lse_dtype),
            bad.new_empty(hit_shape)]


def _forward_fake(q, k, v, *settings_and_flags):
    return forward_outputs(q, k, v, settings_and_flags[-1])


def _backward_fake(q, k, v, dout, lse, delta, *settings):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.settings = inputs[_SETTINGS]
    ctx.num_inputs = len(inputs)


def _backward(ctx, grads):
    dout, dlse, _ = grads
    q, k, v, out, lse = ctx.saved_tensors
    # delta_i = sum_j p_ij dp_ij = rowsum(dout * out), in the statistics' type (float32 for bfloat16/float16
    # tiles); the LSE's own gradient enters as -dlse.
    if dout is None:
        dout = torch.zeros_like(out)
    dout = dout.contiguous()
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    dq, dk, dv = torch.ops.attnkit_native.backward(q, k, v, dout, lse, delta.contiguous(), *ctx.settings)
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)


def register() -> None:
    """Register the fake kernels and autograd of the loaded operators (once per process)."""
    if _REGISTERED:
        return
    torch.library.register_fake(FORWARD)(_forward_fake)
    torch.library.register_fake(BACKWARD)(_backward_fake)
    torch.library.register_autograd(FORWARD, _backward, setup_context=_setup_context)
    _REGISTERED.append(True)
