"""Reliability probes of decoding's batch invariance: a row of a KV cache decodes to the same bits alone
or beside rows of other lengths (the README's promise for the ``decode`` backend's native kernel).

Each probe fills a cache with rows of very different lengths, decodes every row in one batch and each
row alone (same thread count), and is "ok" when every row's output and LSE are bitwise equal; the
kernel's result must also stay right (the float64 reference of each row's own keys). Masks: none,
``Causal``, ``SlidingWindow`` (one- and two-sided), with ``Causal``, ``KeyPadding``; score modifiers
(soft-cap, ALiBi) and sinks; paged, paged int8, contiguous int8 handles; float32 and bfloat16. The
``decode`` backend runs its PyTorch-op twin where the extension is not built: the twin promises
closeness only, and its probe checks that.
"""

from __future__ import annotations

import functools

import probe_reliability as pr
import torch

import attnkit
from attnkit import Causal, KeyPadding, SlidingWindow
from attnkit.cache import PagedKVCache, dequantize_int8, quantize_int8
from attnkit.kv_handle import KVHandle
from attnkit.score_mods import ALiBi, SoftCap


@functools.cache
def _native() -> bool:
    """The ``decode`` backend runs the native kernel here (else its twin, which promises closeness)."""
    x = torch.zeros(1, 1, 1, 8)
    return "native C++ split-K decode kernel" in str(attnkit.explain(x, x, x, backend="decode"))


def _backend() -> str:
    """``decode`` where its kernel runs; else the dispatcher's choice (the twin applies no score modifier)."""
    return "decode" if _native() else "auto"


def _same(a, b) -> bool:
    return torch.equal(a, b) if _native() else torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def _paged(lengths, Hq=4, Hkv=2, D=32, Tq=1, block=16, quantize=None, dtype=torch.float32, seed=0):
    """``decode(rows, **kwargs) -> (out, lse)`` over a paged cache holding one sequence per length,
    and the rows' dense K/V (for the reference)."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_blocks=sum(-(-n // block) for n in lengths) + 2, block_size=block,
                         quantize=quantize)
    seqs, dense = [], []
    for n in lengths:
        k, v = (torch.randn(1, Hkv, n, D, generator=g).to(dtype) for _ in range(2))
        seqs.append(cache.add_sequence())
        cache.select(seqs[-1:])
        cache[0].update(k, v)
        if quantize:
            k, v = (dequantize_int8(*quantize_int8(x)) for x in (k, v))
        dense.append((k, v))
    q = torch.randn(len(lengths), Hq, Tq, D, generator=g).to(dtype)

    def decode(rows, mask=None, **kwargs):
        cache.select([seqs[r] for r in rows])
        h = cache[0].handle()
        return attnkit.attention(q[rows], h, h, mask=mask, return_lse=True, **{"backend": _backend(), **kwargs})

    return decode, q, dense


def _int8_handle(lengths, Hq=4, Hkv=2, D=32, seed=0):
    """The same for a contiguous int8 handle whose rows hold their own lengths."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    (kq, ks), (vq, vs) = (quantize_int8(torch.randn(B, Hkv, S, D, generator=g)) for _ in range(2))
    h = KVHandle("int8", kq, vq, tuple(lengths), torch.float32, True, ks, vs)
    q = torch.randn(B, Hq, 1, D, generator=g)

    def decode(rows, mask=None, **kwargs):
        one = h.rows(rows)
        return attnkit.attention(q[rows], one, one, mask=mask, return_lse=True, **{"backend": _backend(), **kwargs})

    dense = [(dequantize_int8(kq[b:b + 1, :, :n], ks[b:b + 1, :, :n]),
              dequantize_int8(vq[b:b + 1, :, :n], vs[b:b + 1, :, :n])) for b, n in enumerate(lengths)]
    return decode, q, dense


def invariant(make, lengths, mask_of=lambda rows: None, threads=None, **kwargs):
    """Every row alone equals itself in the whole batch and in the batch reversed: bitwise (the native
    kernel), or close (the twin, without the extension)."""
    def run():
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            decode = make(lengths)[0]
            rows = list(range(len(lengths)))
            alone = [decode([r], mask_of([r]), **kwargs) for r in rows]
            for batch in (rows, rows[::-1]):
                out, lse = decode(batch, mask_of(batch), **kwargs)
                for i, r in enumerate(batch):
                    if not (_same(out[i:i + 1], alone[r][0]) and _same(lse[i:i + 1], alone[r][1])):
                        return False
            return True
        finally:
            torch.set_num_threads(before)

    return run


def right(make, lengths, left):
    """A ragged batch under ``SlidingWindow(left)`` equals each row's float64 reference."""
    def run():
        decode, q, dense = make(lengths)
        out, _ = decode(list(range(len(lengths))), SlidingWindow(left))
        for b, (k, v) in enumerate(dense):
            n, Tq = k.shape[2], q.shape[2]
            pos_q, pos_k = torch.arange(n - Tq, n)[:, None], torch.arange(n)[None, :]
            keep = (pos_k <= pos_q) & (pos_k >= pos_q - left)
            if not pr.close(out[b:b + 1], pr.reference(q[b:b + 1], k, v, keep), tol=1e-3):
                return False
        return True

    return run


