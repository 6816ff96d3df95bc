"""Top-k sparse attention: the ``TopK`` mask (semantics, validation, exported structure) and the
``topk`` gather backend (float64 oracle under flash-attn's rule, gradients, decoding over caches)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, TopK
from attnkit.cache import DynamicLayerCache, PagedKVCache, QuantizedLayerCache
from attnkit.masks import mask_params, tile_grid
from attnkit.masks.export import evaluated_grid, Tiles

from attnkit.backends.topk import TopKOptions, kernel_reason
from attnkit.inputs import AttentionInputs

from .reference import keep_grid, reference_attention
from .test_conformance import Shape, _inputs, _reference, _run, check_flash_rule


def lists(B, H, Tq, Tk, k, seed=0, *, pad=0.2, device="cpu"):
    """Random lists ``(B, H, Tq, k)``: positions in ``0..Tk-1`` (duplicates possible), ``pad`` of them -1."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, max(Tk, 1), (B, H, Tq, k), generator=g)
    return idx.masked_fill(torch.rand(B, H, Tq, k, generator=g) < pad, -1).to(device)


# -- the mask ------------------------------------------------------------------------------------
def test_the_documented_drawing():
    m = TopK(torch.tensor([[4, 0], [1, -1], [3, 3]]).view(1, 1, 3, 2))
    assert m.to_string(3, 5) == "█···█\n·█···\n···█·"
    assert (m & Causal()).to_string(3, 5) == "█····\n·█···\n···█·"


def test_order_duplicates_and_padding_do_not_matter():
    idx = lists(2, 1, 9, 13, 6, seed=1)
    a = TopK(idx)
    b = TopK(idx.flip(-1))  # another order
    c = TopK(torch.cat([idx, idx[..., :2], torch.full_like(idx[..., :1], -1)], -1))  # repeats and more padding
    keep = a.materialize(9, 13, batch_size=2)
    assert torch.equal(keep, b.materialize(9, 13, batch_size=2))
    assert torch.equal(keep, c.materialize(9, 13, batch_size=2))
    expected = torch.zeros(2, 1, 9, 13, dtype=torch.bool)  # the set of listed keys, by hand
    for bi, _, i, j in (idx >= 0).nonzero().tolist():
        expected[bi, 0, i, idx[bi, 0, i, j]] = True
    assert torch.equal(keep, expected)


@pytest.mark.parametrize("q_offset,kv_offset", [(None, 0), (3, 0), (10, 4)])
def test_evaluate_equals_mask_mod(q_offset, kv_offset):
    """The scatter (evaluate) and the index arithmetic (mask_mod, which the oracle uses) agree."""
    Tq, Tk = 7, 11
    idx = lists(2, 3, Tq, Tk, 5, seed=2) + kv_offset
    idx = idx.masked_fill(idx < kv_offset, -1)
    for m in (TopK(idx), TopK(idx) & Causal()):
        got = m.materialize(Tq, Tk, q_offset=q_offset, kv_offset=kv_offset, batch_size=2, num_heads=3)
        ref = keep_grid(m, 2, 3, Tq, Tk, q_offset=q_offset, kv_offset=kv_offset, device="cpu")
        assert torch.equal(got.expand_as(ref), ref)


@pytest.mark.parametrize("block", [(1, 1), (2, 3), (4, 4), (16, 16)])
def test_tile_grid_equals_evaluation(block):
    Tq, Tk = 13, 17
    idx = lists(2, 1, Tq, Tk, 6, seed=3)
    idx[0, 0, :4] = torch.tensor([0, 1, 2, 3, -1, 3])  # FULL tiles for batch row 0 only: PARTIAL over the batch
    dense = torch.arange(Tk).expand(1, 1, Tq, Tk)  # every key listed: FULL tiles
    for m in (TopK(idx), TopK(dense)):  # exact
        tiles = Tiles(Tq, Tk, Tk - Tq, 0, *block, m.batch_size, 1)
        assert torch.equal(m.tile_grid(tiles), evaluated_grid(m, tiles))
    for m in (TopK(idx) & Causal(), TopK(dense) & Causal()):  # the And's min of its parts: never wrong
        tiles = Tiles(Tq, Tk, Tk - Tq, 0, *block, m.batch_size, 1)
        got, truth = m.tile_grid(tiles), evaluated_grid(m, tiles)
        assert ((got == truth) | (got == 1)).all()  # EMPTY and FULL only where true; PARTIAL is always right
    assert (tile_grid(TopK(dense), Tq, Tk, Tk - Tq, 0, 4, 4) == 2).all()


