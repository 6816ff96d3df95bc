"""attnkit.masks.sparse: BlockSparse layouts and their pattern builders, GlobalTokens and longformer()."""

from __future__ import annotations

import random

import pytest
import torch

from attnkit import BlockSparse, BlockStatus, Causal, GlobalTokens, longformer


def brute_status(mask, q_range, kv_range):
    keep = mask.evaluate(q_range, kv_range, q_offset=0, kv_offset=0)
    return BlockStatus.FULL if keep.all() else BlockStatus.EMPTY if not keep.any() else BlockStatus.PARTIAL


PATTERNS = {
    "window_global": lambda: BlockSparse.window_global(9, 4, window=1, global_blocks=(0, 5)),
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


def test_window_global_drawing_matches_docstring():
    expected = "██████\n███···\n████··\n█·███·\n█··███\n█···██"
    mask = BlockSparse.window_global(6, 1, window=1, global_blocks=(0,))
    assert mask.to_string(blocks=True) == expected
    assert expected in BlockSparse.window_global.__doc__.replace("            ", "")
    assert mask.to_string(6, 6) == expected  # block size 1: the element drawing is the layout


def test_bigbird_is_seeded_and_has_window_global_random():
    a, b, c = (BlockSparse.bigbird(16, 8, seed=s) for s in (1, 1, 2))
    assert torch.equal(a.layout, b.layout) and not torch.equal(a.layout, c.layout)
    lay = a.layout[0]
    idx = torch.arange(16)
    assert lay[idx, idx].all() and lay[idx[1:], idx[:-1]].all()  # window
    assert lay[0].all() and lay[:, 0].all()  # global block
    assert (lay.sum(1)[1:] >= 3 + 1).all()  # window (3) + global column, plus random blocks
    assert 0 < a.density() < 1 and abs(a.density(128, 128) - a.density()) < 1e-6
    assert a.density() == pytest.approx(float(lay.float().mean()))


def test_causal_patterns_are_lower_triangular_and_causal():
    for mask in (BlockSparse.fixed(8, 4, stride=4), BlockSparse.strided(8, 4, stride=3),
                 BlockSparse.bigbird(8, 4, causal=True)):
        assert mask.is_causal() is False and Causal() in mask.conjuncts() and mask.block_layout() is not None
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
        BlockSparse.window_global(4, 4, global_blocks=(7,))
    mask = BlockSparse(torch.ones(2, 2, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="ceil"):
        mask.validate(1, 1, 9, 9, 0, 0)


def test_causal_longformer_is_causal_and_keeps_global_keys_for_later_queries():
    """Regression: causal=True used to let query 0 see the later global token at position 4."""
    mask = longformer(1, [0, 4], causal=True)
    keep = mask.materialize(8, 8)[0, 0]
    assert not torch.triu(keep, diagonal=1).any()  # no query sees a later key, global or not
    assert keep[:, 0].all()  # every query sees global key 0
    assert keep[4:, 4].all() and not keep[:4, 4].any()  # global key 4: only from position 4 on
    assert keep[4, :5].all()  # global query 4 sees every earlier key
    window = torch.tril(torch.ones(8, 8, dtype=torch.bool)) & ~torch.tril(torch.ones(8, 8, dtype=torch.bool), -2)
    assert (keep & window).equal(window)  # the causal window itself
    assert all(j in (0, 4) or i == 4 for i, j in (keep & ~window).nonzero().tolist())  # beyond it: globals only


@pytest.mark.parametrize("build, error, match", [
    (lambda: longformer(2, [0.5]), TypeError, r"GlobalTokens\(positions\)=\[0\.5\]: expected integers"),
    (lambda: longformer(2, [True]), TypeError, r"GlobalTokens\(positions\)=\[True\]: expected integers"),
    (lambda: longformer(-1, [0]), ValueError, r"longformer\(window=-1\): expected a non-negative int"),
    (lambda: longformer(2.0, [0]), ValueError, r"longformer\(window=2\.0\)"),
    (lambda: BlockSparse.window_global(4, 4, global_blocks=(True,)), ValueError, "global block True"),
    (lambda: BlockSparse.bigbird(0, 4), ValueError, r"num_blocks=0: expected a positive int"),
    (lambda: BlockSparse.random(4, 4, density=float("nan")), ValueError, r"density=nan\)"),
    (lambda: BlockSparse(torch.ones(2, 2, dtype=torch.bool), True), ValueError, r"block_size=True\)"),
])
def test_nonsense_inputs_are_refused(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_to_string_needs_sizes_or_blocks():
    mask = BlockSparse.bigbird(4, 2)
    with pytest.raises(ValueError, match="blocks=True"):
        mask.to_string()
    assert mask.to_string(blocks=True).count("\n") == 3
