"""The native split-K decode kernel (``attnkit/csrc/decode.cpp``) behind the ``decode`` backend.

It computes what :func:`attnkit.backends.decode.decode_attention` computes (the PyTorch-op twin
and fallback)::

    softmax(q kᵀ · scale + bias -> score modifiers -> masked, sinks) v

in one pass over the cache in C++: parallel over (sequence, K/V head, split of the keys), each
K/V head read once for its whole query group, bf16/fp16/int8 keys and values converted as they are
read (int8 scales folded into scores and probabilities), pages read through the block table, the
splits merged by their log-sum-exp. Rows of a batch hold their own lengths (no padding to the
longest).

Batch invariance: a sequence's splits start at the first key its queries keep and their size
follows the span up to its last kept key and the thread count, whatever form the mask takes
(band bounds, key lengths, or a keep tensor such as a ragged batch's per-row mask), and each
split's reduction order is fixed. So at one thread count a row decodes to the same bits alone
or in any batch, under every mask, score modifier, sink and cache format the kernel reads; the
split size (and with it the last bits) may change with the thread count.

NaN/Inf: the kernel keeps :func:`attnkit.attention`'s contract itself (``DecodeBackend.keeps_nonfinite``),
so its calls pay no scan of q, K and V: it never reads keys outside a row's span, replaces the
score of a key a row may not see (never adds to it) and skips that key's value for the row; what a
row may see reaches that row through IEEE arithmetic only.

What the kernel reads (everything else: :func:`kernel_reasons` says why, and the twin runs):

* masks through their structure: the band bounds (``Causal``, ``SlidingWindow``: only the keys
  inside the band are read), ``KeyPadding`` lengths, and any other mask materialized as a byte
  keep tensor (``B·Hq·Tq·Tk`` bytes: small at ``Tq <= 16``);
* score modifiers ``SoftCap``, ``ALiBi`` and ``RelativeBias`` (in chain order, read through the kernel
  spec that the prefill kernel reads too: see :func:`attnkit.backends.native_ops.kernel_spec`), sinks,
  an additive bias;
* inference only (no gradients), float32/bfloat16/float16 queries, ``Tq <= 16``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..inputs import AttentionInputs
from ..masks import Mask, mask_params
from .native_ops import kernel_spec, tensor_state

__all__ = ["kernel_reasons", "native_decode", "split_tokens", "score_mod_reason", "reads_structure", "qmode",
           "dot_products", "qmode_note",
           "KERNEL_SCORE_MOD_KINDS", "KERNEL_MAX_QUERIES"]

#: The most queries one decode-kernel call takes (speculative and chunked decode); more is a prefill.
KERNEL_MAX_QUERIES = 16

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EMPTY_F = torch.empty(0)
_EMPTY_B = torch.empty(0, 1, 1, 1, dtype=torch.bool)
_EMPTY_L = torch.empty(0, dtype=torch.long)
# Split sizes: multiples of this many keys, at least _MIN_SPLIT and at most _MAX_SPLIT (a split's
# partial result is G·Tq·(Dv + 2) floats; bigger splits merge less, smaller ones balance threads).
_SPLIT_ALIGN, _MIN_SPLIT, _MAX_SPLIT = 256, 256, 4096


@functools.lru_cache(maxsize=1)
def _extension():
    """``(torch.ops.attnkit_decode, None)`` when the decode kernel's library loads, else ``(None, reason)``
    (its own library: the prefill kernel's state does not matter here)."""
    from ..csrc import loader  # imported late: ``import attnkit`` loads no library

    reason = loader.load_library("decode")
    if reason is not None:
        return None, reason
    ext = torch.ops.attnkit_decode
    if not (hasattr(ext, "decode") and hasattr(ext, "decode_spans")):
        return None, ("native extension built without this decode kernel (its ops decode and decode_spans): "
                      "rebuild with `python -m attnkit.csrc.build`")
    return ext, None


#: The score modifier kinds (:class:`~attnkit.score_mods.ScoreModTerm`) the kernel runs.
KERNEL_SCORE_MOD_KINDS = frozenset({"softcap", "alibi", "relative_bias"})


def score_mod_reason(score_mod) -> str | None:
    """Why the kernel cannot run ``score_mod`` (a term with no kernel form), or None. Kept per score
    modifier object (its terms' kinds never change; a model passes one object to every layer)."""
    if score_mod is None:
        return None
    found = _MOD_REASONS.get(id(score_mod))
    if found is not None and found[0] is score_mod:  # held with its answer: its id is not reused meanwhile
        return found[1]
    reason = None
    for term in score_mod.terms():
        if term.kind not in KERNEL_SCORE_MOD_KINDS:
            reason = (f"the native decode kernel runs the score modifiers "
                      f"{', '.join(sorted(KERNEL_SCORE_MOD_KINDS))}, not {term.kind} ({term.mod!r})")
            break
    if len(_MOD_REASONS) >= 32:
        _MOD_REASONS.clear()
    _MOD_REASONS[id(score_mod)] = (score_mod, reason)
    return reason


_MOD_REASONS: dict = {}  # id(score_mod) -> (score_mod, why the kernel cannot run it or None)


def kernel_reasons(inp: AttentionInputs) -> list[str]:
    """Why the native decode kernel cannot run ``inp`` ([] = it can; the list is not to be changed:
    it is kept in the dispatcher's memo, every input it reads being in the call's key)."""
    memo = inp.memo()
    if memo is not None:
        found = memo.get("decode_kernel_reasons")
        if found is None:
            found = memo["decode_kernel_reasons"] = _kernel_reasons(inp)
        return found
    return _kernel_reasons(inp)


def _kernel_reasons(inp: AttentionInputs) -> list[str]:
    if torch.compiler.is_compiling():  # checked first: loading the extension is not traceable
        return ["the native decode kernel is opaque to torch.compile (the PyTorch-op twin traces)"]
    reasons = []
    ext, reason = _extension()
    if ext is None:
        reasons.append(reason)
    if inp.device.type != "cpu":
        reasons.append(f"the native decode kernel runs on the CPU, not {inp.device.type}")
    if inp.dtype not in _KERNEL_DTYPES:
        reasons.append(f"the native decode kernel reads float32/bfloat16/float16 queries, not {inp.dtype}")
    if _functorch_wrapped(inp.q):
        reasons.append("the native decode kernel has no torch.func (vmap, grad) rule (the PyTorch-op twin runs)")
    if inp.Tq > KERNEL_MAX_QUERIES:
        reasons.append(f"the native decode kernel runs up to {KERNEL_MAX_QUERIES} queries, got Tq={inp.Tq}")
    if inp.requires_grad or (inp.sinks is not None and inp.sinks.requires_grad and torch.is_grad_enabled()):
        reasons.append("the native decode kernel has no backward pass (inputs require grad)")
    if inp.score_mod is not None:
        reason = score_mod_reason(inp.score_mod)
        if reason is not None:
            reasons.append(reason)
        elif torch.is_grad_enabled() and any(t.requires_grad for t in inp.score_mod.parameters()):
            reasons.append("the native decode kernel has no backward pass (learnable score modifier)")
    return reasons


def _functorch_wrapped(x: Tensor) -> bool:
    """True for a tensor under a torch.func transform (vmap, grad): the kernel has no batching rule."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check is not None and check(x))


def split_tokens(n: int, Hkv: int, threads: int | None = None) -> int:
    """Keys per split for a sequence whose decode reads ``n`` keys: enough splits that the
    ``Hkv`` heads of one sequence keep every thread busy, whole multiples of 256 keys. A function
    of the sequence alone (never of the batch), so batching changes no bit of its result."""
    threads = torch.get_num_threads() if threads is None else threads
    splits = max(1, -(-2 * threads // Hkv))
    per = -(-max(n, 1) // splits)
    return min(_MAX_SPLIT, max(_MIN_SPLIT, -(-per // _SPLIT_ALIGN) * _SPLIT_ALIGN))


def reads_structure(mask: Mask | None, batch_size: int = 1) -> bool:
    """True when the kernel reads ``mask`` from its exported parameters alone (band bounds and key
    lengths, :func:`~attnkit.masks.mask_params`), with no keep tensor materialized."""
    if mask is None:
        return True
    p = mask_params(mask, batch_size)
    return p.valid is None and p.doc is None and p.layout is None and len(p.rest) == 0  # (traceable: no `not tuple`)


def _mask_data(mask: Mask | None, inp: AttentionInputs):
    """``(left, right, key_limits, keep)``: band bounds (None = unbounded), per-row key-position
    limits (or None), and a bool keep tensor when the mask has parts beyond those (or None)."""
    if mask is None:
        return None, None, None, None
    p = mask_params(mask, inp.B)
    limits = None if p.lengths is None else p.lengths.expand(inp.B).tolist()
    exact = p.valid is None and p.doc is None and p.layout is None and not p.rest
    keep = None if exact else inp.materialize_mask()
    return p.band.left, p.band.right, limits, keep


def native_decode(inp: AttentionInputs, options=None):
    """Run the kernel (``kernel_reasons(inp) == []``): ``out`` or ``(out, lse)`` like a backend;
    ``options``: the call's :class:`~attnkit.backends.decode.DecodeOptions` (or None)."""
    ext, _ = _extension()
    handle = inp.k if inp.kv_format != "dense" else None
    if handle is None:
        k, v, ks, vs, table = inp.k, inp.v, _EMPTY_F, _EMPTY_F, _EMPTY_L
    else:
        k, v = handle.k, handle.v
        ks = _EMPTY_F if handle.k_scale is None else handle.k_scale
        vs = _EMPTY_F if handle.v_scale is None else handle.v_scale
        table = _EMPTY_L if handle.block_table is None else handle.block_table
    k, v = _last_contiguous(k), _last_contiguous(v)
    rows_t, spec, mode = _plan(inp, options, ext, k.dtype)
    q = inp.q.float().contiguous()
    out, lse = ext.decode(q, k, v, [ks, vs, table, rows_t], spec.tensors, spec.ints, spec.floats, mode)
    if out.dtype != inp.dtype:
        out = out.to(inp.dtype)
    return (out, lse) if inp.return_lse else out


def _plan(inp: AttentionInputs, options, ext, kv_dtype: torch.dtype):
    """``(rows, spec, qmode)``: the kernel's per-call arguments besides the tensors. Dense K/V under
    a band-only mask (or none) depend on the call's class alone, the thread count (the splits), the
    options and the state of the score modifier's and sinks' tensors (the spec holds a view of them,
    or a copy where it changes their dtype; :func:`~attnkit.backends.native_ops.tensor_state`): kept in
    the dispatcher's memo (:meth:`AttentionInputs.memo`) per those, unless one is an inference tensor."""
    memo = inp.memo() if inp.kv_format == "dense" else None
    if memo is not None:
        held = (() if inp.score_mod is None else inp.score_mod.parameters()) + (() if inp.sinks is None else
                                                                                (inp.sinks,))
        states = tuple([tensor_state(t) for t in held])
        if None in states:  # an inference tensor: no counter tells its values apart
            memo = None
    if memo is not None:
        key = (torch.get_num_threads(), options, states)
        plans = memo.get("decode_plan")
        if plans is None:
            plans = memo["decode_plan"] = {}
        found = plans.get(key)
        if found is not None:
            return found
    split = None if options is None else options.native_split_tokens
    handle = inp.k if inp.kv_format != "dense" else None
    B, Tq, Tk = inp.B, inp.Tq, inp.Tk
    left, right, limits, keep = _mask_data(inp.mask, inp)
    kv_offset = inp.kv_offset
    keep_t = _EMPTY_B if keep is None else _four(keep, inp)
    spans, qpos = [], []
    for b in range(B):
        n = Tk if handle is None else handle.lengths[b]
        # a ragged handle's queries sit at the row's own last positions (its mask is already per row)
        qpos.append(n - Tq if handle is not None and handle.ragged else inp.q_offset)
        if limits is not None:
            n = min(n, limits[b] - kv_offset)
        lo = 0 if left is None else max(0, qpos[b] - left - kv_offset)
        hi = n if right is None else min(n, qpos[b] + Tq - 1 + right - kv_offset + 1)
        spans.append((lo, max(lo, hi)))
    if keep is not None:
        # the keys the keep tensor keeps: the same range as the band's when it holds a band (a
        # ragged batch's per-row mask), so the splits below follow the row, not the mask's form
        spans = ext.decode_spans(keep_t, torch.tensor(spans, dtype=torch.long)).tolist()
    rows = [(lo, hi, split or split_tokens(hi - lo, inp.Hkv), qpos[b]) for b, (lo, hi) in enumerate(spans)]
    rows_t = _rows_tensor(tuple(rows))
    bias = None if inp.bias is None else _four(inp.bias.float(), inp)
    spec = kernel_spec(inp.scale, kv_offset=kv_offset, left=left, right=right, keep=None if keep is None else keep_t,
                       bias=bias, score_mod=inp.score_mod, sinks=None if inp.sinks is None else inp.sinks.detach(),
                       num_heads=inp.Hq, Tq=Tq, Tk=Tk)
    plan = rows_t, spec, qmode(inp.dtype, kv_dtype, options)
    if memo is not None and limits is None and keep is None and bias is None:
        if len(plans) >= 8:
            plans.clear()
        plans[key] = plan
    return plan


#: How the kernel computes q·k (decode.cpp's QMode): float32, bf16 dot products, int8 dot products.
FLOAT, BF16_DOT, INT8_DOT = 0, 1, 2


@functools.lru_cache(maxsize=1)
def dot_products() -> tuple[bool, bool]:
    """``(bf16 dot products, int8 dot products in hardware)``: whether this build runs on this CPU
    AVX512_BF16's ``vdpbf16ps`` and AVX512_VNNI's ``vpdpbusd`` (from the CPU's features)."""
    ext, _ = _extension()
    if ext is None:
        return False, False
    bf16, vnni = ext.dot_products()
    return bool(bf16), bool(vnni)


def qmode(q_dtype: torch.dtype, kv_dtype: torch.dtype, options=None) -> int:
    """The kernel's q·k for these dtypes and options: :data:`BF16_DOT` for bfloat16 queries over a
    bfloat16 cache where the CPU has bf16 dot products (unless ``bf16_dot=False``), :data:`INT8_DOT`
    for an int8 cache with ``quantized_query=True``, else :data:`FLOAT`."""
    if (kv_dtype == torch.bfloat16 and q_dtype == torch.bfloat16 and (options is None or options.bf16_dot)
            and dot_products()[0]):
        return BF16_DOT
    if kv_dtype == torch.int8 and options is not None and options.quantized_query:
        return INT8_DOT
    return FLOAT


def qmode_note(mode: int) -> str:
    """How ``mode`` computes q·k, for ``explain()``."""
    if mode == BF16_DOT:
        return "q·k as bf16 dot products (AVX512_BF16), float32 accumulation"
    if mode == INT8_DOT:
        how = "AVX512_VNNI" if dot_products()[1] else "portable int32 vectors"
        return f"q·k as int8 dot products over a per-row quantized q ({how})"
    return "keys converted to float32 as read"


_ROWS: dict = {}  # rows -> their (B, 4) int64 tensor, which the kernel only reads
_ROWS_SIZE = 64


def _rows_tensor(rows: tuple) -> Tensor:
    """The kernel's ``rows`` argument, built once per distinct rows (a decode loop repeats them per
    layer, and a dense call per step): building a tensor from a list costs microseconds."""
    found = _ROWS.get(rows)
    if found is None:
        if len(_ROWS) >= _ROWS_SIZE:
            _ROWS.clear()
        found = _ROWS[rows] = torch.tensor(rows, dtype=torch.long)
    return found


def _last_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _four(x: Tensor, inp: AttentionInputs) -> Tensor:
    """A mask or bias as a view broadcast to ``(B, Hq, Tq, Tk)`` (strides 0 where broadcast: the
    kernel indexes it with strides, no copy)."""
    while x.dim() < 4:
        x = x.unsqueeze(0)
    return x.expand(inp.B, inp.Hq, inp.Tq, inp.Tk)
