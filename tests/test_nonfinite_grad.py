"""Gradients under the NaN/Inf policy (attnkit.backends.nonfinite): they follow the forward.

The contract: a row whose output is NaN because of a NaN/Inf it may see gets NaN gradients for what it
read — its query row, and the K and V rows of every key it may see (what IEEE arithmetic and PyTorch's
math path give) — whatever its upstream gradient (0 x NaN is NaN). Everything else is what the same
backend gives on the same inputs without the bad element, with the NaN rows' upstream gradient
zeroed (the NaN rows then add exactly 0 everywhere, the GEMM shapes are the same):

* dq of rows that cannot see it: bitwise;
* dK/dV of keys no NaN row reads: finite and equal (within float32 rounding of a sum over rows);
* a NaN/Inf where no row may look (masked keys, a row with no allowed key): nothing changes, bitwise.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, SlidingWindow
from attnkit.backends import nonfinite
from attnkit.inputs import AttentionInputs
from attnkit.masks import BlockSparse

from .inputs import qkv

NAN, INF = float("nan"), float("inf")
B, HQ, HKV, T, D = 2, 4, 2, 37, 16  # GQA: two query heads per key/value head
LENGTHS = [T, 23]


def _base_masks():
    return {"causal": Causal(), "window": SlidingWindow(7, 0), "padding": SlidingWindow(9, 0) & KeyPadding(LENGTHS)}


def _mask_for(backend, kind):
    """The ``kind`` mask in a form ``backend`` runs (block_sparse needs a layout, sliding_window a window)."""
    mask = _base_masks()[kind]
    if backend == "block_sparse":
        layout = torch.ones(1, -(-T // 8), -(-T // 8), dtype=torch.bool).tril()
        return BlockSparse(layout, 8) & mask
    if backend == "sliding_window" and kind == "causal":
        return SlidingWindow(T, 0)
    return mask


def _qkv(seed=0):
    return qkv(B, HQ, HKV, T, T, D, seed=seed)


def _exact_backends():
    q, k, v = _qkv()
    return [name for name, impl in attnkit.list_backends().items() if impl.exact]


def _runs(backend, mask):
    q, k, v = (x.requires_grad_() for x in _qkv())
    impl = attnkit.list_backends()[backend]
    return impl.can_run(AttentionInputs.create(q, k, v, mask=mask))


def _keep(mask):
    return mask.materialize(T, T, q_offset=0, kv_offset=0, batch_size=B, num_heads=HQ).expand(B, HQ, T, T)


def _expected(keep, case):
    """``(where, rows, reads)``: the bad element's index, the rows that may see it (B, Hq, Tq) and the
    keys those rows read (B, Hkv, Tk), from the materialized mask (independent of the policy's code)."""
    rows = torch.zeros(B, HQ, T, dtype=torch.bool)
    if case in ("q_inf", "q_nan"):
        where = ("q", (1, 3, 20, 5))
        rows[1, 3, 20] = keep[1, 3, 20].any()
    elif case == "q_no_key":  # padded: row 33 of batch 1 sees keys 25..33 of its window, all past its 23 keys
        where = ("q", (1, 2, 33, 0))
    elif case in ("k_nan", "v_inf"):
        where = ("k" if case == "k_nan" else "v", (0, 1, 11, 3))
        rows[0, 2:4] = keep[0, 2:4, :, 11]
    elif case == "k_masked":  # padding: key 30 of batch 1 is never seen
        where = ("k", (1, 0, 30, 2))
    reads = (keep & rows[..., None]).any(dim=2).view(B, HKV, HQ // HKV, T).any(dim=2)
    return where, rows, reads


def _run(backend, mask, q, k, v, dout, **kwargs):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attnkit.attention(q, k, v, mask=mask, backend=backend, **kwargs)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _nan_rows(x):
    """(..., N) bool: the row is NaN throughout; asserts no row is NaN in part only."""
    nan = torch.isnan(x)
    assert torch.equal(nan.any(-1), nan.all(-1)), "a row NaN in part only"
    return nan.all(-1)


CASES = {"q_inf": INF, "q_nan": NAN, "k_nan": NAN, "v_inf": -INF, "q_no_key": INF, "k_masked": NAN}


HIDDEN = ("q_no_key", "k_masked")  # need positions no row may see: the padded mask
COMBOS = [(case, kind) for case in CASES for kind in _base_masks() if case not in HIDDEN or kind == "padding"]


@pytest.mark.parametrize("case,kind", COMBOS)
@pytest.mark.parametrize("backend", _exact_backends())
def test_gradients_follow_the_forward(backend, case, kind):
    mask = _mask_for(backend, kind)
    if not _runs(backend, mask):
        pytest.skip(f"{backend} runs no {kind} mask here")
    keep = _keep(mask)
    (name, index), rows, reads = _expected(keep, case)
    q, k, v = _qkv(seed=1)
    dout = torch.randn(B, HQ, T, D, generator=torch.Generator().manual_seed(2))
    bad = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    bad[name][index] = CASES[case]
    got = _run(backend, mask, bad["q"], bad["k"], bad["v"], dout)
    want = _run(backend, mask, q, k, v, dout.masked_fill(rows[..., None], 0.0))  # same shapes, bad rows add 0
    out, dq, dk, dv = got
    assert torch.equal(_nan_rows(out), rows), "forward: the rows that see it are NaN, no other"
    assert torch.equal(_nan_rows(dq), rows), "dq: NaN exactly on the NaN rows"
    assert torch.equal(_nan_rows(dk), reads) and torch.equal(_nan_rows(dv), reads), "dK/dV: NaN on the keys they read"
    assert torch.equal(out[~rows], want[0][~rows]) and torch.equal(dq[~rows], want[1][~rows])
    for g, w in ((dk, want[2]), (dv, want[3])):
        torch.testing.assert_close(g[~reads], w[~reads], rtol=1e-6, atol=1e-6)
    if not rows.any():  # nothing may see it: nothing changes at all
        for g, w in zip(got, want):
            assert torch.equal(g, w)


@pytest.mark.parametrize("backend", _exact_backends())
def test_a_nan_row_with_no_upstream_gradient_still_poisons_what_it_read(backend):
    """0 x NaN is NaN: a loss that leaves the NaN row out does not make its gradients finite; a loss
    whose gradient is NaN there (``out.pow(2)``) reaches no key the row does not read."""
    mask = _mask_for(backend, "causal")
    if not _runs(backend, mask):
        pytest.skip(f"{backend} runs no causal mask here")
    keep = _keep(mask)
    (_, index), rows, reads = _expected(keep, "q_inf")
    q, k, v = _qkv(seed=3)
    q[index] = INF
    for dout in (torch.ones(B, HQ, T, D).masked_fill(rows[..., None], 0.0),
                 torch.ones(B, HQ, T, D).masked_fill(rows[..., None], NAN)):
        _, dq, dk, dv = _run(backend, mask, q, k, v, dout)
        assert torch.equal(_nan_rows(dq), rows)
        assert torch.equal(_nan_rows(dk), reads) and torch.equal(_nan_rows(dv), reads)


@pytest.mark.parametrize("backend", _exact_backends())
def test_inf_query_row_nan_output_and_gradient_others_finite(backend):
    """PyTorch's SDPA property (test_non_masked_rows_nan_props): an Inf in a query row makes that
    row's output and its dq NaN; the other rows' outputs and dq stay finite, a fully masked row 0."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 16, generator=g) for _ in range(3))
    q[0, :, 2, :] = INF
    keep = torch.ones(6, 6, dtype=torch.bool)
    keep[5] = False  # a fully masked row
    impl = attnkit.list_backends()[backend]
    if not impl.can_run(AttentionInputs.create(q.requires_grad_(), k, v, attn_mask=keep)):
        pytest.skip(f"{backend} runs no dense mask")
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attnkit.attention(q, k, v, attn_mask=keep, backend=backend)
    out.sum().backward()
    assert torch.isnan(out[:, :, 2]).all() and torch.isnan(q.grad[:, :, 2]).all()
    others = [0, 1, 3, 4]
    assert torch.isfinite(out[:, :, others]).all() and torch.isfinite(q.grad[:, :, others]).all()
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    assert torch.equal(q.grad[:, :, 5], torch.zeros_like(q.grad[:, :, 5]))
    assert torch.isnan(k.grad).all() and torch.isnan(v.grad).all()  # row 2 reads every key


@pytest.mark.parametrize("backend", ["naive", "tiled", "native"])
def test_host_and_sync_free_forms_give_the_same_gradients(backend, monkeypatch):
    mask = _mask_for(backend, "padding")
    if not _runs(backend, mask):
        pytest.skip(f"{backend} is not available")
    q, k, v = _qkv(seed=5)
    q[0, 1, 9, 2] = NAN
    k[1, 0, 4, 1] = INF
    k[1, 1, 33, 0] = NAN  # padding: hidden
    dout = torch.randn(B, HQ, T, D, generator=torch.Generator().manual_seed(6))
    host = _run(backend, mask, q, k, v, dout)
    monkeypatch.setattr(nonfinite, "host_may_branch", lambda inp: False)
    if backend == "native":
        from attnkit.backends import native

        monkeypatch.setattr(native, "host_may_branch", lambda inp: False)
    free = _run(backend, mask, q, k, v, dout)
    for h, f in zip(host, free):
        assert torch.equal(h.isnan(), f.isnan()) and h.isnan().any()
        assert torch.equal(h.nan_to_num(0.0), f.nan_to_num(0.0))


def test_sinks_and_lse_follow_the_rows():
    """The sink of a head with a NaN row gets a NaN gradient, the other heads' stay finite; the LSE's
    upstream gradient on a NaN row does not reach keys the row does not read."""
    q, k, v = _qkv(seed=7)
    q[0, 1, 3, 0] = NAN  # head 1, row 3 reads keys 0..3 of kv head 0
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    sinks = torch.zeros(HQ, requires_grad=True)
    out, lse = attnkit.attention(q, k, v, mask=Causal(), backend="naive", sinks=sinks, return_lse=True)
    nan_lse = torch.zeros(B, HQ, T, dtype=torch.bool)
    nan_lse[0, 1, 3] = True
    assert torch.equal(torch.isnan(lse), nan_lse)
    (out.sum() + lse.pow(2).sum()).backward()
    assert torch.isnan(sinks.grad[1]) and torch.isfinite(sinks.grad[[0, 2, 3]]).all()
    nan_keys = _nan_rows(k.grad)
    assert nan_keys[0, 0, :4].all() and not nan_keys[0, 0, 4:].any() and not nan_keys[1].any()
    assert torch.equal(_nan_rows(v.grad), nan_keys)


def test_finite_inputs_never_build_the_gradient_rule(monkeypatch):
    q, k, v = (x.requires_grad_() for x in _qkv(seed=8))
    monkeypatch.setattr(nonfinite, "poison", lambda *a: pytest.fail("finite inputs took the NaN path"))
    for backend in ("naive", "tiled"):
        attnkit.attention(q, k, v, mask=Causal(), backend=backend).sum().backward()


@pytest.mark.parametrize("backend", ["tiled", "native"])
def test_compiled_gradients_follow_the_forward(backend):
    """Traced (nothing read on the host), the rule gives the eager gradients."""
    if not attnkit.list_backends()[backend].available():
        pytest.skip(f"{backend} is not available")
    torch._dynamo.reset()
    q, k, v = _qkv(seed=9)
    q[0, 0, 2, 1] = INF
    k[1, 1, 6, 0] = NAN
    dout = torch.randn(B, HQ, T, D, generator=torch.Generator().manual_seed(10))

    def f(q, k, v):
        return attnkit.attention(q, k, v, mask=Causal(), backend=backend)

    eager = _run(backend, Causal(), q, k, v, dout)
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    out.backward(dout)
    for e, c in zip(eager, (out.detach(), q.grad, k.grad, v.grad)):
        assert torch.equal(e.isnan(), c.isnan()) and e.isnan().any()
        torch.testing.assert_close(c.nan_to_num(0.0), e.nan_to_num(0.0), rtol=1e-5, atol=1e-6)
