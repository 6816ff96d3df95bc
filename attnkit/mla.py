"""Absorbed multi-head latent attention (MLA): attention directly over a latent KV cache.

An MLA layer (DeepSeek-V2/V3) caches per token one latent ``c`` (``kv_lora_rank`` numbers) and a
rotary key ``k_pe`` (``rope_dim``), shared by every head (:mod:`attnkit.cache.latent`). Head
``h``'s key and value are up-projections of the latent, ``k_h = [W_UK_h c | k_pe]`` and
``v_h = W_UV_h c``, so its score and output can be taken over the latents themselves::

    q_h · k_h = (W_UK_hᵀ q_nope_h) · c + q_pe_h · k_pe = [W_UK_hᵀ q_nope_h | q_pe_h] · [c | k_pe]
    Σ p v_h   = W_UV_h (Σ p c)

That is one MQA with head dim ``kv_lora_rank + rope_dim`` (576) whose values are the first
``kv_lora_rank`` (512) columns of its keys::

    absorbed queries  (B, H, Tq, 576) = [ W_UKᵀ q_nope (512) | q_pe (64) ]
                                         │ scores with every cached row
    cached rows       (B, 1, Tk, 576) = [ c (512)             | k_pe (64) ]
                                          └── values: a view of the same rows
    latent output     (B, H, Tq, 512) = softmax(scores · scale) c      -> W_UV per head -> (B, H, Tq, 128)

:func:`mla_decode` runs that attention on the ``decode`` backend: the native split-K decode
kernel reads each cached row once for the scores and values of all heads (values are passed as a
strided view of the keys, in dense, paged and int8 storage alike), split over the keys so batch
1 with one K/V head uses every core; its PyTorch-op twin runs where the kernel cannot. The
scale is the one of the non-absorbed form, ``(qk_nope_head_dim + rope_dim) ** -0.5`` in
DeepSeek, not the absorbed head dim's.
"""

from __future__ import annotations

from torch import Tensor

from .backends.decode import DecodeOptions
from .backends.decode_native import KERNEL_MAX_QUERIES
from .cache.latent import alias_values
from .functional import attention
from .kv_handle import KVHandle
from .masks import Mask

__all__ = ["mla_decode"]

_IMPLEMENTATIONS = ("auto", "native", "torch")


def mla_decode(q: Tensor, k: Tensor | KVHandle, *, kv_lora_rank: int, scale: float, mask: Mask | Tensor | None = None,
               q_offset: int | None = None, kv_offset: int = 0, implementation: str = "auto",
               kv_finite: bool | None = None, return_lse: bool = False):
    """Absorbed MLA attention over latent rows; returns the latent outputs ``(B, H, Tq, kv_lora_rank)``.

    Args:
        q: absorbed queries ``(B, H, Tq, kv_lora_rank + rope_dim)``: per head ``[W_UKᵀ q_nope | q_pe]``.
        k: the cached rows ``(B, 1, Tk, kv_lora_rank + rope_dim)`` (``[latent | rotary key]``), or
            what a latent cache's update returned (a tensor or an int8/paged handle). The values
            are its first ``kv_lora_rank`` columns, never a copy.
        kv_lora_rank: the latent width (512 in DeepSeek-V3).
        scale: the score scale of the non-absorbed form (DeepSeek: ``(qk_nope_head_dim + rope_dim) ** -0.5``,
            times its YaRN factor where it has one).
        mask, q_offset, kv_offset, kv_finite, return_lse: as in :func:`attnkit.attention`
            (``Causal()`` for chunked or speculative decoding).
        implementation: ``"auto"`` (the native decode kernel where it runs, else its PyTorch-op
            twin), ``"native"`` (the kernel, or ``ValueError`` with its reasons) or ``"torch"`` (the
            twin). Calls the decode backend cannot take (gradients; more than 16 queries) go
            through :func:`attnkit.attention`'s dispatcher with ``implementation="auto"``, and so do
            masks with ``TopK`` key lists (DeepSeek-V3.2): the ``topk`` backend reads the listed rows only.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation: expected one of {_IMPLEMENTATIONS}, got {implementation!r}.")
    if not isinstance(kv_lora_rank, int) or isinstance(kv_lora_rank, bool) or kv_lora_rank < 1:
        raise ValueError(f"kv_lora_rank: expected a positive int (512 in DeepSeek-V3), got {kv_lora_rank!r}.")
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q: expected absorbed queries (B, H, Tq, kv_lora_rank + rope_dim), got "
                         f"{tuple(getattr(q, 'shape', ())) or type(q).__name__}.")
    width = k.shape[-1] if isinstance(k, (Tensor, KVHandle)) else None
    if width is None or width <= kv_lora_rank or q.shape[-1] != width:
        raise ValueError(f"k: expected latent rows (B, 1, Tk, kv_lora_rank + rope_dim) wider than kv_lora_rank="
                         f"{kv_lora_rank} and as wide as q ({q.shape[-1]}), got "
                         f"{tuple(k.shape) if width is not None else type(k).__name__}. Fix: cache "
                         "torch.cat([latent, rotary_key], -1) and absorb W_UK into the queries.")
    if scale is None:
        raise ValueError("scale: MLA scores use the non-absorbed head dim's scale, not the latent width's. "
                         "Fix: pass scale=(qk_nope_head_dim + qk_rope_head_dim) ** -0.5.")
    k, v = alias_values(k, kv_lora_rank)
    grads = q.requires_grad or (isinstance(k, Tensor) and k.requires_grad)
    lists = isinstance(mask, Mask) and mask.topk() is not None  # TopK: the topk backend reads the listed rows
    on_decode = q.shape[2] <= KERNEL_MAX_QUERIES and not grads and not lists
    if on_decode or implementation != "auto":
        backend, options = "decode", DecodeOptions(implementation=implementation)
    else:
        backend, options = "auto", None
    return attention(q, k, v, scale=scale, mask=mask, q_offset=q_offset, kv_offset=kv_offset, backend=backend,
                     options=options, kv_finite=kv_finite, return_lse=return_lse)