def twin_close(lengths):
    """The PyTorch-op twin: a row in a batch is close to the row alone (its matmuls follow the batch)."""
    def run():
        from attnkit.backends.decode import DecodeOptions

        decode = _paged(lengths)[0]
        twin = {"backend": "decode", "options": DecodeOptions(implementation="torch")}
        batch = decode(list(range(len(lengths))), SlidingWindow(64), **twin)[0]
        return all(torch.allclose(batch[r:r + 1], decode([r], SlidingWindow(64), **twin)[0], atol=1e-6, rtol=1e-5)
                   for r in range(len(lengths)))

    return run


_L = (5, 300, 1000, 2051)  # the lengths the fix was tested at
_X = (17, 777, 64, 4100, 1)  # other lengths for the extra probes
_pad = lambda lengths: (lambda rows: KeyPadding([max(1, lengths[r] - 3) for r in rows]))  # noqa: E731
_bf16 = lambda lengths: _paged(lengths, dtype=torch.bfloat16)  # noqa: E731
_int8 = lambda lengths: _paged(lengths, quantize="int8")  # noqa: E731
_wide = lambda lengths: _paged(lengths, Hq=8, Hkv=1, D=64, Tq=2, block=32, seed=1)  # noqa: E731
_gqa = lambda lengths: _paged(lengths, Hq=6, Hkv=3, D=48, Tq=4, block=7, seed=2)  # noqa: E731

PROBES: list[tuple[str, str, object, str]] = [
    # one per defect class: a band (or key lengths) over rows of different lengths
    ("paged fp32, no mask, alone = in batch", "value", invariant(_paged, _L), ""),
    ("paged fp32, Causal, alone = in batch", "value", invariant(_paged, _L, lambda r: Causal()), ""),
    ("paged fp32, SlidingWindow, alone = in batch", "value",
     invariant(_paged, _L, lambda r: SlidingWindow(64, 8)), ""),
    ("paged fp32, SlidingWindow & Causal, alone = in batch", "value",
     invariant(_paged, _L, lambda r: SlidingWindow(100) & Causal()), ""),
    ("paged fp32, KeyPadding, alone = in batch", "value", invariant(_paged, _L, _pad(_L)), ""),
    ("paged bf16, SlidingWindow, alone = in batch", "value", invariant(_bf16, _L, lambda r: SlidingWindow(100)), ""),
    ("paged int8, SlidingWindow, alone = in batch", "value", invariant(_int8, _L, lambda r: SlidingWindow(64)), ""),
    ("int8 handle, SlidingWindow, alone = in batch", "value",
     invariant(_int8_handle, _L, lambda r: SlidingWindow(64)), ""),
    ("int8 handle, KeyPadding, alone = in batch", "value", invariant(_int8_handle, _L, _pad(_L)), ""),
    ("paged, SoftCap & SlidingWindow, alone = in batch", "value",
     invariant(_paged, _L, lambda r: SlidingWindow(64), score_mod=SoftCap(2.0)), ""),
    ("paged, ALiBi & SlidingWindow, alone = in batch", "value",
     invariant(_paged, _L, lambda r: SlidingWindow(64), score_mod=ALiBi.geometric(4)), ""),
    ("paged, sinks & SlidingWindow, alone = in batch", "value",
     invariant(_paged, _L, lambda r: SlidingWindow(64), sinks=torch.linspace(-1, 1, 4)), ""),
    ("paged, SlidingWindow at 1 thread", "value", invariant(_paged, _L, lambda r: SlidingWindow(64), threads=1), ""),
    # other shapes: lengths, GQA groups, head dims, Tq, block sizes, windows
    ("extra: Tq=2 D=64 MQA, SlidingWindow(300)", "value", invariant(_wide, _X, lambda r: SlidingWindow(300)), ""),
    ("extra: Tq=4 D=48 block 7, window & Causal", "value",
     invariant(_gqa, _X, lambda r: SlidingWindow(33, 2) & Causal()), ""),
    ("extra: Tq=4 D=48 block 7, KeyPadding & window", "value",
     invariant(_gqa, _X, lambda r: _pad(_X)(r) & SlidingWindow(500)), ""),
    ("extra: paged int8, window, ALiBi", "value",
     invariant(_int8, _X, lambda r: SlidingWindow(1000), score_mod=ALiBi.geometric(4)), ""),
    ("extra: ragged SlidingWindow equals the reference", "value", right(_gqa, _X, 40), ""),
    ("extra: ragged int8 SlidingWindow equals the reference", "value", right(_int8_handle, _X, 250), ""),
    ("extra: PyTorch-op twin close alone and in batch", "value", twin_close(_X), ""),
]
