"""transformers' linear-attention layers on attnkit's kernels: Qwen3-Next and Qwen3.5 (gated delta
rule), Kimi-Linear (KDA) and Mamba2 (SSD).

Those models call module-level functions ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` (and ``chunk_kimi_delta_attention`` /
``recurrent_kimi_delta_attention``) with flash-linear-attention's signature and the
``(B, T, H, D)`` layout; Mamba2 calls ``mamba2_chunk_scan`` / ``mamba2_selective_state_update``
with mamba_ssm's (SSD as gated linear attention: ``q = C``, ``k = B``, ``v = x·dt``, ``g = A·dt``,
its state ``(B, H, P, N)`` is attnkit's ``(B, H, N, P)`` transposed).
:func:`use_attnkit_linear_attention` swaps them, for the duration of a
``with`` block, for adapters over :func:`attnkit.gated_linear_attention`, so prefill, training
(gradients by autograd through the chunked form) and ``generate()`` (one-token steps on the
recurrent form, state kept in the model's own cache) run on attnkit::

    with use_attnkit_linear_attention():
        logits = model(input_ids).logits
        out = model.generate(input_ids, max_new_tokens=8)
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends.kernelized.gated import gated_linear_attention
from ._deps import require

__all__ = ["use_attnkit_linear_attention", "chunk_rule_hf", "recurrent_rule_hf", "mamba2_chunk_scan_hf",
           "mamba2_state_update_hf"]


def _call(method: str, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, *,
          initial_state, output_final_state: bool, use_qk_l2norm_in_kernel: bool, chunk_size: int | None,
          cu_seqlens) -> tuple[Tensor, Tensor | None]:
    q, k, v, g_, b = (x.transpose(1, 2) for x in (query, key, value, g, beta))  # (B, H, T, ...)
    o, state = gated_linear_attention(q, k, v, g_, b, qk_l2norm=use_qk_l2norm_in_kernel, initial_state=initial_state,
                                      return_state=True, cu_seqlens=cu_seqlens, method=method,
                                      chunk_size=chunk_size, check_gates=False)
    return o.transpose(1, 2).contiguous(), (state if output_final_state else None)  # (B, T, Hv, Dv)


def chunk_rule_hf(query, key, value, g, beta, chunk_size: int = 64, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """flash-linear-attention's ``chunk_gated_delta_rule`` / ``chunk_kda`` signature, ``(B, T, H, D)``
    layout; per-channel ``g (B, T, H, Dk)`` runs KDA."""
    return _call("chunked", query, key, value, g, beta, initial_state=initial_state,
                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 chunk_size=chunk_size, cu_seqlens=cu_seqlens)


def recurrent_rule_hf(query, key, value, g, beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """flash-linear-attention's ``fused_recurrent_*`` signature: the decode step."""
    return _call("recurrent", query, key, value, g, beta, initial_state=initial_state,
                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 chunk_size=None, cu_seqlens=cu_seqlens)


def _mamba2_dt(dt: Tensor, dt_bias, dt_softplus: bool, dt_limit=(0.0, float("inf"))) -> Tensor:
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def mamba2_chunk_scan_hf(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                         dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **kwargs):
    """mamba_ssm's ``mamba_chunk_scan_combined``: ``x (B, T, H, P)``, ``dt (B, T, H)``, ``A (H,)``,
    ``B, C (B, T, G, N)``; returns ``y (B, T, H, P)`` (and the state ``(B, H, P, N)``)."""
    dt = _mamba2_dt(dt, dt_bias, dt_softplus, dt_limit).float()
    x = hidden_states.float()
    v = (x * dt[..., None]).transpose(1, 2)  # (B, H, T, P)
    g = (A.float() * dt).transpose(1, 2)  # (B, H, T)
    q, k = C.float().transpose(1, 2), B.float().transpose(1, 2)  # (B, G, T, N)
    state = None if initial_states is None else initial_states.float().transpose(-1, -2)
    y, final = gated_linear_attention(q, k, v, g, None, scale=1.0, initial_state=state, return_state=True,
                                      method="chunked", chunk_size=chunk_size, check_gates=False)
    y = y.transpose(1, 2)  # (B, T, H, P)
    if D is not None:
        y = y + D.float()[:, None] * x
    if z is not None:
        y = y * F.silu(z)
    return (y, final.transpose(-1, -2)) if return_final_states else y


def mamba2_state_update_hf(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None,
                           **kwargs):
    """mamba_ssm's ``selective_state_update`` for one token (its per-``P`` expansions of ``dt``,
    ``A``, ``D``, ``dt_bias`` are constant along ``P``); updates ``state (B, H, P, N)`` in place."""
    dt = _mamba2_dt(dt[..., 0], None if dt_bias is None else dt_bias[..., 0], dt_softplus).float()  # (B, H)
    x = hidden_states.float()  # (B, H, P)
    v = (x * dt[..., None])[:, :, None]  # (B, H, 1, P)
    g = (A[:, 0, 0].float() * dt)[:, :, None]  # (B, H, 1)
    q, k = C.float()[:, :, None], B.float()[:, :, None]  # (B, G, 1, N)
    y, final = gated_linear_attention(q, k, v, g, None, scale=1.0, initial_state=state.float().transpose(-1, -2),
                                      return_state=True, method="recurrent", check_gates=False)
    state.copy_(final.transpose(-1, -2).to(state.dtype))
    y = y[:, :, 0]
    if D is not None:
        y = y + x * D.float()
    if z is not None:
        y = y * F.silu(z)
    return y.to(hidden_states.dtype)


#: module -> {function name: adapter}
_TARGETS = {
    "transformers.models.qwen3_next.modeling_qwen3_next": {
        "torch_chunk_gated_delta_rule": chunk_rule_hf, "torch_recurrent_gated_delta_rule": recurrent_rule_hf},
    "transformers.models.qwen3_5.modeling_qwen3_5": {
        "torch_chunk_gated_delta_rule": chunk_rule_hf, "torch_recurrent_gated_delta_rule": recurrent_rule_hf},
    "transformers.models.kimi_linear.modeling_kimi_linear": {
        "chunk_kimi_delta_attention": chunk_rule_hf, "recurrent_kimi_delta_attention": recurrent_rule_hf},
    "transformers.models.mamba2.modeling_mamba2": {
        "mamba2_chunk_scan": mamba2_chunk_scan_hf, "mamba2_selective_state_update": mamba2_state_update_hf},
}


@contextlib.contextmanager
def use_attnkit_linear_attention() -> Iterator[list[str]]:
    """Within the block, the models above run their gated-delta / KDA / SSD layers on attnkit; yields the
    modules patched (a model whose module is missing from this transformers version is skipped).
    The original functions are restored on exit, also after an exception."""
    require("transformers", "use_attnkit_linear_attention")
    saved = []
    try:
        for name, functions in _TARGETS.items():
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for fn_name, adapter in functions.items():
                if hasattr(module, fn_name):
                    saved.append((module, fn_name, getattr(module, fn_name)))
                    setattr(module, fn_name, adapter)
        yield sorted({m.__name__ for m, _, _ in saved})
    finally:
        for module, fn_name, original in reversed(saved):
            setattr(module, fn_name, original)
