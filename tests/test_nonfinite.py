"""The NaN/Inf policy (attnkit.backends.nonfinite): paid only when needed, the same on every backend.

* finite inputs are never copied (no K/V zeroing, no nan_to_num) on any policy backend;
* the host form (CPU) and the sync-free form (other devices, compile, torch.func) agree;
* ``kv_finite=True`` skips the K/V scan and changes nothing for finite K/V;
* thread counts 1 and 2 give bitwise-equal results (no data- or thread-dependent reductions);
* paths that once leaked: ``flex`` with NaN/Inf in V, ``sdpa``'s causal path at odd shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit
from attnkit import Causal, KeyPadding, SlidingWindow
from attnkit.backends import nonfinite
from attnkit.inputs import AttentionInputs
from attnkit.masks import BlockSparse

from .inputs import qkv

NAN, INF = float("nan"), float("inf")
B, HQ, HKV, T, D = 3, 6, 3, 53, 19  # odd sizes, GQA, unlike the other NaN tests


def _qkv(Tq=T, Tk=T, Dh=D, seed=1, dtype=torch.float32):
    return qkv(B, HQ, HKV, Tq, Tk, Dh, dtype=dtype, seed=seed)


def _masks(n=T):
    """A mask each policy backend runs at Tq = Tk = n (block_sparse needs a layout)."""
    layout = torch.ones(1, -(-n // 8), -(-n // 8), dtype=torch.bool).tril()
    padded = Causal() & KeyPadding([n, 40, 17])
    return {
        "naive": padded,
        "sdpa": padded,
        "decode": padded,
        "tiled": padded,
        "sliding_window": SlidingWindow(9, 0),
        "block_sparse": BlockSparse(layout, 8) & Causal(),
    }


POLICY = [name for name in _masks() if attnkit.list_backends()[name].nonfinite == "policy"]


class _CopiesOf(TorchDispatchMode):
    """Records every op that writes a new tensor of K's or V's shape from K or V (a copy of them)."""

    def __init__(self, *watched):
        super().__init__()
        self.watched = [(t.untyped_storage().data_ptr(), tuple(t.shape)) for t in watched]
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reads = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for ptr, shape in self.watched:
            if (ptr in reads and isinstance(out, torch.Tensor) and tuple(out.shape) == shape
                    and out.untyped_storage().data_ptr() != ptr):
                self.copies.append(func.__name__)
        return out


@pytest.mark.parametrize("backend", POLICY)
def test_finite_inputs_are_never_copied(backend, monkeypatch):
    mask = _masks()[backend]
    q, k, v = _qkv()
    monkeypatch.setattr(nonfinite, "_exact", lambda *a: pytest.fail("finite inputs took the slow path"))
    with _CopiesOf(k, v) as spy:
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
    assert spy.copies == [], f"{backend} copied K/V: {spy.copies}"
    assert torch.isfinite(out).all()
    monkeypatch.undo()
    k[1, 2, 5, 3] = NAN  # the spy does see copies: the slow path zeroes K and V
    with _CopiesOf(k, v) as spy:
        attnkit.attention(q, k, v, mask=mask, backend=backend)
    assert "masked_fill" in "".join(spy.copies)


@pytest.mark.parametrize("backend", POLICY)
def test_host_and_sync_free_forms_agree(backend, monkeypatch):
    mask = _masks()[backend]
    q, k, v = _qkv(seed=2)
    q[0, 4, 30, 1] = NAN  # a visible row
    q[2, 0, 50, 0] = INF
    k[1, 1, 11, 7] = NAN  # seen by later rows only
    v[2, 2, 44, 2] = -INF  # hidden from batch 2 by the padding (length 17)
    host = attnkit.attention(q, k, v, mask=mask, backend=backend)
    monkeypatch.setattr(nonfinite, "host_may_branch", lambda inp: False)
    free = attnkit.attention(q, k, v, mask=mask, backend=backend)
    assert torch.equal(torch.isnan(host), torch.isnan(free))
    assert torch.equal(host.nan_to_num(0.0), free.nan_to_num(0.0))
    keep = mask.materialize(T, T, q_offset=0, kv_offset=0, batch_size=B, num_heads=HQ).expand(B, HQ, T, T)
    sees = torch.zeros(B, HQ, T, dtype=torch.bool)
    sees[1, 2:4] = keep[1, 2:4, :, 11]
    sees[2, 4:6] = keep[2, 4:6, :, 44]
    sees[0, 4, 30] = sees[2, 0, 50] = True
    assert torch.equal(torch.isnan(host).any(-1), sees)


@pytest.mark.parametrize("backend", POLICY)
def test_kv_finite_skips_the_scan_and_changes_nothing(backend, monkeypatch):
    mask = _masks()[backend]
    q, k, v = _qkv(seed=3)
    want = attnkit.attention(q, k, v, mask=mask, backend=backend)
    reads = []
    original = nonfinite.finite_only
    monkeypatch.setattr(nonfinite, "finite_only", lambda x: reads.append(x) or original(x))
    got = attnkit.attention(q, k, v, mask=mask, backend=backend, kv_finite=True)
    monkeypatch.undo()
    assert torch.equal(got, want)
    assert [x is q for x in reads] == [True]  # q alone was scanned
    q[1, 3, 20, 4] = NAN  # the query is still checked
    got = attnkit.attention(q, k, v, mask=mask, backend=backend, kv_finite=True)
    assert torch.isnan(got[1, 3, 20]).all()
    rest = torch.ones(got.shape[:3], dtype=torch.bool)
    rest[1, 3, 20] = False
    assert torch.equal(got[rest], want[rest])


def test_kv_finite_must_be_a_bool():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="kv_finite: expected True, False or None, got int 1"):
        attnkit.attention(q, k, v, kv_finite=1)


def test_a_backend_declares_who_keeps_the_contract():
    from attnkit.registry import Backend, register_backend

    class Odd(Backend):
        name = "odd_nonfinite"
        nonfinite = "sometimes"

    with pytest.raises(TypeError, match="nonfinite must be 'policy' or 'self'"):
        register_backend(Odd)


def _runnable_exact():
    q, k, v = _qkv(Tq=97, Tk=97, Dh=21)
    names = []
    for name, impl in attnkit.list_backends().items():
        mask = _masks(97).get(name, Causal())
        if impl.exact and impl.can_run(AttentionInputs.create(q, k, v, mask=mask)):
            names.append(name)
    return names


@pytest.mark.parametrize("backend", _runnable_exact())
@pytest.mark.parametrize("poisoned", [False, True])
def test_one_and_two_threads_give_the_same_bits(backend, poisoned):
    mask = _masks(97).get(backend, Causal())
    q, k, v = _qkv(Tq=97, Tk=97, Dh=21, seed=4)
    if poisoned:
        k[0, 1, 60, 3] = NAN
        v[2, 0, 90, 0] = INF
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attnkit.attention(q, k, v, mask=mask, backend=backend)
        torch.set_num_threads(2)
        two = attnkit.attention(q, k, v, mask=mask, backend=backend)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.isnan(one), torch.isnan(two))
    assert torch.equal(one.nan_to_num(0.0), two.nan_to_num(0.0))


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("Tq,Tk,Dh", [(37, 37, 59), (37, 45, 59), (129, 129, 33)])
def test_sdpa_causal_path_keeps_a_bad_key_to_its_rows(where, value, Tq, Tk, Dh):
    """``is_causal`` path at odd lengths and head dims: a bad key reaches the rows at and after it."""
    q, k, v = _qkv(Tq=Tq, Tk=Tk, Dh=Dh, seed=5)
    clean = attnkit.attention(q, k, v, is_causal=True, backend="sdpa")
    key = Tq // 2
    bad = {"k": k.clone(), "v": v.clone()}
    bad[where][1, 2, key, Dh - 1] = value
    out = attnkit.attention(q, bad["k"], bad["v"], is_causal=True, backend="sdpa")
    sees = torch.zeros(out.shape[:3], dtype=torch.bool)
    sees[1, 4:6, key:] = True  # kv head 2 serves query heads 4, 5; top-left causal
    assert torch.equal(out[~sees], clean[~sees]), "a row that cannot see the key changed"
    assert torch.isnan(out[sees]).all(-1).all()


def test_flex_keeps_nonfinite_values_from_rows_that_cannot_see_them():
    from attnkit.backends.flex import FlexOptions, allow_cpu

    q, k, v = _qkv(Tq=40, Tk=40, Dh=16, seed=6)
    mask = Causal() & KeyPadding([40, 40, 25])
    with allow_cpu():
        inp = AttentionInputs.create(q, k, v, mask=mask)
        if not attnkit.list_backends()["flex"].can_run(inp):
            pytest.skip("flex is not available in this torch build")
        run = lambda k, v: attnkit.attention(q, k, v, mask=mask, backend="flex", options=FlexOptions(compile=False))  # noqa: E731
        clean = run(k, v)
        bad_v = v.clone()
        bad_v[0, 1, 20, 5] = NAN  # seen by rows 20.. of query heads 2, 3 in batch 0
        bad_v[2, 0, 30, 0] = INF  # padding of batch 2: seen by no row
        out = run(k, bad_v)
    sees = torch.zeros(out.shape[:3], dtype=torch.bool)
    sees[0, 2:4, 20:] = True
    assert torch.isnan(out[sees]).all(-1).all()
    torch.testing.assert_close(out[~sees], clean[~sees], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["naive", "tiled", "sliding_window", "block_sparse"])
def test_lse_is_poisoned_with_its_rows(backend):
    mask = _masks()[backend]
    q, k, v = _qkv(seed=7)
    clean_out, clean_lse = attnkit.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    k[0, 0, 9, 2] = NAN
    out, lse = attnkit.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    rows = torch.isnan(out).any(-1)
    assert rows[0, :2, 9].all() and not rows[0, :2, :9].any()
    assert torch.equal(torch.isnan(lse), rows)
    assert torch.equal(lse[~rows], clean_lse[~rows]) and torch.equal(out[~rows], clean_out[~rows])


@pytest.mark.parametrize("backend", ["naive", "sdpa", "tiled", "decode"])
def test_hidden_nan_keys_leave_the_gradients_alone(backend):
    """The slow path is differentiable: rows that cannot see the bad keys get the gradients they
    would get without them, and the bad entries get 0 (not NaN)."""
    mask = _masks()[backend]  # batch 2 sees 17 keys
    q, k, v = _qkv(seed=8)
    k2, v2 = k.clone(), v.clone()
    k2[2, :, 30:] = NAN
    v2[2, :, 20:] = INF
    grads = []
    for kk, vv in ((k, v), (k2, v2)):
        leaves = [x.clone().requires_grad_() for x in (q, kk, vv)]
        out = attnkit.attention(*leaves, mask=mask, backend=backend)
        out.pow(2).sum().backward()
        grads.append([x.grad for x in leaves])
    (dq, dk, dv), (dq2, dk2, dv2) = grads
    torch.testing.assert_close(dq2, dq)
    assert torch.isfinite(dk2).all() and torch.isfinite(dv2).all()
    assert torch.equal(dk2[2, :, 30:], torch.zeros_like(dk2[2, :, 30:]))
    torch.testing.assert_close(dk2[:, :, :20], dk[:, :, :20])


def test_vmap_over_keys_alone_takes_the_sync_free_form():
    q, k, v = _qkv(seed=9)
    ks = torch.stack([k, k.flip(2)])
    ks[1, 0, 1, 40, 0] = NAN  # seen by rows 40.. of query heads 2, 3 in batch 0 of the second map
    mapped = torch.vmap(lambda k_: attnkit.attention(q, k_, v, mask=Causal(), backend="naive"))(ks)
    looped = torch.stack([attnkit.attention(q, ks[i], v, mask=Causal(), backend="naive") for i in range(2)])
    assert torch.equal(torch.isnan(mapped), torch.isnan(looped))
    torch.testing.assert_close(mapped.nan_to_num(0.0), looped.nan_to_num(0.0))
    assert torch.isnan(mapped[1, 0, 2:4, 40:]).all() and torch.isfinite(mapped[1, 0, 2:4, :40]).all()


def test_every_builtin_backend_declares_who_keeps_the_contract():
    for name, impl in attnkit.list_backends().items():
        assert impl.capabilities()["nonfinite"] in ("policy", "self"), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_finiteness_sum_flags_nan_and_inf_in_every_dtype(dtype):
    """bfloat16 sums in its own dtype (float32's range), float16 in float32 where its own sum overflows:
    a NaN or an Inf anywhere in q, K or V reads as non-finite, and large finite values that a float16
    sum would overflow do not."""
    from attnkit.backends.nonfinite import all_finite
    from attnkit.cache.layers import all_finite as tokens_finite

    big = 6e4 if dtype == torch.float16 else 1e30
    q, k, v = (torch.full((1, 2, 64, 8), big, dtype=dtype) for _ in range(3))
    assert all_finite(AttentionInputs.create(q, k, v)) and tokens_finite(k, v)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for which in range(3):
            x = [t.clone() for t in (q, k, v)]
            x[which][0, 1, 33, 5] = bad
            assert not all_finite(AttentionInputs.create(*x)), (bad, which)
            if which:
                assert not tokens_finite(x[1], x[2]), (bad, which)


def test_a_float16_sum_past_its_range_is_looked_at_again_before_the_slow_path(monkeypatch):
    q, k, v = (x.abs() * 200 + 100 for x in _qkv(dtype=torch.float16))  # each sum far past 65504
    assert torch.isinf(k.sum()) and torch.isinf(q.sum())
    assert nonfinite.all_finite(AttentionInputs.create(q, k, v))  # finite: the float32 sums say so
    slow = []
    monkeypatch.setattr(nonfinite, "_exact", lambda *a, **kw: slow.append(1))
    attnkit.attention(q, k, v, backend="naive")
    assert not slow
    k[0, 0, 0, 0] = INF
    assert not nonfinite.all_finite(AttentionInputs.create(q, k, v))


def test_a_tensor_passed_as_several_of_q_k_v_is_read_once(monkeypatch):
    x, other, _ = _qkv(Tq=T, Tk=T, Dh=D)
    x = x[:, :HKV]
    reads = []
    original = nonfinite.finite_only
    monkeypatch.setattr(nonfinite, "finite_only", lambda t: reads.append(t) or original(t))
    assert nonfinite.all_finite(AttentionInputs.create(x, x, x))
    assert len(reads) == 1
    assert nonfinite.all_finite(AttentionInputs.create(x, other, other)) and len(reads) == 3
    monkeypatch.undo()
    x[0, 1, 2, 3] = NAN
    assert not nonfinite.all_finite(AttentionInputs.create(x, x, x))
    assert not nonfinite.all_finite(AttentionInputs.create(other, x, x))
    assert not nonfinite.all_finite(AttentionInputs.create(other, other, x))
