"""The native gated kernel (``attnkit/csrc/gated.cpp``, family ``gated``): what it runs, and why not.

Two operations, each equal to its PyTorch twin:

* ``chunked(q, k, v, g, beta, initial_state, C)``: every chunked rule — the gated delta rule
  (``beta`` given, per-head gates ``g (B, H, T)``), SSD (``beta`` None, per-head gates), KDA
  (``beta`` given, per-channel gates ``g (B, H, T, Dk)``) and GLA (``beta`` None, per-channel
  gates) — forward and a hand-written backward; the twins are ``gated_delta.chunk_gated_delta_rule``,
  ``ssd.chunk_ssd`` and ``kda.chunk_kda`` (and the recurrence, ``recurrence.recurrent_rule``, which
  they all equal). Work is parallel over (batch, head) and repeats
  bitwise at one thread count.
* ``step(q, k, v, g, beta, state)``: the recurrence itself for a few tokens (decode), every rule
  (per-head or per-channel gates, with or without ``beta``), updating ``state`` in place; its twin
  is ``recurrence.recurrent_rule``. It has no backward: under autograd the twin runs.

Inputs are those of the rules after ``rule.prepare``: float32 (float64 runs the PyTorch path), key
heads matched, ``q`` scaled. :func:`chunked_reason` and :func:`step_reason` say why the kernel declines
(``None``: it runs); ``explain_gated`` prints them.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["chunked", "step", "chunked_reason", "step_reason", "extension_reason"]


@functools.lru_cache(maxsize=1)
def _extension():
    """``(torch.ops.attnkit_gated, None)`` when the gated family's library loads, else ``(None, reason)``."""
    from ....csrc import loader  # imported late: ``import attnkit`` loads no library

    reason = loader.load_library("gated")
    if reason is not None:
        return None, reason
    ops = torch.ops.attnkit_gated
    if not all(hasattr(ops, name) for name in ("chunk_forward", "chunk_backward", "step")):
        return None, "native extension built without the gated kernel's ops: rebuild with `attnkit build`"
    _register_fakes()
    return ops, None


def extension_reason() -> str | None:
    """Why the gated kernel's library cannot be used here (None: it can; the ops are then loaded)."""
    return _extension()[1]


# A constant to ``torch.compile`` (as ``native.unavailable_reason``): it neither traces the file checks
# nor breaks the graph on them.
extension_reason._dynamo_marked_constant = True


def _register_fakes() -> None:
    """Fake kernels (shapes only), so ``torch.compile`` traces the ops."""
    lib = "attnkit_gated::"

    @torch.library.register_fake(lib + "chunk_forward")
    def _(q, k, v, g, beta, initial_state, chunk, keep):
        B, H, T, Dk = q.shape
        Dv = v.shape[-1]
        C = max(1, min(chunk, T))
        N = -(-T // C)
        delta = beta is not None
        return (q.new_empty(B, H, T, Dv), q.new_empty(B, H, Dk, Dv),
                q.new_empty(B * H, N, C, C) if keep and delta else q.new_empty(0),
                q.new_empty(B * H, N, Dk, Dv) if keep else q.new_empty(0),
                q.new_empty(B * H, N, C, Dv) if keep and delta else q.new_empty(0))

    @torch.library.register_fake(lib + "chunk_backward")
    def _(q, k, v, g, beta, inv, states, v_new, d_out, d_final, chunk):
        B, H = q.shape[:2]
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
                torch.empty_like(g) if beta is not None else g.new_empty(0),
                q.new_empty(B, H, q.shape[-1], v.shape[-1]))

    @torch.library.register_fake(lib + "step")
    def _(q, k, v, g, beta, state):
        return v.new_empty(v.shape)


def _common_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"CPU tensors only, got {device.type} tensors"
    if dtype != torch.float32:
        return f"float32 compute only, the compute dtype here is {str(dtype).removeprefix('torch.')}"
    return extension_reason()


def chunked_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why :func:`chunked` declines inputs of this compute ``dtype`` (None: it runs them)."""
    return _common_reason(device, dtype)


def step_reason(device: torch.device, dtype: torch.dtype, grad: bool) -> str | None:
    """Why :func:`step` declines (None: it runs); ``grad``: autograd records the call."""
    if grad:
        return "the recurrent step has no backward: under autograd the PyTorch recurrence runs"
    return _common_reason(device, dtype)


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, C):
        keep = any(ctx.needs_input_grad)
        o, final, inv, states, v_new = torch.ops.attnkit_gated.chunk_forward(q, k, v, g, beta, initial_state, C, keep)
        if keep:
            ctx.save_for_backward(q, k, v, g, beta, inv, states, v_new)
        ctx.C, ctx.has_state = C, initial_state is not None
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_final):
        q, k, v, g, beta, inv, states, v_new = ctx.saved_tensors
        if d_o is None:
            d_o = torch.zeros(q.shape[:3] + v.shape[-1:], dtype=q.dtype)
        dq, dk, dv, dg, dbeta, ds = torch.ops.attnkit_gated.chunk_backward(
            q, k, v, g, beta, inv, states, v_new, d_o.contiguous(), d_final, ctx.C)
        return dq, dk, dv, dg, dbeta if beta is not None else None, ds if ctx.has_state else None, None


def chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, initial_state: Tensor | None,
            chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Any chunked gated rule in the kernel (chosen by ``g``'s dims and ``beta``): ``(o, S_T)``,
    differentiable in every input and the initial state. Inputs as ``chunk_gated_delta_rule``
    (``g`` already clamped by ``scan.forgetting_gates``); ``chunk_size`` defaults to the PyTorch
    rules' (64 tokens; 16 for per-channel gates, whose ``Γ`` is ``C²·Dk`` numbers)."""
    if extension_reason() is not None:
        raise RuntimeError(f"the native gated kernel cannot run: {extension_reason()}")
    if chunk_size is None:
        chunk_size = 16 if g.dim() == 4 else 64
    C = max(1, min(chunk_size, q.shape[2]))
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    beta = None if beta is None else beta.contiguous()
    return _Chunked.apply(q, k, v, g, beta, initial_state, C)


def step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, state: Tensor) -> Tensor:
    """``T`` recurrent steps of any gated rule from ``state (B, H, Dk, Dv)`` float32 contiguous,
    which is updated in place; returns ``o (B, H, T, Dv)``. No autograd."""
    if extension_reason() is not None:
        raise RuntimeError(f"the native gated kernel cannot run: {extension_reason()}")
    return torch.ops.attnkit_gated.step(q, k, v, g, beta, state)
