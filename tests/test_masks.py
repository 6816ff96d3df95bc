"""Mask primitives: golden matrices, block_status consistency, algebra, drawings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import (
    BlockStatus, Causal, Custom, Dense, Document, KeyPadding, SlidingWindow, as_mask, from_key_padding_mask,
)


def test_causal_bottom_right_golden_matrices():
    assert Causal().materialize(2, 5)[0, 0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert Causal().materialize(5, 2)[0, 0].int().tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]


def test_causal_decode_step_sees_every_key():
    assert Causal().materialize(1, 7).all()


def test_explicit_offsets_top_left():
    keep = Causal().materialize(2, 5, q_offset=0, kv_offset=0)[0, 0]
    assert keep.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]


def test_sliding_window_inclusive_bounds():
    keep = SlidingWindow(2, 1).materialize(6, 6)[0, 0].int()
    expected = [[1 if -2 <= j - i <= 1 else 0 for j in range(6)] for i in range(6)]
    assert keep.tolist() == expected
    assert SlidingWindow(2, 1).to_string(6, 6).splitlines()[3] == "·████·"


def test_window_at_least_length_is_full_and_unbounded_defaults():
    assert SlidingWindow(10, 10).materialize(5, 5).all()
    assert torch.equal(SlidingWindow(None, 0).materialize(7, 7), Causal().materialize(7, 7))


def test_key_padding_and_document():
    keep = KeyPadding([3, 5]).materialize(2, 5)
    assert keep.shape == (2, 1, 2, 5)
    assert keep[0, 0, 0].int().tolist() == [1, 1, 1, 0, 0] and keep[1].all()
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    doc = Document(ids).materialize(5, 5)[0, 0].int()
    assert doc.tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]


def test_dense_is_relative_to_the_call():
    keep = torch.tensor([[True, False], [False, True]])
    m = Dense(keep)
    assert torch.equal(m.materialize(2, 2, q_offset=10, kv_offset=10)[0, 0], keep)
    assert m.block_status((11, 12), (10, 11), q_offset=10, kv_offset=10) is BlockStatus.EMPTY


def test_and_or_flatten_and_evaluate():
    m = Causal() & SlidingWindow(1, 0) & KeyPadding([4])
    assert m.conjuncts() == (Causal(), SlidingWindow(1, 0), m.conjuncts()[2]) and len(m.leaves()) == 3
    a = Causal().materialize(5, 5) & SlidingWindow(1, 0).materialize(5, 5) & KeyPadding([4]).materialize(5, 5)
    assert torch.equal(m.materialize(5, 5), a)
    o = SlidingWindow(0, 0) | Custom(lambda b, h, q, k: k == 0)
    keep = o.materialize(4, 4, batch_size=1, num_heads=1)[0, 0]
    assert keep[:, 0].all() and keep.diagonal().all()


def test_key_padding_mask_converter_flips_polarity():
    kpm = torch.tensor([[False, False, True]])
    keep = from_key_padding_mask(kpm).materialize(1, 3)
    assert keep.reshape(-1).tolist() == [True, True, False]


def test_as_mask_rejects_float_tensor():
    with pytest.raises(TypeError, match="bias="):
        as_mask(torch.zeros(2, 2))


def test_density_and_drawing():
    assert Causal().density(4, 4) == pytest.approx(10 / 16)
    assert Causal().to_string(2, 5) == "████·\n█████"


MASK_FACTORIES = [
    lambda: Causal(),
    lambda: SlidingWindow(3, 1),
    lambda: SlidingWindow(None, 2),
    lambda: KeyPadding([7, 20]),
    lambda: Document(torch.tensor([[0] * 5 + [1] * 9 + [2] * 10, [0] * 12 + [1] * 12])),
    lambda: Custom(lambda b, h, q, k: (q + k) % 4 == 0),
]


@st.composite
def mask_trees(draw, depth=2):
    if depth == 0 or draw(st.booleans()):
        return draw(st.sampled_from(MASK_FACTORIES))()
    left, right = draw(mask_trees(depth=depth - 1)), draw(mask_trees(depth=depth - 1))
    return left & right if draw(st.booleans()) else left | right


@settings(max_examples=60, deadline=None)
@given(
    mask=mask_trees(),
    q0=st.integers(0, 20), q_len=st.integers(1, 6),
    k0=st.integers(0, 20), k_len=st.integers(1, 6),
)
def test_block_status_is_consistent_with_materialize(mask, q0, q_len, k0, k_len):
    """FULL means every pair kept, EMPTY means none, for every structured mask and combination."""
    q1, k1 = min(q0 + q_len, 24), min(k0 + k_len, 24)
    if q1 <= q0 or k1 <= k0:
        return
    keep = mask.evaluate((q0, q1), (k0, k1), q_offset=0, kv_offset=0, batch_size=2, num_heads=1)
    status = mask.block_status((q0, q1), (k0, k1), batch_size=2, num_heads=1)
    if status is BlockStatus.FULL:
        assert keep.all()
    elif status is BlockStatus.EMPTY:
        assert not keep.any()


@pytest.mark.parametrize("build, match", [
    (lambda: KeyPadding([1.5, 2.7]),
     r"KeyPadding\(lengths\)=\[1\.5, 2\.7\]: expected integers, got dtype torch\.float32"),
    (lambda: KeyPadding([True, False]),
     r"KeyPadding\(lengths\)=\[True, False\]: expected integers, got dtype torch\.bool"),
    (lambda: KeyPadding(torch.tensor([True])), r"KeyPadding\(lengths\)=\[True\]: expected integers"),
    (lambda: Document([[0.0, 1.0]]), r"Document\(ids\)=\[\[0\.0, 1\.0\]\]: expected integers"),
    (lambda: KeyPadding("ab"), r"KeyPadding\(lengths\): expected a sequence of ints"),
])
def test_integer_arguments_refuse_floats_and_bools(build, match):
    """Regression: floats were truncated (1.5 -> 1) and bools read as 0/1, silently."""
    with pytest.raises(TypeError, match=match):
        build()


def test_integer_arguments_accept_ints_tensors_and_ranges():
    assert KeyPadding([3, 5]).lengths.tolist() == [3, 5]
    assert KeyPadding(torch.tensor([3, 5], dtype=torch.int32)).lengths.dtype == torch.long
    assert KeyPadding(range(2, 4)).lengths.tolist() == [2, 3]
    assert Document([[0, 0, 1]]).ids.shape == (1, 3)


def test_custom_equality_is_identity_so_no_plan_is_shared():
    """Plans are cached by mask equality: a new Custom of the same function (a bound method reading
    state that changed since) must never equal the old one, nor hash with it, inside And/Or too."""

    class Lengths:
        def __init__(self):
            self.n = 3

        def keep(self, b, h, q, k):
            return k < self.n

    m = Lengths()
    first, second = Custom(m.keep), Custom(m.keep)
    assert first == first and hash(first) == hash(first)
    assert first != second and len({first, second}) == 2
    assert (Causal() & first) != (Causal() & second) and (Causal() & first) == (Causal() & first)
    assert len({Causal() | first, Causal() | second}) == 2
