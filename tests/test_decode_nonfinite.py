"""The native decode kernel keeps the NaN/Inf contract itself (``attnkit.backends.nonfinite``), so plain
K/V tensors pay no scan of K and V per step:

* NaN/Inf in a key, value or query a row may attend gives that row what IEEE arithmetic gives
  (the float64 reference's non-finite pattern, element for element);
* NaN/Inf where a row may not look (masked keys, padding, keys only later queries see, another head's
  keys under a per-head mask, slots past a cache row's length, int8's stored NaN slots) changes no bit
  of that row (same kernel, same shapes);
* ``kv_finite=True`` changes nothing for the kernel, and the policy's K/V scan is never called; the
  PyTorch-op twin stays under the policy.

Skipped (with the reason) when the extension is not built.
"""

from __future__ import annotations

import pytest
import torch

from attnkit import Causal, KeyPadding, SlidingWindow, attention
from attnkit.backends import nonfinite
from attnkit.backends.decode import DecodeOptions
from attnkit.masks import Dense

from .reference import keep_grid, reference_attention
from .test_decode_native import _REASON, _handle

pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))

NAN, INF = float("nan"), float("inf")
B, HQ, HKV, TK, D = 3, 8, 2, 700, 24
SPLIT = DecodeOptions(native_split_tokens=256)  # three splits of the keys: the LSE merge is exercised


def _keep(Tq: int) -> torch.Tensor:
    """A per-head keep (B, Hq, Tq, Tk): heads of one K/V group see different keys, one row sees none."""
    g = torch.Generator().manual_seed(11)
    keep = torch.rand(B, HQ, Tq, TK, generator=g) < 0.7
    keep[:, 1, :, TK - 3:] = False  # head 1 never sees the last keys, head 0 (same K/V head) does
    keep[:, 0, :, TK - 3:] = True
    keep[1, 5] = False  # a fully masked row: 0
    return keep


def _mask(kind: str, Tq: int):
    return {"none": None, "causal": Causal(), "window": SlidingWindow(40, 0), "padding": KeyPadding([TK, 650, 200]),
            "causal_padding": Causal() & KeyPadding([TK, 699, 300]), "dense": Dense(_keep(Tq))}[kind]


def _bad_keys(Tq: int):
    """(b, K/V head, key): seen by some rows only (the last query under causal), hidden (padding, window),
    in every split; batch 0's K/V head 1 stays clean."""
    return [(0, 0, TK - 1), (1, 1, TK - Tq), (2, 0, TK - 2), (1, 0, 300), (2, 1, 5), (0, 0, 520)]


def _touched(keep: torch.Tensor, bad_k: list, bad_q: list) -> torch.Tensor:
    """(B, Hq, Tq) bool: the rows that may attend a bad key, or whose own query is bad."""
    G = HQ // HKV
    rows = torch.zeros(keep.shape[:3], dtype=torch.bool)
    for b, hk, j in bad_k:
        rows[b, hk * G:(hk + 1) * G] |= keep[b, hk * G:(hk + 1) * G, :, j]
    for b, h, i in bad_q:
        rows[b, h, i] = True
    return rows


