"""torch.compile(fullgraph=True, dynamic=True): one graph serves every length.

Lengths change from call to call (a cache growing, batches of other lengths, packed sequences of other
sizes); a graph specialized on one of them (a guard on an offset, on a tile count being 1, on a cache's
contents) compiles again at the next one and, past the recompile limit, fails under ``fullgraph``.
Each test runs 20 (or 6 packed) lengths across several key tiles and counts the graphs Dynamo built;
every compiled result equals the eager one. ``aot_eager`` traces what inductor would, without codegen.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import attnkit
from attnkit.backends import native
from attnkit.masks import Causal, Custom, KeyPadding, SlidingWindow

needs_build = pytest.mark.skipif(native.load_extension()[0] is None, reason=f"{native.load_extension()[1]}")

# 20 key lengths from 20 to 399: below, across and above one and two key tiles (128 and 256 keys)
LENGTHS = random.Random(0).sample(range(20, 400), 20)

MASKS = {
    "Causal": lambda lengths: Causal(),
    "SlidingWindow": lambda lengths: SlidingWindow(13, 4),
    "SlidingWindow&Causal": lambda lengths: SlidingWindow(37, 0) & Causal(),
    "KeyPadding": lambda lengths: KeyPadding(lengths),  # built inside the compiled function, from a tensor
    "KeyPadding&Causal": lambda lengths: KeyPadding(lengths) & Causal(),
    "Or": lambda lengths: SlidingWindow(20, 0) | SlidingWindow(0, 5),  # evaluated per tile: no band
    "Custom": lambda lengths: Custom(lambda b, h, q, k: (q + k) % 3 != 0),  # its tile grid evaluated too
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _run_lengths(f, key_lengths=LENGTHS):
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    for Tk in key_lengths:
        q = torch.randn(2, 4, 8, 16, generator=g)
        k, v = (torch.randn(2, 2, Tk, 16, generator=g) for _ in range(2))
        lengths = torch.tensor([Tk - 3, Tk // 2])
        torch.testing.assert_close(compiled(q, k, v, lengths), f(q, k, v, lengths), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@needs_build
@pytest.mark.parametrize("backend", ["auto", "native"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_one_graph_for_every_key_length(mask, backend):
    # Eager calls between the compiled ones fill the library's caches: a graph guarded on them would
    # compile again. Offsets, band bounds and tile counts stay symbolic (no guard per length).
    def f(q, k, v, lengths):
        return attnkit.attention(q, k, v, mask=MASKS[mask](lengths), backend=backend)

    _run_lengths(f)
    assert _graphs() == 1


@pytest.mark.parametrize("mask", ["Causal", "SlidingWindow&Causal", "KeyPadding"])
def test_sdpa_compiles_once_for_every_key_length(mask):
    # grouped heads: SDPA's enable_gqa must get a plain bool, not the traced comparison of head counts
    def f(q, k, v, lengths):
        return attnkit.attention(q, k, v, mask=MASKS[mask](lengths), backend="sdpa")

    _run_lengths(f, LENGTHS[:8])
    assert _graphs() == 1


@needs_build
def test_one_graph_as_queries_and_keys_grow():
    # chunked prefill: Tq and Tk both change, so the queries' offset (Tk - Tq) does too
    def f(q, k, v):
        return attnkit.attention(q, k, v, mask=SlidingWindow(50, 0) & Causal(), backend="native")

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    for Tq, Tk in ((40, 300), (129, 129), (200, 390), (33, 140), (257, 260)):
        q = torch.randn(1, 2, Tq, 16, generator=g)
        k, v = (torch.randn(1, 2, Tk, 16, generator=g) for _ in range(2))
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=1e-5, atol=1e-6)
    assert _graphs() == 1


VARLEN_MASKS = {
    "Causal": Causal(),
    "SlidingWindow": SlidingWindow(5, 3),
    "SlidingWindow&Causal": SlidingWindow(7, 0) & Causal(),
    "SlidingWindow(None, 4)": SlidingWindow(None, 4),
    "Or": SlidingWindow(3, 0) | SlidingWindow(0, 2),
}


@pytest.mark.slow
@needs_build
@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
def test_varlen_band_masks_compile_once_under_auto(mask):
    def f(q, k, v, cu):
        return attnkit.varlen_attention(q, k, v, cu, cu, mask=VARLEN_MASKS[mask])

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    # totals of one tile (71, 17) and of several; sequences of one token; counts change
    for lengths in ([50, 100, 17], [30, 41], [60, 1, 194], [9, 3, 5], [100, 28, 120, 8], [130, 70]):
        cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
        q, k, v = (torch.randn(sum(lengths), 2, 16, generator=g) for _ in range(3))
        torch.testing.assert_close(compiled(q, k, v, cu), f(q, k, v, cu), rtol=1e-5, atol=1e-6)
    assert _graphs() == 1


@needs_build
def test_kernel_reads_the_grid_stride_from_the_grid():
    # The traced plan's grid has a spare (EMPTY) tile row and column: the same GEMMs, so the same bits;
    # a grid smaller than the call's tiles is refused (it would be read past its end).
    from attnkit.inputs import AttentionInputs

    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 37, 8, generator=g)
    k, v = (torch.randn(1, 2, 45, 8, generator=g) for _ in range(2))
    inp = AttentionInputs.create(q, k, v, mask=SlidingWindow(9, 0) & KeyPadding([40]))
    plan = native.plan_for(inp, native.NativeOptions(8, 16))
    from attnkit.backends import native_ops

    grid = plan.mask["grid"]
    assert grid.shape == (6, 4)  # 5 x 3 tiles and the spare ones

    def run(grid):
        spec = native_ops.kernel_spec(8**-0.5, q_offset=plan.q_offset, kv_offset=plan.kv_offset,
                                      **{**plan.mask, "grid": grid})
        return torch.ops.attnkit_native.forward(q, k, v, spec.tensors, spec.ints, spec.floats, 8, 16,
                                                torch.empty(0, dtype=torch.uint8))[0]

    assert torch.equal(run(grid), run(grid[:5, :3].contiguous()))
    with pytest.raises(RuntimeError, match="tile grid"):
        run(grid[:5, :2].contiguous())


@needs_build
def test_training_compiles_once_for_every_length():
    # the backward operator's positions are SymInt too: gradients at every length from one graph
    def f(q, k, v, lengths):
        return attnkit.attention(q, k, v, mask=SlidingWindow(20, 0) & KeyPadding(lengths), backend="native")

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    for T in (141, 60, 323, 129, 256):
        q = torch.randn(2, 4, T, 16, generator=g).requires_grad_()
        k, v = (torch.randn(2, 2, T, 16, generator=g).requires_grad_() for _ in range(2))
        lengths = torch.tensor([T, T - 5])
        got = compiled(q, k, v, lengths)
        got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        ref = f(q, k, v, lengths)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        for a, b in zip(got_grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _graphs() == 1


def test_dispatch_caches_filled_between_calls_compile_nothing_new():
    # the rule's per-registry order is cached on first use: a graph that read or filled the cache
    # would be guarded on it and compile again once an eager call (or its own first run) filled it
    from attnkit.dispatch import rule

    rule._SORTED.clear()

    def f(q):
        return attnkit.attention(q, q, q, mask=Causal())

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    q = torch.randn(1, 2, 40, 8)
    compiled(q)
    f(q)
    torch.testing.assert_close(compiled(q), f(q))
    assert _graphs() == 1
