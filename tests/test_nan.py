"""The NaN/Inf contract of attention(), for every exact backend:

* NaN in what a row may attend (its query, a key or value it may see) makes that row NaN;
* NaN/Inf in what a row may not see (masked keys, keys only later queries see, padding) changes
  nothing in that row; a row with no allowed key is 0 whatever its inputs hold;
* ``scale`` NaN/±Inf is refused; a zero or negative scale means what it says.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, SlidingWindow
from attnkit.inputs import AttentionInputs

from .inputs import qkv

B, HQ, HKV, T, D = 2, 4, 2, 24, 8
NAN, INF = float("nan"), float("inf")
EXACT = [name for name, impl in attnkit.list_backends().items() if impl.exact]
# A mask per backend that it runs, where a key (KEY) is seen by the rows from KEY on, but not by
# the rows before it: NaN there must reach those later rows only.
MASKS = [Causal(), SlidingWindow(6, 0)]
KEY = 13


def _inputs(dtype=torch.float32):
    return qkv(B, HQ, HKV, T, T, D, dtype=dtype)


def _mask_for(backend):
    q, k, v = _inputs()
    for mask in MASKS:
        if attnkit.list_backends()[backend].can_run(AttentionInputs.create(q, k, v, mask=mask)):
            return mask
    pytest.skip(f"{backend} runs none of {MASKS}")


def _seen_by(mask, key):
    """Rows (query indices) that may attend ``key`` under ``mask`` at Tq = Tk = T."""
    keep = mask.materialize(T, T, q_offset=0, kv_offset=0)[0, 0]
    return keep[:, key]




@pytest.mark.parametrize("backend", EXACT)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("value", [NAN, INF])
def test_nonfinite_key_reaches_only_the_rows_that_see_it(backend, where, value):
    mask = _mask_for(backend)
    q, k, v = _inputs()
    clean = attnkit.attention(q, k, v, mask=mask, backend=backend)
    bad_k, bad_v = k.clone(), v.clone()
    (bad_k if where == "k" else bad_v)[1, 0, KEY, 3] = value  # batch 1, kv head 0 (query heads 0, 1)
    out = attnkit.attention(q, bad_k, bad_v, mask=mask, backend=backend)
    seen = _seen_by(mask, KEY)
    assert seen[KEY] and not seen[:KEY].any()  # later queries see it, earlier ones do not
    affected = out[1, :2][:, seen]
    untouched = torch.ones_like(out, dtype=torch.bool)
    untouched[1, :2, seen] = False
    assert torch.equal(out[untouched], clean[untouched]), "a row that cannot see the key changed"
    if value != value:  # NaN: every row that may attend it is NaN
        assert torch.isnan(affected).any(dim=-1).all(), "a row that sees the NaN key is not NaN"


@pytest.mark.parametrize("backend", EXACT)
def test_nan_query_row_is_nan_and_nothing_else_changes(backend):
    mask = _mask_for(backend)
    q, k, v = _inputs()
    clean = attnkit.attention(q, k, v, mask=mask, backend=backend)
    bad_q = q.clone()
    bad_q[0, 1, 5, 2] = NAN
    out = attnkit.attention(bad_q, k, v, mask=mask, backend=backend)
    assert torch.isnan(out[0, 1, 5]).any()
    rest = torch.ones_like(out, dtype=torch.bool)
    rest[0, 1, 5] = False
    assert torch.equal(out[rest], clean[rest])


@pytest.mark.parametrize("backend", EXACT)
def test_nonfinite_padding_changes_nothing_and_empty_rows_stay_zero(backend):
    q, k, v = _inputs()
    lengths = [T, 10]
    for mask in (KeyPadding(lengths), Causal() & KeyPadding(lengths), SlidingWindow(6, 0) & KeyPadding(lengths)):
        if attnkit.list_backends()[backend].can_run(AttentionInputs.create(q, k, v, mask=mask)):
            break
    else:
        pytest.skip(f"{backend} runs no padded mask here")
    clean = attnkit.attention(q, k, v, mask=mask, backend=backend)
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[1, :, 10:] = NAN
    bad_v[1, :, 12:] = INF
    out = attnkit.attention(q, bad_k, bad_v, mask=mask, backend=backend)
    assert torch.equal(out, clean)
    # A query row with no allowed key is 0, even when the query itself is NaN.
    empty = KeyPadding([T, 0]) if mask.is_causal() is False and "KeyPadding" in mask.structure_key() else None
    if empty is not None and attnkit.list_backends()[backend].can_run(AttentionInputs.create(q, k, v, mask=empty)):
        bad_q = q.clone()
        bad_q[1] = NAN
        out = attnkit.attention(bad_q, bad_k, bad_v, mask=empty, backend=backend)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("scale", [NAN, INF, -INF])
def test_nonfinite_scale_is_refused(scale):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="scale: expected a finite number"):
        attnkit.attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match="scale"):
        attnkit.explain(q, k, v, scale=scale)


@pytest.mark.parametrize("backend", EXACT)
@pytest.mark.parametrize("scale", [0.0, -0.7])
def test_zero_and_negative_scale_mean_what_they_say(backend, scale):
    mask = _mask_for(backend)
    q, k, v = _inputs(torch.float64)
    keep = mask.materialize(T, T, q_offset=0, kv_offset=0)
    scores = (q @ k.repeat_interleave(HQ // HKV, 1).transpose(-2, -1) * scale).masked_fill(~keep, -INF)
    expected = torch.softmax(scores, dim=-1) @ v.repeat_interleave(HQ // HKV, 1)
    if not attnkit.list_backends()[backend].can_run(AttentionInputs.create(q, k, v, mask=mask)):
        pytest.skip(f"{backend} does not run float64")
    out = attnkit.attention(q, k, v, mask=mask, scale=scale, backend=backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-9, rtol=1e-9)


def test_sdpa_guard_for_rows_whose_every_score_is_nan():
    """SDPA's CPU kernel drops NaN from the row max in its scalar tail: with few keys an all-NaN row
    would come out 0. Small key counts are checked explicitly; larger ones propagate NaN."""
    for Tk in (1, 2, 7, 15, 16, 17, 63, 64, 65, 200):
        q = torch.randn(1, 2, 3, 8)
        k, v = torch.randn(1, 2, Tk, 8), torch.randn(1, 2, Tk, 8)
        q[0, 0, 1] = NAN
        out = attnkit.attention(q, k, v, backend="sdpa")
        assert torch.isnan(out[0, 0, 1]).all() and torch.isfinite(out[0, 1]).all(), Tk
        k[0, 1] = NAN
        out = attnkit.attention(torch.randn(1, 2, 3, 8), k, v, backend="sdpa")
        assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, 0]).all(), Tk


@pytest.mark.parametrize("host", [False, True])
def test_host_reads_only_the_finiteness_sums(monkeypatch, host):
    """The sync-free form (other devices, torch.compile, torch.func) never asks the host whether
    values are finite (a device stall per layer); on the CPU the host reads the one check only:
    a scan of q, K and V (of q alone when the caller vouches for K/V with kv_finite=True)."""
    from attnkit.backends import nonfinite

    monkeypatch.setattr(nonfinite, "host_may_branch", lambda inp: host)
    count = {"n": 0, "inside": False}
    for name in ("__bool__", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            count["n"] += not count["inside"]
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    scan = nonfinite.finite_only

    def counted_scan(x):  # one read of the host, whether in C or through a sum and .item()
        count["n"] += 1
        count["inside"] = True
        try:
            return scan(x)
        finally:
            count["inside"] = False

    monkeypatch.setattr(nonfinite, "finite_only", counted_scan)
    q, k, v = _inputs()
    calls = [
        dict(mask=Causal()),  # is_causal path
        dict(mask=Causal(), q_offset=5),  # materialized
        dict(mask=KeyPadding(torch.tensor([T, 10]))),
        dict(mask=SlidingWindow(6, 0)),
    ]
    for backend in ("naive", "sdpa", "tiled", "sliding_window", "decode"):
        for kw in calls:
            inp = AttentionInputs.create(q, k, v, **kw)
            if not attnkit.list_backends()[backend].can_run(inp):
                continue
            for kv_finite, reads in ((None, 3), (True, 1)):
                count["n"] = 0
                attnkit.attention(q, k, v, backend=backend, kv_finite=kv_finite, **kw)
                assert count["n"] == (reads if host else 0), (backend, kw, kv_finite)
    inp = AttentionInputs.create(q, k, v, mask=Causal())
    attnkit.dispatch.select(inp)  # the first use probes the machine once (CPU-side reference problems)
    count["n"] = 0
    attnkit.dispatch.select(inp)  # auto: selection reads no tensor either
    assert count["n"] == 0


@pytest.mark.parametrize("Tq,Tk,q_offset", [(5, 9, 0), (9, 5, 0), (7, 7, None), (3, 11, None), (1, 20, None),
                                            (4, 70, 0), (1, 70, None), (6, 6, 2), (130, 130, None), (150, 90, 0)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_paths_keep_the_contract_like_naive(Tq, Tk, q_offset, with_bias, dtype):
    """Every SDPA plan (no mask, is_causal with dropped keys, materialized) against naive's NaN pattern."""
    g = torch.Generator().manual_seed(Tq * 100 + Tk)
    q, k, v = (torch.randn(2, 4, Tq, 8, generator=g).to(dtype), torch.randn(2, 2, Tk, 8, generator=g).to(dtype),
               torch.randn(2, 2, Tk, 8, generator=g).to(dtype))
    q[1, 3, Tq // 2, 0] = NAN
    q[0, 0, Tq - 1, 0] = NAN  # a late row: bf16 kernels can drop a NaN query in any row
    k[0, 1, Tk // 3, 5] = NAN
    v[1, 0, Tk - 2, 1] = INF
    bias = torch.randn(1, 4, Tq, Tk, generator=g) if with_bias else None
    for mask in (None, Causal(), Causal() & KeyPadding([Tk, max(1, Tk // 2)])):
        kw = dict(mask=mask, bias=bias, q_offset=q_offset)
        if mask is None and q_offset is not None:
            continue
        got = attnkit.attention(q, k, v, backend="sdpa", **kw)
        want = attnkit.attention(q, k, v, backend="naive", **kw)
        # Inf follows IEEE arithmetic (Inf or NaN): compare which rows are not finite.
        assert torch.equal(torch.isfinite(got).all(-1), torch.isfinite(want).all(-1)), (mask, kw)
        finite_rows = torch.isfinite(want).all(-1)
        torch.testing.assert_close(got[finite_rows].float(), want[finite_rows].float(),
                                   **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))


@pytest.mark.parametrize("backend", ["naive", "sdpa", "auto"])
def test_a_nan_row_does_not_reach_its_neighbour_in_bf16(backend):
    """CPU bfloat16 GEMMs with a long inner dimension pack rows in pairs: a NaN row of p must not
    spill into the next one (p @ v over 700 keys)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 700, 16, generator=g).bfloat16() for _ in range(3))
    q[0, 1, 599, 2] = NAN
    out = attnkit.attention(q, k, v, mask=Causal(), backend=backend)
    assert (~torch.isfinite(out[0, 1])).any(-1).nonzero().flatten().tolist() == [599]
    assert torch.isfinite(out[0, 0]).all()