def _assert_contract(out, lse, clean_out, clean_lse, ref, touched, atol):
    """Untouched rows: bitwise the clean run. Touched rows: the reference's non-finite pattern, and its
    values where finite."""
    assert torch.equal(out[~touched], clean_out[~touched]), "a row that cannot see a bad element changed"
    assert torch.equal(lse[~touched], clean_lse[~touched])
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref)), "the non-finite pattern differs from IEEE's"
    fin = torch.isfinite(ref)
    torch.testing.assert_close(out.double()[fin], ref[fin], atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Tq", [1, 4])
@pytest.mark.parametrize("kind", ["none", "causal", "window", "padding", "causal_padding", "dense"])
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_plain_tensors_keep_the_contract(dtype, Tq, kind, value, where):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, HQ, Tq, D, generator=g).to(dtype)
    k, v = (torch.randn(B, HKV, TK, D, generator=g).to(dtype) for _ in range(2))
    mask, q_offset = _mask(kind, Tq), TK - Tq

    def run(q, k, v, kv_finite=None):
        return attention(q, k, v, mask=mask, q_offset=q_offset, backend="decode", return_lse=True, options=SPLIT,
                         kv_finite=kv_finite)

    clean_out, clean_lse = run(q, k, v)
    bad_k, bad_q = [], []
    if where == "q":
        bad_q = [(0, 3, Tq - 1), (2, 6, 0)] + ([(1, 5, 0)] if kind == "dense" else [])  # (1, 5): sees nothing
        for b, h, i in bad_q:
            q[b, h, i, 2] = value
    else:
        bad_k = _bad_keys(Tq)
        x = k if where == "k" else v
        for b, hk, j in bad_k:
            x[b, hk, j, 3] = value
    out, lse = run(q, k, v)
    vouched = run(q, k, v, kv_finite=True)  # the kernel does not rely on the caller's word
    assert torch.equal(out.nan_to_num(7.0), vouched[0].nan_to_num(7.0)) and torch.equal(out.isnan(), vouched[0].isnan())
    keep = keep_grid(mask, B, HQ, Tq, TK, q_offset=q_offset, kv_offset=0, device=q.device)
    ref, _ = reference_attention(q.double(), k.double(), v.double(), mask=mask, q_offset=q_offset)
    touched = _touched(keep, bad_k, [r for r in bad_q if keep[r].any()])
    assert touched.any() and (~touched).any()
    _assert_contract(out, lse, clean_out, clean_lse, ref, touched, 2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("fmt", ["int8", "paged", "paged-int8"])
@pytest.mark.parametrize("Tq", [1, 4])
@pytest.mark.parametrize("kind", ["none", "causal", "window"])
def test_cache_handles_keep_the_contract(fmt, Tq, kind):
    """NaN stored in a handle (int8: zeros with a NaN scale) at visible and hidden slots, NaN in the slots past
    each row's length: read in place by the kernel."""
    g = torch.Generator().manual_seed(2)
    lengths = (TK, TK - 37, 260)
    q = torch.randn(B, HQ, Tq, D, generator=g)
    k, v = (torch.randn(B, HKV, TK, D, generator=g) for _ in range(2))
    (h, _), dense = _handle(fmt, k, v, lengths, block_size=16)
    mask = _mask(kind, Tq)

    def run():
        return attention(q, h, h, mask=mask, backend="decode", return_lse=True, kv_finite=True,
                         options=DecodeOptions(implementation="native", native_split_tokens=256))

    clean_out, clean_lse = run()
    bad = [(0, 0, TK - 1, "v"), (1, 1, lengths[1] - Tq, "k"), (2, 0, 259, "v"), (1, 0, 300, "k"), (2, 1, 5, "k"),
           (0, 0, 520, "v")]  # batch 0, K/V head 1: clean
    for b, hk, j, which in bad:
        vals, scale = (h.k, h.k_scale) if which == "k" else (h.v, h.v_scale)
        at = (hk, int(h.block_table[b, j // 16]), j % 16) if h.paged else (b, hk, j)
        if scale is not None:  # how an int8 cache stores a vector holding NaN
            vals[at], scale[at] = 0, NAN
            dense["kv".index(which)][b, hk, j] = NAN
        else:
            vals[at + (3,)] = NAN
            dense["kv".index(which)][b, hk, j, 3] = NAN
    out, lse = run()
    touched = torch.zeros(B, HQ, Tq, dtype=torch.bool)
    ref = torch.zeros(B, HQ, Tq, D, dtype=torch.float64)
    for b, L in enumerate(lengths):  # each row at its own last positions
        keep = keep_grid(mask, 1, HQ, Tq, L, q_offset=L - Tq, kv_offset=0, device=q.device)
        touched[b] = _touched(keep, [(0, hk, j) for bb, hk, j, _ in bad if bb == b and j < L], [])[0]
        ref[b] = reference_attention(q[b:b + 1].double(), dense[0][b:b + 1, :, :L].double(),
                                     dense[1][b:b + 1, :, :L].double(), mask=mask, q_offset=L - Tq)[0][0]
    assert touched.any() and (~touched).any()
    _assert_contract(out, lse, clean_out, clean_lse, ref, touched, 1e-4)


def test_the_kernel_runs_without_the_policy_scan_and_the_twin_under_it(monkeypatch):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = (torch.randn(2, 2, 300, 16, generator=g) for _ in range(2))
    scanned = []
    original = nonfinite.finite_only
    monkeypatch.setattr(nonfinite, "finite_only", lambda x: scanned.append(x) or original(x))
    monkeypatch.setattr(nonfinite, "_exact", lambda *a, **kw: pytest.fail("the kernel's call took the policy's path"))
    for mask in (None, Causal(), KeyPadding([300, 120])):
        attention(q, k, v, mask=mask, backend="decode")
    assert scanned == [], "the policy scanned q, K or V for the native decode kernel"
    attention(q, k, v, backend="decode", options=DecodeOptions(implementation="torch"))
    assert [x is q for x in scanned] == [True, False, False]  # the twin: q, K and V scanned


def test_the_twin_still_keeps_the_contract_through_the_policy():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 2, 16, generator=g)
    k, v = (torch.randn(2, 2, 300, 16, generator=g) for _ in range(2))
    v[1, 0, 299, 0] = NAN  # seen by the last query of batch 1, heads 0 and 1
    out = attention(q, k, v, mask=Causal(), backend="decode", options=DecodeOptions(implementation="torch"))
    assert torch.isnan(out[1, :2, 1]).any(-1).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :, 0]).all() and torch.isfinite(out[1, 2:]).all()
