"""Decode attention: few queries over a long KV cache, split over the keys with an LSE merge.

Decoding reads the whole cache for every new token, so its speed limit is memory bandwidth. This
kernel (flash-decoding, https://crfm.stanford.edu/2023/10/12/flashdecoding.html) splits the keys
into segments; each segment yields a partial result — its row max ``m``, its softmax mass ``l``
and ``sum_j exp(s_j - m) v_j`` — and the partials are merged exactly with their log-sum-exp.
It computes the same thing as the naive backend::

    softmax(q kᵀ · scale + bias, masked) v      (fully masked rows: 0, LSE -inf)

and differs only in how the keys are read:

* **GQA without expansion**: the ``G = Hq // Hkv`` query heads that share a K/V head are stacked
  into one ``(G·Tq, D)`` block, so every key is read once per K/V head (SDPA reads it ``G`` times).
* **Low-precision caches without a full-precision copy**: bf16/fp16 keys and int8 keys with
  per-token, per-head scales (:mod:`attnkit.cache.quantized`) are converted one segment at a time;
  the int8 scales are folded into the scores (``s = (q · k_int8) · k_scale``) and the
  probabilities (``p · v_scale``), so a segment's conversion is its only extra memory.
* **Paged caches**: the segments are gathered from a block pool through a block table, a bounded
  segment at a time (:mod:`attnkit.cache.paged`); the whole cache is never made contiguous.

Every segment is one batched matmul over ``(batch, K/V head)`` pairs, so PyTorch's intra-op
threads run the split across cores. Accumulation is in float32 (float64 for float64 inputs).
Batch invariance is the native kernel's promise (:mod:`attnkit.backends.decode_native`), not
this module's: here the segments, the splits and the matmuls take the batch's shapes (its size,
its longest row), so a row in a batch is close to, not bitwise equal to, the row alone.

The registered backend ``decode`` runs contiguous K/V (``backend="decode"``; for plain tensors
``auto`` picks SDPA first) and declares the KV cache formats it reads in place (``kv_formats``:
int8 and paged handles from :mod:`attnkit.cache`, see :mod:`attnkit.kv_handle`), so ``auto``
picks it for a cache handle whenever it can run the call. Its naive twin is the ``naive``
backend over the handle's dense conversion (tests compare both against the float64 oracle).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..inputs import AttentionInputs
from ..registry import Backend, Work, register_backend
from .decode_native import KERNEL_SCORE_MOD_KINDS, kernel_reasons, native_decode, qmode, qmode_note, reads_structure

__all__ = ["DecodeOptions", "decode_attention", "paged_decode_attention", "MAX_QUERIES"]

#: Above this many queries per call the score block ``(G·Tq, segment)`` stops being small and a
#: prefill kernel is the faster tool: the caches read themselves directly only up to this many
#: queries (the backend runs any ``Tq``, its segments shrink so the scores stay bounded).
MAX_QUERIES = 64

# Default segment size: the converted (float32) K and V of one segment for all (batch, head)
# pairs stay near this many bytes (reused buffers). Measured on a 2-core CPU at 16k context,
# GQA 32/8, D=128: 1024-token segments (8 MiB) were the fastest for int8 among 256..16384.
_SEGMENT_BYTES = 8 * 2**20
# A float32 cache needs no conversion: one segment, unless its scores (B·Hq·Tq·Tk floats)
# would pass this many bytes.
_SCORE_BYTES = 64 * 2**20
# Keys per split inside a segment: the unit of the LSE merge (parallel over heads x splits).
_SPLIT = 256


@dataclass(frozen=True)
class DecodeOptions:
    """``implementation``: ``"auto"`` runs the native decode kernel
    (:mod:`attnkit.backends.decode_native`) whenever it can run the call, else the PyTorch ops of
    this module; ``"torch"`` always runs the PyTorch ops (the kernel's twin); ``"native"`` requires
    the kernel (``ValueError`` with its reasons otherwise). ``native_split_tokens``: keys per split
    in the kernel (``None``: from each sequence's length and the thread count).

    For the PyTorch ops: ``segment_tokens``: keys read (and converted, for bf16/int8 caches) per
    step of the loop, rounded up to whole pages for paged caches; ``None`` picks about 8 MiB of
    converted K/V per segment for bf16/fp16/int8 caches, and for a float32 cache (read without
    conversion) one segment unless its scores would pass 64 MiB. ``split_tokens``:
    keys per split inside a segment, the unit of the log-sum-exp merge.

    Dot products of the native kernel (precision follows the CPU's features, never a timing):

    * ``bf16_dot``: bfloat16 queries over a bfloat16 cache run ``q·k`` as bf16 dot products with
      float32 accumulation (AVX512_BF16's ``vdpbf16ps``) where the CPU has them; ``False``, or
      elsewhere, converts the keys to float32 as they are read. Both multiply the stored values
      exactly (the summation order differs, and the instruction reads subnormal bfloat16 values,
      below 1.2e-38, as zero).
    * ``quantized_query`` (opt-in): an int8 cache's ``q·k`` runs as integer dot products
      (AVX512_VNNI's ``vpdpbusd``, else portable int32 vectors: the same integers) against ``q``
      quantized per row to int8 (step ``max|q| / 127``). The default reads the int8 cache exactly
      (keys converted to float32). The rounding of ``q`` perturbs each score by at most
      ``0.5 · step · Σ|k|`` times the scale (the bound on the output is in
      ``docs/guide/decoding.md``; the tests check it against the dequantized cache in float64).
      It applies to int8 caches only; other caches are read exactly either way."""

    segment_tokens: int | None = None
    split_tokens: int = _SPLIT
    implementation: str = "auto"
    native_split_tokens: int | None = None
    bf16_dot: bool = True
    quantized_query: bool = False

    def __post_init__(self):
        for name in ("segment_tokens", "split_tokens", "native_split_tokens"):
            s = getattr(self, name)
            if (s is not None or name == "split_tokens") and (not isinstance(s, int) or isinstance(s, bool) or s < 1):
                raise ValueError(f"DecodeOptions.{name}: expected a positive int, got {s!r}.")
        for name in ("bf16_dot", "quantized_query"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DecodeOptions.{name}: expected True or False, got {getattr(self, name)!r}.")
        if self.implementation not in ("auto", "native", "torch"):
            raise ValueError(f"DecodeOptions.implementation: expected 'auto', 'native' or 'torch', got "
                             f"{self.implementation!r}.")


@dataclass
class _Segment:
    """One split of the keys, laid out to broadcast against scores ``(P1, P2, G, Tq, C)``."""

    k: Tensor  # (P1, P2, C, D), any dtype
    v: Tensor  # (P1, P2, C, Dv)
    k_scale: Tensor | None  # (P1, P2, C) int8 dequantization scales
    v_scale: Tensor | None
    keep: Tensor | None  # bool, broadcastable to (P1, P2, G, Tq, C)
    bias: Tensor | None  # float, broadcastable to (P1, P2, G, Tq, C)


def _converted(x: Tensor, acc: torch.dtype, scratch: dict, name: str) -> Tensor:
    """``x`` in ``acc``: itself when it already is, else copied into a reused buffer (a hot,
    cache-sized scratch instead of a fresh allocation per segment)."""
    if x.dtype == acc:
        return x
    if x.requires_grad:  # autograd keeps each segment's conversion: no reuse
        return x.to(acc)
    buf = scratch.get(name)
    if buf is None or buf.shape != x.shape:
        buf = scratch[name] = torch.empty(x.shape, dtype=acc, device=x.device)
    return buf.copy_(x)


def _combine(a: tuple[Tensor, Tensor, Tensor], b: tuple[Tensor, Tensor, Tensor], dim: int | None = None):
    """Merge partial results ``(m, l, o)`` exactly: ``m`` the raw row max (``-inf`` when all of
    a part is masked), ``l = sum exp(s - m)``, ``o = sum exp(s - m) v``. With ``dim`` the parts
    are stacked along that axis of ``a`` (``b`` unused)."""
    if dim is not None:
        m_parts, l_parts, o_parts = a
        m = m_parts.amax(dim)
        w = torch.exp(m_parts - _finite(m).unsqueeze(dim))  # exp(-inf) = 0 for masked parts
        return m, (l_parts * w).sum(dim), (o_parts * w).sum(dim)
    m = torch.maximum(a[0], b[0])
    m_safe = _finite(m)
    wa, wb = torch.exp(a[0] - m_safe), torch.exp(b[0] - m_safe)
    return m, a[1] * wa + b[1] * wb, a[2] * wa + b[2] * wb


def _finite(m: Tensor) -> Tensor:
    """The row max with -inf (a fully masked row) replaced by 0, so exp(s - m) never sees NaN."""
    return m.masked_fill(torch.isinf(m), 0.0)


def _merge_segments(q: Tensor, segments: Iterator[_Segment], G: int, scale: float, acc: torch.dtype, split: int,
                    keys_finite: bool = False):
    """The split-K core: ``q (P1, P2, G·Tq, D)`` against each segment, each cut into splits of
    ``split`` keys whose partial results are merged by their log-sum-exp (vectorized over the
    splits, then sequentially over segments). Returns the output ``(P1, P2, G·Tq, Dv)`` in
    ``acc`` and the LSE ``(P1, P2, G·Tq)``. ``keys_finite``: the caller guarantees finite keys
    and values everywhere (its caches refuse NaN/Inf), so hidden keys need no zeroing."""
    P1, P2, M, _ = q.shape
    Tq = M // G
    qa = q.to(acc) * scale  # the scale folded into q once
    state = None
    scratch: dict[str, Tensor] = {}
    for seg in segments:
        k = _converted(seg.k, acc, scratch, "k")
        v = _converted(seg.v, acc, scratch, "v")
        if seg.keep is not None and not keys_finite:
            # Keys no query of a (batch, head) may see are zeroed, so NaN/Inf there cannot reach
            # the output (0 * NaN in p @ v) or the gradients (0 * NaN in ds @ k).
            dead = (~seg.keep.flatten(-3, -2).any(-2)).unsqueeze(-1)  # (P1|1, P2|1, C, 1)
            v = v.masked_fill(dead, 0)
            if torch.is_grad_enabled() and (k.requires_grad or q.requires_grad):
                k = k.masked_fill(dead, 0)  # forward needs no zeroing: masked scores become -inf anyway
        s = torch.matmul(qa, k.transpose(-2, -1))  # (P1, P2, M, C)
        C = s.shape[-1]
        if seg.k_scale is not None:
            s.mul_(seg.k_scale.unsqueeze(-2))
        if seg.bias is not None:
            s = (s.view(P1, P2, G, Tq, C) + seg.bias).reshape(P1, P2, M, C)
        if seg.keep is not None:
            s = s.view(P1, P2, G, Tq, C).masked_fill(~seg.keep, float("-inf")).view(P1, P2, M, C)
        n = C // split if C % split == 0 and C > split else 1  # splits of this segment
        c = C // n
        s = s.view(P1, P2, M, n, c).transpose(2, 3)  # (P1, P2, n, M, c)
        m = s.amax(-1, keepdim=True)  # raw split max: -inf for a fully masked split
        p = torch.exp(s - _finite(m))
        mass = p.sum(-1, keepdim=True)
        if seg.v_scale is not None:
            p.mul_(seg.v_scale.view(P1, P2, n, 1, c))
        o = torch.matmul(p, v.reshape(P1, P2, n, c, v.shape[-1]))  # (P1, P2, n, M, Dv): one bmm over splits
        part = _combine((m, mass, o), None, dim=2) if n > 1 else (m[:, :, 0], mass[:, :, 0], o[:, :, 0])
        state = part if state is None else _combine(state, part)
    m, mass, o = state
    out = o / torch.where(mass == 0, 1.0, mass)
    lse = (torch.log(mass) + _finite(m)).squeeze(-1)  # log(0) = -inf for fully masked rows
    return out, lse


def _segment_tokens(options: DecodeOptions | None, per_token_bytes: int, score_bytes: int, converts: bool,
                    total: int) -> int:
    """Keys per segment: ``per_token_bytes`` of converted K/V and ``score_bytes`` of scores per key."""
    if options is not None and options.segment_tokens is not None:
        return options.segment_tokens
    split = _split(options)
    if converts:
        return max(split, _SEGMENT_BYTES // max(per_token_bytes, 1) // split * split)
    return max(split, min(total, _SCORE_BYTES // max(score_bytes, 1) // split * split))


def _split(options: DecodeOptions | None) -> int:
    return _SPLIT if options is None else options.split_tokens


def _grouped(x: Tensor | None, Hkv: int, G: int, heads_first: bool) -> Tensor | None:
    """A mask or bias ``(B|1, Hq|1, Tq, Tk)`` as ``(B|1, Hkv|1, G|1, Tq, Tk)`` (view), batch and
    head dims swapped when ``heads_first``."""
    if x is None:
        return None
    while x.dim() < 4:
        x = x.unsqueeze(0)
    B_, H_, Tq_, Tk_ = x.shape
    x = x.reshape(B_, Hkv, G, Tq_, Tk_) if H_ != 1 else x.reshape(B_, 1, 1, Tq_, Tk_)
    return x.transpose(0, 1) if heads_first else x


def _finish(out: Tensor, lse: Tensor, B: int, Hq: int, Tq: int, dtype, heads_first: bool, return_lse: bool):
    if heads_first:
        out, lse = out.transpose(0, 1), lse.transpose(0, 1)  # (B, Hkv, G·Tq, ·)
    out = out.reshape(B, Hq, Tq, out.shape[-1]).to(dtype)  # (B, Hkv, G, Tq, Dv) -> (B, Hq, Tq, Dv)
    return (out, lse.reshape(B, Hq, Tq)) if return_lse else out


def decode_attention(q: Tensor, k: Tensor, v: Tensor, *, keep: Tensor | None = None, bias: Tensor | None = None,
                     scale: float | None = None, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                     options: DecodeOptions | None = None, return_lse: bool = False, keys_finite: bool = False):
    """Attention of ``q (B, Hq, Tq, D)`` over a contiguous cache ``k (B, Hkv, Tk, D)``,
    ``v (B, Hkv, Tk, Dv)`` of any float dtype, or int8 with ``k_scale``/``v_scale (B, Hkv, Tk)``
    (key ``j`` is ``k[..., j, :] * k_scale[..., j]``). ``keep``: a bool mask broadcastable to
    ``(B, Hq, Tq, Tk)`` (True = attend); ``bias``: additive scores of that shape. Returns
    ``(B, Hq, Tq, Dv)`` in q's dtype (and the float32 LSE ``(B, Hq, Tq)`` with ``return_lse``).
    ``keys_finite=True`` skips zeroing hidden keys (the caller's cache holds finite values only)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    bytes_acc = torch.finfo(acc).bits // 8
    per_token = B * Hkv * (k.shape[-1] + v.shape[-1]) * bytes_acc
    seg = _segment_tokens(options, per_token, B * Hq * Tq * bytes_acc, converts=k.dtype != acc, total=Tk)
    keep5, bias5 = _grouped(keep, Hkv, G, False), _grouped(bias, Hkv, G, False)

    def segments() -> Iterator[_Segment]:
        for t0 in range(0, Tk, seg):
            t1 = min(Tk, t0 + seg)
            yield _Segment(k[:, :, t0:t1], v[:, :, t0:t1],
                           None if k_scale is None else k_scale[:, :, t0:t1],
                           None if v_scale is None else v_scale[:, :, t0:t1],
                           None if keep5 is None else keep5[..., t0:t1],
                           None if bias5 is None else bias5[..., t0:t1])

    qg = q.reshape(B, Hkv, G * Tq, D)  # (B, Hkv, G·Tq, D): the query heads sharing a K/V head
    out, lse = _merge_segments(qg, segments(), G, scale, acc, _split(options), keys_finite)
    return _finish(out, lse, B, Hq, Tq, q.dtype, False, return_lse)


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, *,
                           keep: Tensor | None = None, bias: Tensor | None = None, scale: float | None = None,
                           k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                           options: DecodeOptions | None = None,
                           return_lse: bool = False, keys_finite: bool = False):
    """Attention of ``q (B, Hq, Tq, D)`` over a paged cache: pools ``k_pool (Hkv, N, bs, D)``,
    ``v_pool (Hkv, N, bs, Dv)`` (int8 with scales ``(Hkv, N, bs)``), and ``block_table (B, nb)``
    listing each row's blocks in order (key ``j`` of row ``b`` is slot ``j % bs`` of block
    ``block_table[b, j // bs]``). ``keep`` broadcastable to ``(B, Hq, Tq, nb·bs)`` must hide the
    slots past each row's length; ``bias`` (additive scores) broadcastable to the same shape.
    Pages are gathered one bounded segment at a time.
    ``keys_finite=True`` skips zeroing hidden slots (the pools hold finite values only)."""
    B, Hq, Tq, D = q.shape
    Hkv, _, bs, _ = k_pool.shape
    G = Hq // Hkv
    nb = block_table.shape[1]
    scale = D**-0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    bytes_acc = torch.finfo(acc).bits // 8
    per_token = B * Hkv * (k_pool.shape[-1] + v_pool.shape[-1]) * bytes_acc
    seg = _segment_tokens(options, per_token, B * Hq * Tq * bytes_acc, converts=True, total=nb * bs)
    seg_blocks = max(1, -(-seg // bs))
    keep5, bias5 = _grouped(keep, Hkv, G, True), _grouped(bias, Hkv, G, True)
    pages: dict[str, Tensor] = {}  # reused gather buffers

    def gather(name: str, pool: Tensor | None, cols: Tensor) -> Tensor | None:
        """This segment's pages ``(Hkv, B, n·bs, ...)``, copied into a reused buffer."""
        if pool is None:
            return None
        shape = (Hkv, cols.numel(), *pool.shape[2:])
        buf = pages.get(name)
        if buf is None or buf.shape != shape:
            buf = pages[name] = torch.empty(shape, dtype=pool.dtype, device=pool.device)
        torch.index_select(pool, 1, cols.reshape(-1), out=buf)  # (Hkv, B·n, bs, ...)
        return buf.view(Hkv, B, -1, *pool.shape[3:])

    def segments() -> Iterator[_Segment]:
        for j0 in range(0, nb, seg_blocks):
            cols = block_table[:, j0:j0 + seg_blocks]
            t0, t1 = j0 * bs, (j0 + cols.shape[1]) * bs
            yield _Segment(gather("k", k_pool, cols), gather("v", v_pool, cols), gather("ks", k_scale, cols),
                           gather("vs", v_scale, cols), None if keep5 is None else keep5[..., t0:t1],
                           None if bias5 is None else bias5[..., t0:t1])

    qg = q.reshape(B, Hkv, G * Tq, D).transpose(0, 1)  # (Hkv, B, G·Tq, D), like the pool
    out, lse = _merge_segments(qg, segments(), G, scale, acc, _split(options), keys_finite)
    return _finish(out, lse, B, Hq, Tq, q.dtype, True, return_lse)


def _NONE_REF():
    return None


class _KernelRuns(threading.local):
    """Per thread, a weakref to the inputs ``keeps_nonfinite`` just found the kernel runs: ``forward``,
    called next with them, takes it once instead of asking ``kernel_reasons`` again."""

    def __init__(self):
        self.ref = _NONE_REF


_KERNEL_RUNS = _KernelRuns()


@register_backend
class DecodeBackend(Backend):
    """``attention(..., backend="decode")``: few queries over contiguous K/V or a cache handle.

    Runs the native split-K decode kernel (:mod:`attnkit.backends.decode_native`) whenever it can
    (inference, float32/bfloat16/float16, ``Tq <= 16``), else :func:`decode_attention` /
    :func:`paged_decode_attention` in PyTorch ops, its twin. Equals the naive backend (same masked
    softmax, fp32 statistics); any mask, bias, GQA without expanding K/V, offsets, LSE. Score
    modifiers (``SoftCap``, ``ALiBi``, ``RelativeBias``) and sinks run in the kernel only. Gradients
    flow through the PyTorch ops (correct, not memory-optimized). With
    ``DecodeOptions(quantized_query=True)`` an int8 cache's scores come from integer dot products over
    a per-row int8 ``q`` (an opt-in error, stated on :class:`DecodeOptions`); everything else equals
    the twin to float32 rounding."""

    name = "decode"
    work = Work(materializes=True)  # its PyTorch-op twin builds (Tq, Tk) scores; the kernel: decodes()
    summary = "decode: few queries over long K/V or a cache, native split-K kernel (PyTorch-op twin), GQA in place"
    supports_bias = True
    supports_lse = True
    supports_score_mod = True  # in the native kernel only (extra_reasons says when it cannot run)
    score_mod_kinds = KERNEL_SCORE_MOD_KINDS
    supports_sinks = True
    Options = DecodeOptions
    #: KV caches read in place (:mod:`attnkit.kv_handle`): int8 values with their scales, pages
    #: through the block table.
    kv_formats = frozenset({"dense", "int8", "paged", "paged-int8"})

    @classmethod
    def extra_reasons(cls, inp: AttentionInputs):
        if inp.score_mod is not None or inp.sinks is not None:
            reasons = kernel_reasons(inp)
            if reasons:
                yield ("applies score_mod and sinks in the native decode kernel only, which cannot run: "
                       + "; ".join(reasons))
        if inp.kv_format == "dense":
            return
        if inp.Tq > MAX_QUERIES:
            yield (f"reads a cache in place for up to {MAX_QUERIES} queries, got Tq={inp.Tq} "
                   "(a prefill: dense is faster)")
        if inp.requires_grad:
            yield "reads a cache in place for inference only (the inputs require grad)"
        if inp.kv_finite is not True and kernel_reasons(inp):  # the kernel keeps the NaN/Inf contract itself
            yield ("reads a cache holding NaN/Inf in place only with the native decode kernel, which cannot run: "
                   + "; ".join(kernel_reasons(inp)))

    @classmethod
    def keeps_nonfinite(cls, inp: AttentionInputs, options: DecodeOptions | None) -> bool:
        """The native kernel keeps the NaN/Inf contract itself (:mod:`attnkit.backends.decode_native`),
        so its calls pay no scan of q, K and V; the PyTorch-op twin runs under the policy."""
        if options is not None and options.implementation == "torch":
            return False
        if kernel_reasons(inp):
            return False
        if inp.memo() is None:  # (with a memo, kernel_reasons is a look-up)
            _KERNEL_RUNS.ref = weakref.ref(inp)  # forward, called next with this inp, need not ask again
        return True

    @classmethod
    def decodes(cls, inp: AttentionInputs) -> bool:
        """The native decode kernel runs this call, reading the mask's structure (not a materialized mask)."""
        return (inp.mask is None or reads_structure(inp.mask, inp.B)) and not kernel_reasons(inp)

    @classmethod
    def dense_mask_elements(cls, inp: AttentionInputs) -> int:
        """The kernel reads band bounds and key lengths from the mask's structure; any other mask,
        and every mask on the PyTorch-op twin, is materialized ``(B, Hq, Tq, Tk)``."""
        if inp.mask is None or (reads_structure(inp.mask, inp.B) and not kernel_reasons(inp)):
            return 0
        return inp.B * inp.Hq * inp.Tq * inp.Tk

    @classmethod
    def describe(cls, inp: AttentionInputs) -> str:
        reasons = kernel_reasons(inp)
        if reasons:
            how = f"PyTorch-op split-K decode ({reasons[0]})"
        else:
            stored = (inp.k if inp.kv_format == "dense" else inp.k.k).dtype
            how = f"native C++ split-K decode kernel ({qmode_note(qmode(inp.dtype, stored))})"
        return (f"{how} over Tk={inp.Tk} keys, {inp.groups} query head(s) per K/V head read together, "
                "fp32 statistics")

    @classmethod
    def forward(cls, inp: AttentionInputs, options: DecodeOptions | None):
        implementation = "auto" if options is None else options.implementation
        if implementation != "torch":
            checked, _KERNEL_RUNS.ref = _KERNEL_RUNS.ref, _NONE_REF  # used once, by the call that set it
            reasons = [] if checked() is inp else kernel_reasons(inp)
            if not reasons:
                return native_decode(inp, options)
            if implementation == "native":
                raise ValueError("DecodeOptions(implementation='native'): the native decode kernel cannot run this "
                                 "call: " + "; ".join(reasons) + ". Fix: implementation='auto'.")
        if inp.score_mod is not None or inp.sinks is not None:
            raise ValueError("DecodeOptions(implementation='torch'): the PyTorch-op decode applies no score_mod or "
                             "sinks. Fix: implementation='auto' (the native kernel) or another backend.")
        if inp.kv_format != "dense":
            return _read_cache(inp, options)
        # K/V reach the twin finite (attnkit.backends.nonfinite zeroes NaN/Inf keys first: keeps_nonfinite
        # is False for it), so hidden keys need no zeroing per segment.
        return decode_attention(inp.q, inp.k, inp.v, keep=inp.materialize_mask(), bias=inp.bias, scale=inp.scale,
                                options=options, return_lse=inp.return_lse, keys_finite=True)


def _read_cache(inp: AttentionInputs, options: DecodeOptions | None):
    """A KV handle read in place. Its keys are finite (``extra_reasons``), so hidden slots need no
    zeroing; the mask and bias widen to the slots the storage spans (slots past ``Tk`` hidden)."""
    h = inp.k
    keep, bias, slots = inp.materialize_mask(), inp.bias, h.slots
    if slots > inp.Tk:
        if keep is None:
            keep = torch.ones(1, 1, 1, inp.Tk, dtype=torch.bool, device=inp.device)
        keep = torch.nn.functional.pad(keep, (0, slots - inp.Tk), value=False)
        if bias is not None:
            bias = torch.nn.functional.pad(bias, (0, slots - inp.Tk))
    if h.paged:
        result = paged_decode_attention(inp.q, h.k, h.v, h.block_table, keep=keep, bias=bias, scale=inp.scale,
                                        k_scale=h.k_scale, v_scale=h.v_scale, options=options, return_lse=True,
                                        keys_finite=True)
    else:
        result = decode_attention(inp.q, h.k, h.v, keep=keep, bias=bias, scale=inp.scale, k_scale=h.k_scale,
                                  v_scale=h.v_scale, options=options, return_lse=True, keys_finite=True)
    return result if inp.return_lse else result[0]
