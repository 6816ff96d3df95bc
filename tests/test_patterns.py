"""BlockSparse layouts and their pattern builders, GlobalTokens and longformer()."""

from __future__ import annotations

import random

import pytest
import torch

from attnkit import And, BlockSparse, BlockStatus, Causal, GlobalTokens, SlidingWindow, longformer


def brute_status(mask, q_range, kv_range):
    keep = mask.evaluate(q_range, kv_range, q_offset=0, kv_offset=0)
    return BlockStatus.FULL if keep.all() else BlockStatus.EMPTY if not keep.any() else BlockStatus.PARTIAL


PATTERNS = {
    "longformer": lambda: BlockSparse.longformer(9, 4, window=1, global_blocks=(0, 5)),
    "bigbird": lambda: BlockSparse.bigbird(9, 4, seed=3),
    "fixed": lambda: BlockSparse.fixed(9, 4, stride=3, causal=False),
    "strided": lambda: BlockSparse.strided(9, 4, stride=3, causal=False),
    "random": lambda: BlockSparse.random(9, 4, density=0.3, seed=1),
    "per_head": lambda: BlockSparse(torch.rand(3, 9, 9, generator=torch.Generator().manual_seed(0)) > 0.5, 4),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_block_status_matches_evaluation(name):
    mask = PATTERNS[name]()
    rng = random.Random(0)
    for _ in range(200):
        q0, k0 = rng.randrange(36), rng.randrange(36)
        q1, k1 = rng.randrange(q0 + 1, 37), rng.randrange(k0 + 1, 37)
        assert mask.block_status((q0, q1), (k0, k1)) is brute_status(mask, (q0, q1), (k0, k1)), (q0, q1, k0, k1)


def test_longformer_drawing_matches_docstring():
    expected = "██████\n███···\n████··\n█·███·\n█··███\n█···██"
    assert BlockSparse.longformer(6, 1, window=1, global_blocks=(0,)).layout_string() == expected
    assert expected in BlockSparse.longformer.__doc__.replace("            ", "")


def test_bigbird_is_seeded_and_has_window_global_random():
    a, b, c = (BlockSparse.bigbird(16, 8, seed=s) for s in (1, 1, 2))
    assert torch.equal(a.layout, b.layout) and not torch.equal(a.layout, c.layout)
    lay = a.layout[0]
    idx = torch.arange(16)
    assert lay[idx, idx].all() and lay[idx[1:], idx[:-1]].all()  # window
    assert lay[0].all() and lay[:, 0].all()  # global block
    assert (lay.sum(1)[1:] >= 3 + 1).all()  # window (3) + global column, plus random blocks
    assert 0 < a.block_density() < 1 and abs(a.density(128, 128) - a.block_density()) < 1e-6


def test_causal_patterns_are_lower_triangular_and_causal():
    for mask in (BlockSparse.fixed(8, 4, stride=4), BlockSparse.strided(8, 4, stride=3), BlockSparse.bigbird(8, 4, causal=True)):
        assert isinstance(mask, And) and Causal() in mask.parts
        keep = mask.materialize(32, 32)[0, 0]
        assert not torch.triu(keep, diagonal=1).any()
        assert keep.diagonal().all()


def test_fixed_and_strided_layouts():
    fixed = BlockSparse.fixed(6, 1, stride=3, summary=1, causal=False).layout[0]
    # own segment of 3 blocks plus the last block of every segment (columns 2 and 5)
    assert fixed[0].tolist() == [True, True, True, False, False, True]
    assert fixed[4].tolist() == [False, False, True, True, True, True]
    strided = BlockSparse.strided(7, 1, stride=3, causal=False).layout[0]
    assert strided[6].tolist() == [True, False, False, True, True, True, True]


def test_every_block_on_equals_no_mask():
    mask = BlockSparse(torch.ones(4, 4, dtype=torch.bool), 8)
    assert mask.block_status((0, 32), (0, 32)) is BlockStatus.FULL
    assert mask.materialize(25, 30).all()


def test_global_tokens_and_element_longformer():
    mask = longformer(1, [0, 4])
    keep = mask.materialize(6, 6)[0, 0]
    assert keep[0].all() and keep[:, 0].all() and keep[4].all() and keep[:, 4].all()
    assert keep[2].tolist() == [True, True, True, True, True, False]
    g = GlobalTokens([3])
    for q_range, kv_range in [((0, 3), (0, 3)), ((0, 4), (5, 9)), ((3, 4), (0, 9)), ((0, 9), (3, 4))]:
        status = g.block_status(q_range, kv_range)
        assert status is brute_status(g, q_range, kv_range) or status is BlockStatus.PARTIAL


def test_validation_errors():
    with pytest.raises(TypeError, match="torch.bool"):
        BlockSparse(torch.ones(2, 2), 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockSparse(torch.ones(2, 2, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="density"):
        BlockSparse.random(4, 4, density=1.5)
    with pytest.raises(ValueError, match="global block"):
        BlockSparse.longformer(4, 4, global_blocks=(7,))
    mask = BlockSparse(torch.ones(2, 2, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="ceil"):
        mask.validate(1, 1, 9, 9, 0, 0)
