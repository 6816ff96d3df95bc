"""The tiled backend: exact under every mask, awkward shapes and tile sizes, O(n) backward."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, Custom, Document, KeyPadding, SlidingWindow
from attnkit.backends.tiled import TiledOptions
from tests.reference import reference_attention
from tests.sparse_checks import check_against_reference, make_qkv

SMALL = TiledOptions(block_q=16, block_k=24)  # divides none of the lengths below

MASKS = {
    "none": None,
    "causal": Causal(),
    "window": SlidingWindow(5, 3),
    "padding": KeyPadding([40, 0]),
    "document": Document(torch.tensor([0] * 10 + [1] * 30 + [2] * 30)),
    "custom": Custom(lambda b, h, q, k: (q + k) % 3 != 0, "mod3"),
    "dense": torch.rand(2, 1, 37, 53, generator=torch.Generator().manual_seed(0)) > 0.6,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", list(MASKS))
def test_masks_flash_rule(name, dtype):
    q, k, v = make_qkv(2, 4, 2, 37, 53, 16, dtype)
    check_against_reference("tiled", q, k, v, mask=MASKS[name], options=SMALL)


@pytest.mark.parametrize(
    "B,Hq,Hkv,Tq,Tk,D",
    [(1, 1, 1, 1, 1, 8), (1, 2, 1, 1, 127, 8), (1, 3, 3, 127, 17, 59), (2, 9, 3, 17, 17, 21), (1, 2, 1, 1025, 1025, 8)],
)
def test_awkward_shapes(B, Hq, Hkv, Tq, Tk, D):
    q, k, v = make_qkv(B, Hq, Hkv, Tq, Tk, D)
    opts = TiledOptions(block_q=128, block_k=96) if Tq > 500 else SMALL
    check_against_reference("tiled", q, k, v, mask=Causal(), options=opts)


def test_bias_gradient_broadcast_and_offsets():
    q, k, v = make_qkv(1, 4, 2, 29, 45, 8, torch.float64)
    bias = torch.randn(1, 4, 1, 45, dtype=torch.float64, requires_grad=True)  # broadcast over queries
    check_against_reference("tiled", q, k, v, mask=Causal(), bias=bias, options=SMALL, q_offset=3)


def test_default_options_equal_small_tiles():
    q, k, v = make_qkv(1, 2, 2, 300, 700, 16)
    a = attnkit.attention(q, k, v, mask=SlidingWindow(100, 20), backend="tiled")
    b = attnkit.attention(q, k, v, mask=SlidingWindow(100, 20), backend="tiled", options=SMALL)
    torch.testing.assert_close(a, b)


def test_tile_fully_masked_but_row_not_and_rows_masked_everywhere():
    # Anti-causal mask: in the first key tile, early rows see keys, later rows see none -> a row's
    # running max stays -inf through whole tiles (the exp(-inf - (-inf)) trap); queries after
    # every key (q >= Tk here) see nothing at all.
    mask = Custom(lambda b, h, q, k: (k > q) & (q < 60), "anti")
    q, k, v = make_qkv(1, 2, 1, 70, 64, 8, torch.float64)
    out, lse = check_against_reference("tiled", q, k, v, mask=mask, options=TiledOptions(8, 16), q_offset=0)
    assert torch.isinf(lse[:, :, 60:]).all() and (out[:, :, 60:] == 0).all()


def test_nan_in_keys_no_query_may_attend_does_not_leak():
    q, k, v = make_qkv(1, 2, 2, 20, 40, 8)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 30:], v2[:, :, 30:] = float("nan"), float("inf")
    k2.requires_grad_(), v2.requires_grad_()
    mask = KeyPadding([30])
    out = attnkit.attention(q, k2, v2, mask=mask, backend="tiled", options=SMALL)
    ref, _ = reference_attention(q, k, v, mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (k2.grad[:, :, 30:] == 0).all() and (v2.grad[:, :, 30:] == 0).all()


def test_empty_tiles_are_skipped():
    calls = []
    base = SlidingWindow(4, 0)

    class Counting(SlidingWindow):
        def evaluate(self, *args, **kwargs):
            calls.append(args)
            return super().evaluate(*args, **kwargs)

    q, k, v = make_qkv(1, 1, 1, 256, 256, 8)
    out = attnkit.attention(q, k, v, mask=Counting(4, 0), backend="tiled", options=TiledOptions(32, 32))
    assert len(calls) <= 2 * 256 // 32  # only the diagonal band of tiles is evaluated, not 64 tiles
    torch.testing.assert_close(out, attnkit.attention(q, k, v, mask=base, backend="naive"))


def test_float16_tiny():
    q, k, v = make_qkv(1, 2, 1, 9, 13, 8, torch.float16)
    check_against_reference("tiled", q, k, v, mask=Causal(), options=TiledOptions(4, 4))


def test_options_validation():
    with pytest.raises(ValueError, match="block_q"):
        TiledOptions(block_q=0)
