"""The shared argument checks: accepted values come back unchanged, rejected ones name themselves."""

import math

import pytest
import torch

from attnkit._validate import finite_float, non_negative_int, positive_int


@pytest.mark.parametrize("bad", [0, -3, 1.0, 2.5, True, False, "4", None, float("nan")])
def test_positive_int_rejects_with_name_value_and_fix(bad):
    with pytest.raises(ValueError) as info:
        positive_int(bad, "count", owner="Thing", fix="pass e.g. 8")
    text = str(info.value)
    assert text.startswith(f"Thing(count={bad!r}): expected a positive int") and text.endswith("Fix: pass e.g. 8.")
    with pytest.raises(ValueError, match=rf"^count={bad!r}: expected a positive int\.$"):
        positive_int(bad, "count")


def test_positive_int_and_non_negative_int_accept():
    assert positive_int(7, "n") == 7 and positive_int(None, "n", allow_none=True) is None
    assert non_negative_int(0, "n") == 0 and non_negative_int(None, "n", allow_none=True) is None
    with pytest.raises(ValueError, match=r"n=-1: expected a non-negative int or None\."):
        non_negative_int(-1, "n", allow_none=True)


def test_finite_float_bounds():
    assert finite_float(0.5, "p", low=0, high=1) == 0.5 and finite_float(3, "x") == 3.0
    for bad in (math.nan, math.inf, -math.inf, True, "1", 1.5):
        with pytest.raises(ValueError, match=r"p=.*expected a finite number >= 0 and <= 1"):
            finite_float(bad, "p", low=0, high=1)
    with pytest.raises(ValueError, match=r"t=0: expected a finite number > 0\."):
        finite_float(0, "t", low=0, low_inclusive=False)


def test_check_int_at_least_is_the_one_count_check():
    from attnkit._validate import check_int_at_least

    assert check_int_at_least("n", 3, 2) == 3 and check_int_at_least("n", None, allow_none=True) is None
    for bad in (0, True, 1.5, "2"):
        with pytest.raises(ValueError, match=rf"^TransformerConfig.num_heads: expected an int >= 1, got {bad!r:.3}"):
            check_int_at_least("TransformerConfig.num_heads", bad)
    with pytest.raises(ValueError, match=r"max_seqlen_q: expected None or an int >= 0, got -1\.$"):
        check_int_at_least("max_seqlen_q", -1, 0, allow_none=True)


def test_broadcast_shapes_equals_torchs():
    from attnkit._validate import broadcast_shapes

    for shapes in [((1, 2, 3), (4, 1, 3)), ((0, 1), (1, 5)), ((3,), (2, 1)), ((), (2,)), ((2, 1, 4), (1, 3, 1), (3, 1)),
                   ((5,),), ((1, 1), (1,))]:
        assert broadcast_shapes(*shapes) == torch.broadcast_shapes(*shapes), shapes
    for shapes in [((2,), (3,)), ((2, 3), (3, 3)), ((4, 1), (1, 3), (2, 3))]:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            broadcast_shapes(*shapes)