def test_exported_parameters():
    idx = torch.tensor([[3, 1, 3, -1]]).view(1, 1, 1, 4)
    m = TopK(idx) & Causal()
    params = mask_params(m, 1)
    assert params.topk.tolist() == [[[[-1, -1, 1, 3]]]]  # sorted, each key once, -1 padding
    assert params.band.right == 0 and m.topk() in params.rest  # still applied by kernels that skip the lists
    assert m.topk() is m.parts[0] and Causal().topk() is None


@pytest.mark.parametrize("make,error,phrase", [
    (lambda: TopK([[1, 2]]), TypeError, "integer tensor"),
    (lambda: TopK(torch.zeros(1, 1, 2, 2)), TypeError, "integer dtype"),
    (lambda: TopK(torch.zeros(1, 2, 2, dtype=torch.long)), ValueError, "indices[:, None]"),
    (lambda: TopK(torch.tensor([[[[0, -2]]]])), ValueError, "got -2"),
])
def test_bad_lists_name_themselves(make, error, phrase):
    with pytest.raises(error, match="TopK") as info:
        make()
    assert phrase in str(info.value)


@pytest.mark.parametrize("idx,Tq,Tk,phrase", [
    (torch.tensor([[[[0, 5]]]]), 1, 5, "positions 0..5"),  # past the last key
    (torch.tensor([[[[0], [1]]]]), 1, 5, "Tq=1"),  # one list per query
])
def test_lists_that_do_not_fit_the_call(idx, Tq, Tk, phrase):
    q, k = torch.randn(1, 2, Tq, 4), torch.randn(1, 2, Tk, 4)
    with pytest.raises(ValueError, match="TopK") as info:
        attnkit.attention(q, k, k, mask=TopK(idx))
    assert phrase in str(info.value)


# -- dispatch ------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda i: TopK(i), lambda i: TopK(i) & Causal(), lambda i: Causal() & TopK(i)])
def test_auto_picks_the_gather_backend(make):
    q, k = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8)
    mask = make(lists(1, 1, 9, 9, 3))
    assert attnkit.dispatch.select(attnkit.AttentionInputs.create(q, k, k, mask=mask)).name == "topk"
    assert "chosen: topk" in str(attnkit.explain(q, k, k, mask=mask))
    no_lists = attnkit.AttentionInputs.create(q, k, k, mask=Causal())
    assert "needs TopK key lists" in " ".join(attnkit.get_backend("topk").not_supported_reasons(no_lists))


# -- the backend ---------------------------------------------------------------------------------
CASES = [  # shape, list heads (1 = shared), k
    (Shape(1, 1, 1, 1, 1, 8, 8), 1, 1),
    (Shape(2, 4, 2, 17, 17, 21, 21), 1, 5),
    (Shape(1, 9, 3, 37, 127, 59, 59), 1, 16),  # GQA, Tq < Tk
    (Shape(1, 4, 1, 127, 37, 21, 13), 4, 9),  # MQA, Tq > Tk, per-head lists, Dv != D
    (Shape(2, 2, 2, 127, 127, 111, 111), 2, 40),
    (Shape(1, 4, 2, 3, 200, 64, 64), 1, 200),  # a few queries, every key listed
]


