"""The native kernel's operators, ``torch.ops.attnkit_native.forward`` and ``.backward``, made traceable.

The C++ file defines the operators and their CPU kernels; this module registers, through
``torch.library``, what PyTorch needs beyond that:

* **fake (meta) kernels**, so ``torch.compile`` (and ``torch.export``) trace the operators without
  running them: output shapes and dtypes come from the inputs alone (:func:`forward_outputs`, the
  one place to edit when the schema changes, with :func:`backward_outputs`);
* **autograd**: the forward's backward is the ``backward`` operator, fed the saved log-sum-exp
  (FlashAttention-2's recomputation), so eager autograd, ``torch.compile`` and ``torch.func`` all
  differentiate through one formula. The backward also returns the gradients of the additive bias
  and of the score modifiers' distance vectors; the sinks' gradient is computed here from the LSE.
  Eager calls that need gradients take the same two functions as a plain ``autograd.Function``
  (:func:`forward`), which skips ``torch.library``'s per-call argument handling.

:func:`register` runs once, right after the extension's library is loaded.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["forward", "forward_outputs", "backward_outputs", "register", "FORWARD", "BACKWARD"]

FORWARD = "attnkit_native::forward"
BACKWARD = "attnkit_native::backward"
_REGISTERED: list[bool] = []

# The forward's arguments after (q, k, v) are the kernel's settings (scale, offsets, tile sizes, the
# mask's structure as data, the score modifiers as data: bias, dist, dmin, ops, caps, sinks) and last
# the key flags ``bad``; the backward takes the same settings, in the same order, after (q, k, v, dout,
# lse, delta), then ``need_dist, need_dbias``. A new setting is one more argument in both schemas.
_SETTINGS = slice(3, -1)


def _stat_dtype(q: Tensor) -> torch.dtype:
    """The scores', statistics' and modifiers' dtype: float32 for 16-bit inputs, else q's."""
    return torch.promote_types(q.dtype, torch.float32)


def forward_outputs(q: Tensor, k: Tensor, v: Tensor, bad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Empty tensors shaped like the forward's outputs: ``out (B, Hq, Tq, Dv)`` in q's dtype, ``lse
    (B, Hq, Tq)`` (float32 for 16-bit inputs, else q's dtype) and ``hit``, the rows that saw a flagged
    key: ``(B, Hq, Tq)`` uint8, or ``(0,)`` when no key flags are passed (``bad`` empty)."""
    B, Hq, Tq = q.shape[:3]
    hit_shape = (B, Hq, Tq) if bad.numel() else (0,)
    return (q.new_empty((B, Hq, Tq, v.shape[-1])), q.new_empty((B, Hq, Tq), dtype=_stat_dtype(q)),
            bad.new_empty(hit_shape))


