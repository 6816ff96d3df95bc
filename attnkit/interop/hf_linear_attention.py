"""transformers' linear-attention layers on attnkit's kernels: Qwen3-Next and Qwen3.5 (gated delta
rule) and Kimi-Linear (KDA).

Those models call module-level functions ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` (and ``chunk_kimi_delta_attention`` /
``recurrent_kimi_delta_attention``) with flash-linear-attention's signature and the
``(B, T, H, D)`` layout. :func:`use_attnkit_linear_attention` swaps them, for the duration of a
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

from torch import Tensor

from ..backends.kernelized.gated import gated_linear_attention
from ._deps import require

__all__ = ["use_attnkit_linear_attention", "chunk_rule_hf", "recurrent_rule_hf"]


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


#: module -> {function name: adapter}
_TARGETS = {
    "transformers.models.qwen3_next.modeling_qwen3_next": {
        "torch_chunk_gated_delta_rule": chunk_rule_hf, "torch_recurrent_gated_delta_rule": recurrent_rule_hf},
    "transformers.models.qwen3_5.modeling_qwen3_5": {
        "torch_chunk_gated_delta_rule": chunk_rule_hf, "torch_recurrent_gated_delta_rule": recurrent_rule_hf},
    "transformers.models.kimi_linear.modeling_kimi_linear": {
        "chunk_kimi_delta_attention": chunk_rule_hf, "recurrent_kimi_delta_attention": recurrent_rule_hf},
}


@contextlib.contextmanager
def use_attnkit_linear_attention() -> Iterator[list[str]]:
    """Within the block, the models above run their gated-delta / KDA layers on attnkit; yields the
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