_X = torch.zeros(1, 1, 1, 1)
KERNEL = kernel_reason(AttentionInputs.create(_X, _X, _X))  # None: the sparse C++ family is built
IMPLS = [pytest.param(False, id="gather"),
         pytest.param(True, id="kernel", marks=pytest.mark.skipif(KERNEL is not None, reason=str(KERNEL)))]


@pytest.mark.parametrize("native", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True], ids=["alone", "causal"])
@pytest.mark.parametrize("shape,heads,k", CASES, ids=[f"{c[0]}-H{c[1]}-k{c[2]}" for c in CASES])
def test_matches_the_float64_oracle(shape, heads, k, causal, dtype, native):
    mask = TopK(lists(shape.B, heads, shape.Tq, shape.Tk, k, seed=shape.Tq))
    mask = mask & Causal() if causal else mask
    qkv, do = _inputs(shape, dtype)
    out, grads = _run("topk", qkv, do, mask=mask, options=TopKOptions(native=native))
    assert out.shape == (shape.B, shape.Hq, shape.Tq, shape.Dv) and out.dtype == dtype
    lowp = _reference(qkv, do, lowp=True, mask=mask)
    check_flash_rule(out, grads, lowp, _reference(qkv, do, mask=mask), dtype)


def test_non_contiguous_inputs_and_small_blocks(monkeypatch):
    """Strided q/k/v (a (B, T, H, D) projection transposed) and blocks of 3 queries give the same result."""
    import attnkit.backends.topk as topk

    B, T, Hq, Hkv, D = 2, 23, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, T, Hq, D, generator=g).transpose(1, 2)
    k = torch.randn(B, T, Hkv, D, generator=g).transpose(1, 2)
    v = torch.randn(B, T, Hkv, D, generator=g).transpose(1, 2)
    mask = TopK(lists(B, 1, T, T, 7, seed=6)) & Causal() & KeyPadding([T, 15])
    ref = attnkit.attention(q, k, v, mask=mask, backend="naive")
    assert torch.allclose(attnkit.attention(q, k, v, mask=mask, backend="topk"), ref, atol=1e-6)
    twin = attnkit.attention(q, k, v, mask=mask, backend="topk", options=TopKOptions(native=False))
    assert torch.allclose(twin, ref, atol=1e-6)
    monkeypatch.setattr(topk, "BLOCK_ELEMENTS", 1)  # one query per block
    assert torch.allclose(attnkit.attention(q, k, v, mask=mask, backend="topk"), ref, atol=1e-6)


@pytest.mark.parametrize("native", IMPLS)
def test_gradcheck_float64(native):
    idx = torch.tensor([[4, 0], [1, -1], [3, 3], [-1, -1], [2, 0]]).view(1, 1, 5, 2)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64).requires_grad_() for n in (5, 5, 5))
    options = TopKOptions(native=native)
    for mask in (TopK(idx), TopK(idx) & Causal(), TopK(idx.expand(1, 2, 5, 2)) & Causal()):
        run = lambda q, k, v: attnkit.attention(q, k, v, mask=mask, backend="topk", options=options)  # noqa: E731
        assert torch.autograd.gradcheck(run, (q, k, v))


@pytest.mark.parametrize("native", IMPLS)
def test_rows_that_keep_nothing_give_zero_and_finite_gradients(native):
    idx = lists(1, 1, 6, 6, 3, seed=8)
    idx[0, 0, 2] = -1  # an empty list
    idx[0, 0, 4] = 5  # only a future key: nothing once intersected with Causal()
    mask = TopK(idx) & Causal()
    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
    out, lse = attnkit.attention(q, k, v, mask=mask, backend="topk", return_lse=True,
                                 options=TopKOptions(native=native))
    assert (out[:, :, [2, 4]] == 0).all() and torch.isinf(lse[:, :, [2, 4]]).all()
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert (q.grad[:, :, [2, 4]] == 0).all()
    ref_out, ref_lse = reference_attention(*(x.detach().double() for x in (q, k, v)), mask=mask)
    assert torch.allclose(out.double(), ref_out, atol=1e-5) and torch.allclose(lse.double(), ref_lse, atol=1e-5)


