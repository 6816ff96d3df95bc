"""sliding_window and block_sparse: exact against the oracle, invariants, reasons and dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import BlockSparse, Causal, Dense, Document, KeyPadding, SlidingWindow, longformer
from attnkit.backends.sliding_window import SlidingWindowOptions
from tests.reference import reference_attention
from tests.sparse_checks import check_against_reference, make_qkv

WINDOW_MASKS = {
    "causal_local": SlidingWindow(5, 0),
    "two_sided": SlidingWindow(4, 9),
    "with_causal": SlidingWindow(6, None) & Causal(),
    "with_padding": SlidingWindow(7, 7) & KeyPadding([30, 0]),
    "with_document": SlidingWindow(8, 2) & Document(torch.tensor([0] * 25 + [1] * 45)),
    "longformer": longformer(3, [0, 17]),
}

BLOCK_MASKS = {
    "bigbird": BlockSparse.bigbird(9, 8, seed=3),
    "longformer": BlockSparse.window_global(9, 8, window=1, global_blocks=(0,)),
    "fixed_causal": BlockSparse.fixed(9, 8, stride=3),
    "strided_bidirectional": BlockSparse.strided(9, 8, stride=2, causal=False),
    "random_padding": BlockSparse.random(9, 8, density=0.3) & KeyPadding([21, 60]),
    "per_head": BlockSparse(torch.rand(4, 9, 9, generator=torch.Generator().manual_seed(0)) > 0.7, 8),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(WINDOW_MASKS))
def test_sliding_window_flash_rule(name, dtype):
    q, k, v = make_qkv(2, 4, 2, 47, 61, 16, dtype)
    check_against_reference("sliding_window", q, k, v, mask=WINDOW_MASKS[name], options=SlidingWindowOptions(chunk=6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BLOCK_MASKS))
def test_block_sparse_flash_rule(name, dtype):
    q, k, v = make_qkv(2, 4, 2, 61, 67, 16, dtype)  # Tq != Tk, neither a multiple of the block
    check_against_reference("block_sparse", q, k, v, mask=BLOCK_MASKS[name])


@pytest.mark.parametrize("backend,mask", [("sliding_window", SlidingWindow(4, 1)),
                                          ("block_sparse", BLOCK_MASKS["bigbird"])])
@pytest.mark.parametrize("Tq,Tk,D", [(1, 1, 8), (1, 70, 59), (17, 40, 21), (40, 17, 8)])
def test_awkward_shapes_and_offsets(backend, mask, Tq, Tk, D):
    q, k, v = make_qkv(1, 9, 3, Tq, Tk, D)
    check_against_reference(backend, q, k, v, mask=mask)
    if Tq < Tk:
        check_against_reference(backend, q, k, v, mask=mask, q_offset=2)


def test_window_covering_the_sequence_equals_full_attention():
    q, k, v = make_qkv(1, 2, 2, 33, 33, 8)
    out = attnkit.attention(q, k, v, mask=SlidingWindow(40, 40), backend="sliding_window")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    out = attnkit.attention(q, k, v, mask=SlidingWindow(40, 0), backend="sliding_window")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)


def test_every_block_on_equals_dense():
    q, k, v = make_qkv(1, 2, 1, 45, 45, 8)
    mask = BlockSparse(torch.ones(6, 6, dtype=torch.bool), 8)
    out = attnkit.attention(q, k, v, mask=mask, backend="block_sparse")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend,mask", [("sliding_window", SlidingWindow(3, 0) & KeyPadding([25])),
                                          ("block_sparse", BlockSparse.window_global(5, 8) & KeyPadding([25]))])
def test_nan_in_unattended_keys_and_masked_rows(backend, mask):
    q, k, v = make_qkv(1, 2, 2, 40, 40, 8)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 25:], v2[:, :, 25:] = float("nan"), float("inf")
    k2.requires_grad_(), v2.requires_grad_()
    out, lse = attnkit.attention(q, k2, v2, mask=mask, backend=backend, return_lse=True, q_offset=0)
    ref, ref_lse = reference_attention(q, k, v, mask=mask, q_offset=0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k2.grad).all() and torch.isfinite(v2.grad).all()


def test_reasons_for_masks_they_cannot_use():
    q = torch.randn(1, 2, 16, 8)
    why = attnkit.explain(q, q, q, mask=Causal()).reasons
    assert any("banded" in r for r in why["sliding_window"]) and any("BlockSparse" in r for r in why["block_sparse"])
    with pytest.raises(attnkit.NoBackendError, match="banded"):
        attnkit.attention(q, q, q, mask=SlidingWindow(None, 3), backend="sliding_window")


def test_dispatch_sends_structured_masks_to_their_backend():
    # explain() reads shapes only. Which skipping backend wins is the cost model's call on each
    # machine (tests/test_dispatch.py injects measurements); a long structured mask never goes to
    # a path that materializes the whole mask.
    q = torch.empty(1, 2, 4096, 8)
    dense = ("sdpa", "naive", "decode")
    for mask in (longformer(64, [0]), BlockSparse.bigbird(64, 64), SlidingWindow(64, 64)):
        assert attnkit.explain(q, q, q, mask=mask).chosen not in dense, mask
    assert attnkit.explain(q, q, q, mask=BlockSparse.bigbird(64, 64)).chosen in ("block_sparse", "native")
    # kernels that fuse or skip masked tiles (tiled stands in when native is not built)
    assert attnkit.explain(q, q, q, mask=Causal()).chosen in ("sdpa", "native", "tiled")
    assert attnkit.explain(q, q, q).chosen in ("sdpa", "native", "tiled")


def test_info_cli_explains_a_longformer_mask():
    from attnkit.cli.info import parse_mask

    mask = parse_mask("longformer:256,64").build(1, 4096)  # the BlockSparse layout `bench` measures
    q = torch.empty(1, 2, 4096, 8)
    explanation = attnkit.explain(q, q, q, mask=mask)
    assert explanation.chosen in ("block_sparse", "native") and "needs banded" in str(explanation)


@pytest.mark.parametrize("Tq,Tk,q_offset,kv_offset", [(29, 19, None, 0), (23, 40, 5, 20), (31, 12, 40, 46)])
def test_sliding_window_dense_conjunct_when_queries_start_before_keys(Tq, Tk, q_offset, kv_offset):
    """A Dense keep is relative to the call (row i = the call's i-th query); the band runs only on
    the queries whose window reaches a key, and must still index the Dense rows from the call's
    first query (Tq > Tk bottom-right, and explicit q_offset < kv_offset)."""
    keep = torch.rand(2, 1, Tq, Tk, generator=torch.Generator().manual_seed(4)) < 0.7
    for window in (SlidingWindow(3, 0), SlidingWindow(5, 2) & Causal()):
        q, k, v = make_qkv(2, 4, 2, Tq, Tk, 16)
        check_against_reference("sliding_window", q, k, v, mask=window & Dense(keep), q_offset=q_offset,
                                kv_offset=kv_offset, options=SlidingWindowOptions(chunk=4))


@pytest.mark.parametrize("backend", ["sliding_window", "block_sparse", "flex"])
@pytest.mark.parametrize("extra", ["per_head_dense", "custom", "none"])
@pytest.mark.parametrize("Hkv", [6, 3, 1])
def test_an_empty_batch_gives_empty_results_and_gradients(backend, extra, Hkv):
    """B = 0 (GQA and MQA too): empty output and LSE of the right shapes, and empty gradients."""
    from attnkit.backends import flex

    Tq, Tk = 27, 33
    base = {"sliding_window": SlidingWindow(6, 1), "block_sparse": BlockSparse.bigbird(9, 4), "flex": Causal()}[backend]
    part = {"per_head_dense": Dense(torch.ones(0, 6, Tq, Tk, dtype=torch.bool)),
            "custom": attnkit.Custom(lambda b, h, q, k: (k % 3 != 0) | (h == b)), "none": None}[extra]
    mask = base if part is None else base & part
    grads = backend != "flex"  # Flex has no backward on a CPU
    q = torch.randn(0, 6, Tq, 8, requires_grad=grads)
    k, v = (torch.randn(0, Hkv, Tk, 8, requires_grad=grads) for _ in range(2))
    lse = backend != "flex"
    with flex.allow_cpu():
        result = attnkit.attention(q, k, v, mask=mask, backend=backend, return_lse=lse,
                                   options=flex.FlexOptions(compile=False) if backend == "flex" else None)
    out = result[0] if lse else result
    assert out.shape == (0, 6, Tq, 8) and out.dtype == q.dtype
    if lse:
        assert result[1].shape == (0, 6, Tq)
    if grads:
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
