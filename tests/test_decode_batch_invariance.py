"""The native decode kernel's batch invariance: a row decodes to the same bits alone or in any batch,
whatever rows of other lengths sit beside it, under every mask kind the kernel takes (none,
``Causal``, ``SlidingWindow``, ``SlidingWindow & Causal``, ``KeyPadding``, a materialized mask),
score modifiers and sinks, over contiguous, int8 and paged caches, float32 and bfloat16, at 1 and 2
threads. Each comparison is one kernel at one thread count: the same per-row reduction order, so
bits are compared. The PyTorch-op twin promises closeness only (its matmuls take the batch's
shapes). Skipped when the extension is not built."""

from __future__ import annotations

import pytest
import torch

from attnkit import Causal, Dense, KeyPadding, SlidingWindow, attention
from attnkit.backends.decode import DecodeOptions
from attnkit.cache import PagedKVCache, QuantizedLayerCache
from attnkit.score_mods import ALiBi, SoftCap

from .test_decode_native import _handle, native

LENGTHS = (5, 300, 1000, 2051)
HQ, HKV, D = 4, 2, 32
NATIVE = DecodeOptions(implementation="native")
BATCHES = ([0, 1, 2, 3], [3, 1])  # every row; a pair, reversed


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _masks(padding: list[int]) -> dict:
    """Each mask kind as a function of the batch's rows (``KeyPadding`` holds one length per row)."""
    pad = lambda rows: KeyPadding([padding[r] for r in rows])  # noqa: E731
    return {
        "none": lambda rows: None,
        "causal": lambda rows: Causal(),
        "window": lambda rows: SlidingWindow(64, 8),
        "wide window": lambda rows: SlidingWindow(700),
        "window & causal": lambda rows: SlidingWindow(64, 8) & Causal(),
        "padding": pad,
        "padding & causal": lambda rows: pad(rows) & Causal(),
        "padding & window": lambda rows: pad(rows) & SlidingWindow(700),
    }


def _extras() -> dict:
    """Score modifiers and sinks, in the kernel."""
    return {
        "": {},
        "softcap": {"score_mod": SoftCap(2.0)},
        "alibi": {"score_mod": ALiBi.geometric(HQ)},
        "sinks": {"sinks": torch.linspace(-1.0, 1.0, HQ)},
    }


def _assert_invariant(decode, label):
    """``decode(rows)`` -> (out, lse) of those batch rows; every row equals itself alone, bitwise."""
    alone = {r: decode([r]) for r in range(len(LENGTHS))}
    for rows in BATCHES:
        out, lse = decode(rows)
        for i, r in enumerate(rows):
            assert torch.equal(out[i:i + 1], alone[r][0]), (label, rows, r)
            assert torch.equal(lse[i:i + 1], alone[r][1]), (label, rows, r)