def test_nothing_listed_at_all():
    q, k = torch.randn(1, 2, 4, 8, requires_grad=True), torch.randn(1, 2, 6, 8, requires_grad=True)
    for idx in (torch.full((1, 1, 4, 3), -1), torch.zeros(1, 1, 4, 0, dtype=torch.long)):
        out = attnkit.attention(q, k, k, mask=TopK(idx), backend="topk")
        assert (out == 0).all()
        out.sum().backward()
        assert (q.grad == 0).all() and (k.grad == 0).all()


def test_the_lists_are_never_evaluated_over_every_pair(monkeypatch):
    """The gather backend reads the lists, never the (Tq, Tk) keep tensor."""
    def refuse(*args, **kwargs):
        raise AssertionError("the TopK mask was evaluated densely")

    monkeypatch.setattr(TopK, "evaluate", refuse)
    monkeypatch.setattr(TopK, "mask_mod", refuse)
    q, k = torch.randn(1, 2, 64, 8, requires_grad=True), torch.randn(1, 1, 64, 8, requires_grad=True)
    out = attnkit.attention(q, k, k, mask=TopK(lists(1, 1, 64, 64, 8)) & Causal())
    out.sum().backward()
    assert torch.isfinite(k.grad).all()


@pytest.mark.skipif(KERNEL is not None, reason=str(KERNEL))
def test_the_kernel_is_deterministic_and_runs_by_default():
    q, k = torch.randn(1, 4, 300, 16, requires_grad=True), torch.randn(1, 1, 300, 16, requires_grad=True)
    mask = TopK(lists(1, 1, 300, 300, 32)) & Causal()
    assert "C++ sparse kernel" in str(attnkit.explain(q, k, k, mask=mask))
    grads = []
    for _ in range(2):
        out = attnkit.attention(q, k, k, mask=mask)
        grads.append(torch.autograd.grad(out, (q, k), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_native_true_without_the_kernel_says_so(monkeypatch):
    import attnkit.backends.topk as topk

    monkeypatch.setattr(topk, "_KERNEL", ["native extension not built: no sparse kernel"])
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="attnkit build"):
        attnkit.attention(q, q, q, mask=TopK(torch.zeros(1, 1, 2, 1, dtype=torch.long)), backend="topk",
                          options=TopKOptions(native=True))


# -- decoding over caches ------------------------------------------------------------------------
def _cache(kind):
    if kind == "dynamic":
        return DynamicLayerCache()
    if kind == "int8":
        return QuantizedLayerCache()
    cache = PagedKVCache(1, num_blocks=16, block_size=4, quantize="int8" if kind == "paged-int8" else None)
    cache.select([cache.add_sequence()])
    return cache[0]


@pytest.mark.parametrize("native", IMPLS)
@pytest.mark.parametrize("kind", ["dynamic", "paged", "int8", "paged-int8"])
@pytest.mark.parametrize("Tq", [1, 4, 16])
def test_decoding_through_every_cache(kind, Tq, native, monkeypatch):
    """A few queries with key lists over a cache equal the same call on the cache's own dense K/V;
    an int8 or paged cache is read in place (its listed rows only, never a dense copy)."""
    g = torch.Generator().manual_seed(Tq)
    P, Hq, Hkv, D = 29, 4, 2, 16
    cache = _cache(kind)
    cache.update(torch.randn(1, Hkv, P, D, generator=g), torch.randn(1, Hkv, P, D, generator=g))
    k_all, v_all, kv_offset = cache.update(torch.randn(1, Hkv, Tq, D, generator=g),
                                           torch.randn(1, Hkv, Tq, D, generator=g))
    q = torch.randn(1, Hq, Tq, D, generator=g)
    mask = TopK(lists(1, 1, Tq, P + Tq, 8, seed=Tq)) & Causal()
    assert str(attnkit.explain(q, k_all, v_all, mask=mask)).split("chosen: ")[1].split()[0] == "topk"
    handle = isinstance(k_all, attnkit.KVHandle)
    if handle:
        dense = k_all.dense()
        monkeypatch.setattr(attnkit.KVHandle, "dense", lambda *a, **kw: pytest.fail("the whole cache was copied"))
    out = attnkit.attention(q, k_all, v_all, mask=mask, kv_offset=kv_offset, options=TopKOptions(native=native))
    if handle:
        k_all, v_all = dense
    ref = attnkit.attention(q, k_all, v_all, mask=mask, kv_offset=kv_offset, backend="naive")
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("native", IMPLS)
def test_mla_decode_with_key_lists_reads_the_listed_latent_rows(native):
    """Absorbed MLA decoding (values a view of the keys' first columns) under TopK lists equals the
    naive attention on the same rows; the lists go to the topk backend, not the decode kernel."""
    g = torch.Generator().manual_seed(11)
    rows = torch.randn(1, 1, 40, 24, generator=g)  # latent 16 + rope 8
    q = torch.randn(1, 4, 2, 24, generator=g)
    mask = TopK(lists(1, 1, 2, 40, 6, seed=12)) & Causal()
    out = attnkit.mla_decode(q, rows, kv_lora_rank=16, scale=0.2, mask=mask)
    ref = attnkit.attention(q, rows, rows[..., :16], mask=mask, scale=0.2, backend="naive")
    assert torch.allclose(out, ref, atol=1e-6)
    twin = attnkit.attention(q, rows, rows[..., :16], mask=mask, scale=0.2, backend="topk",
                             options=TopKOptions(native=native))
    assert torch.allclose(twin, ref, atol=1e-6)


@pytest.mark.parametrize("native", IMPLS)
def test_compiles_fullgraph_and_equals_eager(native):
    """TopK built inside the traced function (no host read) and the backend's ops (fake kernels)
    trace with fullgraph=True, forward and backward."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, h, 32, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    idx = lists(1, 1, 32, 32, 6, seed=13)
    options = TopKOptions(native=native)

    def f(q, k, v, idx):
        return attnkit.attention(q, k, v, mask=TopK(idx) & Causal(), backend="topk", options=options)

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, idx)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = f(q, k, v, idx)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


@pytest.mark.skipif(KERNEL is not None, reason=str(KERNEL))
def test_the_sparse_operators_pass_opcheck():
    """Schemas, fake kernels and the C++ kernels agree (torch.library.opcheck)."""
    g = torch.Generator().manual_seed(19)
    q, k, v = (torch.randn(1, h, 9, 8, generator=g) for h in (4, 2, 2))
    index = TopK(lists(1, 1, 9, 9, 4, seed=19)).lists()  # sorted, each key once, -1 padding
    ops = torch.ops.attnkit_sparse
    out, lse = ops.forward(q, k, v, index, 0.3)
    torch.library.opcheck(ops.forward.default, (q, k, v, index, 0.3))
    torch.library.opcheck(ops.backward.default, (torch.ones_like(out), q, k, v, out, lse, index, 0.3))


@pytest.mark.parametrize("native", IMPLS)
def test_a_half_precision_cache_is_read_at_the_listed_rows(native, monkeypatch):
    """Decoding over a long bfloat16 K/V upcasts the listed rows only, never the whole cache."""
    g = torch.Generator().manual_seed(21)
    q = torch.randn(1, 4, 1, 16, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 500, 16, generator=g).bfloat16() for _ in range(2))
    mask = TopK(lists(1, 1, 1, 500, 8, seed=21))
    ref = attnkit.attention(q, k, v, mask=mask, backend="naive")
    real = torch.Tensor.to

    def to(self, *args, **kwargs):
        assert self.shape[-2] != 500, "the whole cache was converted"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    out = attnkit.attention(q, k, v, mask=mask, backend="topk", options=TopKOptions(native=native))
    monkeypatch.undo()
    assert torch.allclose(out.float(), ref.float(), atol=1e-2)
