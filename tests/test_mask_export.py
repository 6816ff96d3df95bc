"""Masks export their structure as data: each class's vectorized tile grid equals its per-tile
``block_status``, and ``mask_params`` gathers the conjuncts' positional parameters."""

from __future__ import annotations

import pytest
import torch

from attnkit.masks import (BlockSparse, Causal, Custom, Dense, Document, GlobalTokens, KeyPadding,
                           Padding, SlidingWindow, TopK, longformer, mask_params, tile_grid)

g = torch.Generator().manual_seed(0)
MASKS = {
    "causal": Causal(),
    "window": SlidingWindow(5, 2),
    "keypadding": KeyPadding([30, 41]),
    "padding": Padding(torch.rand(2, 80, generator=g) > 0.3),
    "document": Document(torch.randint(0, 3, (2, 80), generator=g).sort(-1).values),
    "bigbird": BlockSparse.bigbird(10, 8, seed=1),
    "random_causal": BlockSparse.random(10, 8, density=0.3, causal=True),
    "global": GlobalTokens([3, 17]),
    "longformer": longformer(4, [0, 9]),
    "custom": Custom(lambda b, h, q, k: (q + k + h) % 3 == 0),
    "document_and_window": Document(torch.arange(80) // 7) & SlidingWindow(6, 0),
    "topk": TopK(torch.randint(-1, 45, (2, 1, 37, 20), generator=g)),  # lists for Tq=37 over 45 keys
    "topk_per_head": TopK(torch.randint(-1, 45, (1, 4, 37, 6), generator=g)) & Causal(),
}


def _loop(mask, Tq, Tk, q_offset, bq, bk):
    """The grid tile by tile through ``block_status`` (the definition)."""
    grid = torch.empty(-(-Tq // bq), -(-Tk // bk), dtype=torch.uint8)
    for i, q0 in enumerate(range(0, Tq, bq)):
        for j, k0 in enumerate(range(0, Tk, bk)):
            grid[i, j] = mask.block_status((q_offset + q0, q_offset + min(q0 + bq, Tq)), (k0, min(k0 + bk, Tk)),
                                           q_offset=q_offset, kv_offset=0, batch_size=2, num_heads=4).value
    return grid


@pytest.mark.parametrize("name", list(MASKS))
def test_vectorized_tile_grid_equals_block_status_per_tile(name):
    mask = MASKS[name]
    for Tq, Tk, bq, bk in ((37, 45, 8, 16), (1, 45, 4, 4), (45, 45, 7, 9), (60, 45, 8, 16), (20, 45, 16, 16)):
        q_offset = Tk - Tq
        try:
            mask.validate(2, 4, Tq, Tk, q_offset, 0)
        except ValueError:
            continue
        assert torch.equal(tile_grid(mask, Tq, Tk, q_offset, 0, bq, bk, 2, 4), _loop(mask, Tq, Tk, q_offset, bq, bk))


@pytest.mark.parametrize("name", [*MASKS, "none", "dense", "or"])
def test_spare_grid_adds_one_empty_tile_row_and_column(name):
    # the grid a traced kernel reads: every dimension at least 2, the call's tiles as without the spare one
    keep = torch.rand(2, 1, 45, 45, generator=g) > 0.5
    extra = {"none": None, "dense": Dense(keep), "or": SlidingWindow(3, 0) | Causal()}
    mask = extra[name] if name in extra else MASKS[name]
    for Tq, Tk, bq, bk in ((37, 45, 8, 16), (1, 45, 4, 4), (45, 45, 7, 9), (20, 45, 16, 16), (3, 5, 8, 16)):
        q_offset = Tk - Tq
        try:
            if mask is not None:
                mask.validate(2, 4, Tq, Tk, q_offset, 0)
        except ValueError:
            continue
        grid = tile_grid(mask, Tq, Tk, q_offset, 0, bq, bk, 2, 4)
        spare = tile_grid(mask, Tq, Tk, q_offset, 0, bq, bk, 2, 4, spare=True)
        nQ, nK = grid.shape
        assert spare.shape == (nQ + 1, nK + 1) and spare.is_contiguous() and spare.dtype == torch.uint8
        assert torch.equal(spare[:nQ, :nK], grid)
        assert not spare[nQ].any() and not spare[:, nK].any()  # EMPTY


def test_dense_grid_is_evaluated_exactly():
    keep = torch.rand(2, 1, 37, 45, generator=g) > 0.5
    keep[:, :, :8, :16] = True
    keep[:, :, 8:16, 16:32] = False
    grid = tile_grid(Dense(keep), 37, 45, 8, 0, 8, 16, 2, 4)
    assert torch.equal(grid, _loop(Dense(keep), 37, 45, 8, 8, 16))
    assert grid[0, 0] == 2 and grid[1, 1] == 0


def test_mask_params_gather_positional_parameters():
    doc = torch.arange(64) // 9
    layout = BlockSparse.bigbird(8, 8, seed=0)
    custom = Custom(lambda b, h, q, k: q != k)
    mask = (Causal() & SlidingWindow(7, 3) & KeyPadding([40, 50]) & KeyPadding([45, 20])
            & Document(doc) & layout & custom)
    p = mask_params(mask, 2)
    assert (p.band.left, p.band.right) == (7, 0)
    assert p.lengths.tolist() == [40, 20] and torch.equal(p.doc, doc[None]) and p.layout is layout.layout
    assert p.layout_block_size == 8 and p.rest == (custom,) and p.valid is None
    assert len(p.beyond_band) == 5  # everything but the two band conjuncts
    assert mask_params(None, 3).rest == () and mask_params(None, 3).band.left is None
    assert mask_params(KeyPadding([5]), 3).lengths.tolist() == [5, 5, 5]


def test_mask_params_of_a_value_mask_are_computed_once_per_batch_size():
    from attnkit.masks import export

    export._PARAMS.clear()
    window = Causal() & SlidingWindow(5, 0)
    first = mask_params(window, 2)
    assert mask_params(Causal() & SlidingWindow(5, 0), 2) is first  # an equal mask shares the entry
    assert vars(first) == vars(export._mask_params(window, 2))
    assert mask_params(window, 3) is not first and mask_params(SlidingWindow(5, 1) & Causal(), 2) is not first
    padded = Causal() & KeyPadding(torch.tensor([3, 4]))  # holds a tensor: never stored
    assert mask_params(padded, 2).lengths.tolist() == [3, 4]
    assert all(not any(isinstance(leaf, KeyPadding) for leaf in key[0].leaves()) for key in export._PARAMS)