def _paged(quantize, dtype, Tq, seed=0):
    """A paged cache holding one sequence per length, and queries for every row."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, num_blocks=sum(-(-n // 16) for n in LENGTHS) + 4, block_size=16, quantize=quantize)
    seqs = []
    for n in LENGTHS:
        seqs.append(cache.add_sequence())
        cache.select(seqs[-1:])
        k, v = (torch.randn(1, HKV, n, D, generator=g).to(dtype) for _ in range(2))
        cache[0].update(k, v)
    return cache, seqs, torch.randn(len(LENGTHS), HQ, Tq, D, generator=g).to(dtype)


@native
@pytest.mark.parametrize("Tq", [1, 3])
@pytest.mark.parametrize("quantize, dtype", [(None, torch.float32), (None, torch.bfloat16), ("int8", torch.float32)],
                         ids=["paged-fp32", "paged-bf16", "paged-int8"])
def test_paged_rows_decode_alike_alone_and_in_any_batch(quantize, dtype, Tq, threads):
    """Rows of 5 to 2051 keys in a paged cache, each at its own position (a ragged batch)."""
    cache, seqs, q = _paged(quantize, dtype, Tq)
    padding = [n - 3 for n in LENGTHS]
    for name, mask_of in _masks(padding).items():
        for extra, kwargs in _extras().items():
            def decode(rows):
                cache.select([seqs[r] for r in rows])
                h = cache[0].handle()
                return attention(q[rows], h, h, mask=mask_of(rows), backend="decode", options=NATIVE,
                                 return_lse=True, **kwargs)

            _assert_invariant(decode, (name, extra))


@native
@pytest.mark.parametrize("fmt", ["int8", "paged", "paged-int8"])
def test_ragged_handles_decode_alike_alone_and_in_any_batch(fmt, threads):
    """A handle built by hand (int8 rows of their own lengths too), NaN in every unwritten slot."""
    g = torch.Generator().manual_seed(3)
    B, S = len(LENGTHS), max(LENGTHS)
    q = torch.randn(B, HQ, 1, D, generator=g)
    (h, _), _ = _handle(fmt, torch.randn(B, HKV, S, D, generator=g), torch.randn(B, HKV, S, D, generator=g), LENGTHS)
    for name, mask_of in _masks([n - 3 for n in LENGTHS]).items():
        def decode(rows):
            one = h.rows(rows)
            return attention(q[rows], one, one, mask=mask_of(rows), backend="decode", options=NATIVE,
                             return_lse=True)

        _assert_invariant(decode, name)


@native
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_contiguous_rows_decode_alike_alone_and_in_any_batch(fmt, threads):
    """Contiguous caches hold one length for every row: rows of 5 to 2051 keys are a padded batch
    (``KeyPadding``), all queries at one position. A row alone is its own slice of the batch."""
    g = torch.Generator().manual_seed(1)
    B, S, Tq = len(LENGTHS), max(LENGTHS), 1
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    q = torch.randn(B, HQ, Tq, D, generator=g).to(dtype)
    k, v = torch.randn(B, HKV, S, D, generator=g).to(dtype), torch.randn(B, HKV, S, D, generator=g).to(dtype)
    if fmt == "int8":
        cache = QuantizedLayerCache()
        cache.update(k, v)
        h = cache.handle()
        kv = lambda rows: (h.rows(rows),) * 2  # noqa: E731
    else:
        kv = lambda rows: (k[rows], v[rows])  # noqa: E731
    keep = torch.rand(B, 1, Tq, S, generator=g) < 0.7
    masks = {name: mask_of for name, mask_of in _masks(list(LENGTHS)).items() if name.startswith("padding")}
    masks["materialized & padding"] = lambda rows: Dense(keep[rows]) & KeyPadding([LENGTHS[r] for r in rows])
    for name, mask_of in masks.items():
        for extra, kwargs in _extras().items():
            def decode(rows):
                kr, vr = kv(rows)
                return attention(q[rows], kr, vr, mask=mask_of(rows), backend="decode", options=NATIVE,
                                 return_lse=True, **kwargs)

            _assert_invariant(decode, (name, extra))


@native
def test_a_row_alone_at_its_own_length_equals_its_padded_row(threads):
    """A padded row and the same row cut to its length (no padding mask) read the same keys."""
    g = torch.Generator().manual_seed(2)
    B, S = len(LENGTHS), max(LENGTHS)
    q = torch.randn(B, HQ, 1, D, generator=g)
    k, v = torch.randn(B, HKV, S, D, generator=g), torch.randn(B, HKV, S, D, generator=g)
    for window in (None, SlidingWindow(1800)):
        pad = KeyPadding(list(LENGTHS))
        batch = attention(q, k, v, mask=pad if window is None else pad & window, backend="decode", options=NATIVE,
                          return_lse=True)
        for b, n in enumerate(LENGTHS):
            out, lse = attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], mask=window, q_offset=S - 1,
                                 backend="decode", options=NATIVE, return_lse=True)
            assert torch.equal(out, batch[0][b:b + 1]) and torch.equal(lse, batch[1][b:b + 1]), (window, b)


def test_the_pytorch_op_twin_is_close_alone_and_in_a_batch():
    """The twin's matmuls take the batch's shapes (its longest row, its size): a row's result is
    only close to its result alone."""
    cache, seqs, q = _paged(None, torch.float32, 1)
    cache.select(seqs)
    h = cache[0].handle()
    twin = DecodeOptions(implementation="torch")
    for mask in (Causal(), SlidingWindow(64, 8)):
        batch = attention(q, h, h, mask=mask, backend="decode", options=twin)
        for b, seq in enumerate(seqs):
            cache.select([seq])
            one = cache[0].handle()
            alone = attention(q[b:b + 1], one, one, mask=mask, backend="decode", options=twin)
            torch.testing.assert_close(batch[b:b + 1], alone, atol=1e-6, rtol=1e-5)
