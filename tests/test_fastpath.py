"""attention()'s per-call helpers in C (``attnkit/csrc/fastpath.cpp``): the finiteness scan of the
NaN/Inf policy and the dispatcher's per-call key. Each must answer exactly what Python's own path
answers, or None where it does not read the tensor; without the extension Python's path runs."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal
from attnkit._validate import finite_only
from attnkit.csrc import loader
from attnkit.dispatch import calls

FAST = loader.fastpath()
needs_build = pytest.mark.skipif(FAST is None, reason="the native extension is not built")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# 0 and 1 element, odd lengths (vector tails), and past the parallel grain (several chunks)
SIZES = [0, 1, 17, 1025, 3 * 2**16 + 5]


def _python_answer(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all())


@needs_build
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_finite_finds_every_nonfinite_value_wherever_it_is(dtype, n):
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    assert FAST.finite(x) is True
    for at in sorted({0, n // 2, n - 1, max(n - 17, 0)}) if n else ():
        for value in (float("nan"), float("inf"), float("-inf")):
            y = x.clone()
            y[at] = value
            assert FAST.finite(y) is False, (at, value)
            assert FAST.finite(y) == _python_answer(y)


@needs_build
@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_takes_the_extremes_of_each_dtype_as_finite(dtype):
    info = torch.finfo(dtype)
    x = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, 0.0, -0.0], dtype=dtype)
    assert FAST.finite(x) is True
    big = torch.full((64,), info.max, dtype=dtype)  # finite values whose sum overflows
    assert FAST.finite(big) is True and finite_only(big)


@needs_build
def test_finite_reads_dense_layouts_and_declines_the_rest():
    x = torch.randn(2, 5, 7, 3)
    t = x.transpose(1, 2)  # dense, not contiguous: read in memory order
    assert FAST.finite(t) is True
    x[1, 4, 6, 2] = float("nan")
    assert FAST.finite(t) is False
    assert FAST.finite(x[:, :, ::2]) is None  # holes: Python's sum
    assert FAST.finite(torch.randn(3, 1).expand(3, 4)) is None  # expanded
    assert FAST.finite(torch.arange(5)) is None  # integers
    assert FAST.finite(torch.empty(4, device="meta")) is None
    assert FAST.finite(torch.nn.Parameter(torch.randn(3))) is None  # not exactly torch.Tensor

    class Sub(torch.Tensor):
        pass

    assert FAST.finite(torch.randn(3).as_subclass(Sub)) is None
    with pytest.raises(TypeError, match="finite"):
        FAST.finite()


@needs_build
def test_finite_declines_functorch_wrappers():
    seen = []

    def f(x):
        seen.append(FAST.finite(x))
        return x.sum()

    torch.func.grad(f)(torch.randn(4))
    torch.func.vmap(f)(torch.randn(2, 4))
    assert seen == [None, None]


@pytest.mark.parametrize("path", ["C", "python"])
def test_finite_only_answers_alike_on_both_paths(path, monkeypatch):
    if path == "python":
        monkeypatch.setattr(loader, "finite", lambda x: None)
    elif FAST is None:
        pytest.skip("the native extension is not built")
    for dtype in DTYPES:
        x = torch.randn(3, 1, 37, 9, dtype=torch.float64).to(dtype)
        assert finite_only(x) and finite_only(x[:, :, ::3])
        x[2, 0, 36, 8] = float("nan")
        assert not finite_only(x) and not finite_only(x.transpose(2, 3)) and not finite_only(x[..., ::4])


@needs_build
def test_key_is_exact_and_changes_with_what_validation_reads():
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    base = FAST.key(q, k, v)
    assert isinstance(base, bytes) and base == FAST.key(q.clone(), k.clone(), v.clone())
    assert base == FAST.key(q.transpose(2, 3).contiguous().transpose(2, 3), k, v)  # strides are not in it
    different = [
        FAST.key(torch.randn(1, 4, 4, 8), k, v),  # a shape
        FAST.key(q, torch.randn(1, 2, 5, 8, dtype=torch.float64), v),  # a dtype
        FAST.key(q, k, torch.randn(1, 2, 5, 8, 1)[..., 0]),  # the same shape: equal
        FAST.key(q.requires_grad_(), k, v),  # requires_grad
    ]
    assert different[0] != base and different[1] != base and different[2] == base and different[3] != base
    with torch.no_grad():
        assert FAST.key(q, k, v) != different[3]  # gradients not recorded
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        assert FAST.key(q, k, v) != different[3]  # torch's thread count is in the key
    finally:
        torch.set_num_threads(threads)
    assert FAST.key(torch.nn.Parameter(q.detach()), k, v) is None
    assert FAST.key(q, k, 3) is None
    with pytest.raises(TypeError, match="key"):
        FAST.key(q, k)


class _Float(float):
    pass


@needs_build
def test_key_packs_scalars_with_their_types():
    """1, 1.0 and True are one Python key but different calls to validate: the types are packed."""
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    keys = [FAST.key(q, k, v, x) for x in (None, True, False, 0, 1, 1.0, 0.0, -0.0, 2**40)]
    assert all(isinstance(x, bytes) for x in keys) and len(set(keys)) == len(keys)
    assert FAST.key(q, k, v, 0.5, None) == FAST.key(q, k, v, 0.5, None) != FAST.key(q, k, v, None, 0.5)
    for odd in (_Float(1.0), 2**64, "1", torch.tensor(1.0), [1]):  # not keyed in C: Python's path
        assert FAST.key(q, k, v, odd) is None
    with pytest.raises(TypeError, match="at most 8"):
        FAST.key(q, k, v, *range(9))


@pytest.mark.parametrize("path", ["C key", "python"])
def test_cached_calls_follow_shape_dtype_and_grad_on_every_key_path(path, monkeypatch):
    monkeypatch.setattr(calls, "_CALLS", {})
    if path == "python":  # the key in C (the rest in Python), or all in Python
        monkeypatch.setattr(loader, "key", lambda *args: None)
    elif FAST is None:
        pytest.skip("the native extension is not built")
    g = torch.Generator().manual_seed(0)
    for Tq, dtype in ((1, torch.float32), (1, torch.float32), (3, torch.float32), (1, torch.float64)):
        q = torch.randn(1, 4, Tq, 16, generator=g, dtype=dtype)
        k, v = (torch.randn(1, 2, 9, 16, generator=g, dtype=dtype) for _ in range(2))
        out = attnkit.attention(q, k, v, mask=Causal())
        want = attnkit.attention(q, k, v, mask=Causal(), backend="naive")
        assert out.shape == (1, 4, Tq, 16) and out.dtype == dtype
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert calls._CALLS and all(isinstance(key[0], bytes) == (path == "C key") for key in calls._CALLS)
    q.requires_grad_()
    attnkit.attention(q, k, v, mask=Causal()).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    q2 = torch.randn(1, 4, 1, 16, dtype=torch.float64)
    q2[0, 1, 0, 3] = float("nan")  # a hit of the cache still runs the NaN/Inf policy
    out = attnkit.attention(q2, k, v, mask=Causal())
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, [0, 2, 3]]).all()