def backward_outputs(q: Tensor, k: Tensor, v: Tensor, dist: Tensor, need_dist: bool,
                     need_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Empty tensors shaped like the backward's outputs: ``dq, dk, dv`` like q, k, v; ``d_dist`` like
    ``dist (n_add, Hq, ndist)`` when ``need_dist`` and there is one, and ``dbias (B, Hq, Tq, Tk)`` when
    ``need_dbias`` (both in the statistics' dtype; ``(0,)`` when not computed)."""
    stat = _stat_dtype(q)
    d_dist = q.new_empty(tuple(dist.shape) if need_dist and dist.dim() == 3 else (0,), dtype=stat)
    dbias = q.new_empty((*q.shape[:3], k.shape[2]) if need_dbias else (0,), dtype=stat)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), d_dist, dbias


def _forward_fake(q, k, v, *settings_and_flags):
    return forward_outputs(q, k, v, settings_and_flags[-1])


def _backward_fake(q, k, v, dout, lse, delta, *settings_and_needs):
    *_, dist, _dmin, _ops, _caps, _sinks, need_dist, need_dbias = settings_and_needs
    return backward_outputs(q, k, v, dist, need_dist, need_dbias)


@functools.cache
def _index() -> dict[str, int]:
    """The forward's argument positions by name (from the registered schema)."""
    schema = torch.ops.attnkit_native.forward.default._schema
    return {a.name: i for i, a in enumerate(schema.arguments)}


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse, _ = output
    settings = inputs[_SETTINGS]
    # tensors (mask data, bias, distance vectors, sinks) saved as autograd saves them; the rest kept
    tensors = [i for i, x in enumerate(settings) if isinstance(x, Tensor)]
    ctx.save_for_backward(q, k, v, out, lse, *(settings[i] for i in tensors))
    ctx.settings = list(settings)
    ctx.tensor_settings = tensors
    for i in tensors:
        ctx.settings[i] = None
    ctx.num_inputs = len(inputs)


def _backward(ctx, dout, dlse, _dhit):
    q, k, v, out, lse, *saved = ctx.saved_tensors
    settings = list(ctx.settings)
    for i, x in zip(ctx.tensor_settings, saved):
        settings[i] = x
    index = _index()
    bias, dist, sinks = (settings[index[name] - _SETTINGS.start] for name in ("bias", "dist", "sinks"))
    need = ctx.needs_input_grad
    need_bias, need_dist, need_sinks = (bool(need[index[name]]) for name in ("bias", "dist", "sinks"))
    # delta_i = sum_j p_ij dp_ij = rowsum(dout * out), in the statistics' type (float32 for bfloat16/float16
    # tiles); the LSE's own gradient enters as -dlse.
    if dout is None:
        dout = torch.zeros_like(out)
    dout = dout.contiguous()
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    dq, dk, dv, d_dist, dbias = torch.ops.attnkit_native.backward(q, k, v, dout, lse, delta.contiguous(), *settings,
                                                                  need_dist, need_bias)
    grads_in: list = [dq, dk, dv] + [None] * (ctx.num_inputs - 3)
    if need_bias:  # (B, Hq, Tq, Tk): autograd reduces it to the bias's own shape through its expand
        grads_in[index["bias"]] = dbias
    if need_dist:  # (n_add, Hq, ndist): autograd carries it on to ALiBi slopes and relative-bias tables
        grads_in[index["dist"]] = d_dist
    if need_sinks:  # d loss / d sink_h = -sum over h's rows of p_sink delta, p_sink = exp(sink - lse)
        p_sink = torch.exp(sinks.view(1, -1, 1) - lse)
        p_sink = torch.where(lse == float("-inf"), torch.zeros_like(p_sink), p_sink)  # a -inf sink, no key
        grads_in[index["sinks"]] = -(p_sink * delta).sum(dim=(0, 2))
    return tuple(grads_in)


class _Eager(torch.autograd.Function):
    """The registered autograd of the forward operator, as a plain ``autograd.Function``: the same
    :func:`_setup_context` and :func:`_backward`, without the per-call argument handling of
    ``torch.library``'s wrapper (which rebuilds the schema's argument list: about 0.2 ms a call,
    the whole kernel's time at small sizes). Inside ``forward`` grad mode is off, so the operator's
    own autograd is not entered."""

    @staticmethod
    def forward(ctx, *inputs):
        output = torch.ops.attnkit_native.forward(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return _backward(ctx, *grads)


def forward(*inputs) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.attnkit_native.forward(*inputs)``, differentiable: eager calls that need gradients
    go through :class:`_Eager`; ``torch.compile``, ``torch.func`` transforms and calls without
    gradients call the operator (and its registered autograd) itself."""
    if (torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in inputs)
            and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()):
        return _Eager.apply(*inputs)
    return torch.ops.attnkit_native.forward(*inputs)


def register() -> None:
    """Register the fake kernels and autograd of the loaded operators (once per process)."""
    if _REGISTERED:
        return
    torch.library.register_fake(FORWARD)(_forward_fake)
    torch.library.register_fake(BACKWARD)(_backward_fake)
    torch.library.register_autograd(FORWARD, _backward, setup_context=_setup_context)
    _REGISTERED.append(True)
