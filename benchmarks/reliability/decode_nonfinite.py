"""Reliability probes of the NaN/Inf contract on the ``decode`` backend (its native kernel keeps it itself).

Each probe decodes with NaN/Inf placed in a query, key or value, and is "ok" when every row that may not
see the bad element is bitwise what it is without it (same kernel, same shapes) and every row that sees it
is what IEEE arithmetic gives: non-finite for NaN (and for a +Inf score), weight 0 for a -Inf score. Masks:
none, ``Causal`` with several queries, ``SlidingWindow``, ``KeyPadding``, a per-head ``Dense`` keep; GQA;
fp32/bf16; int8 and ragged cache handles; several splits of the keys. One more probe checks that plain
tensors on the native kernel pay no scan of K and V. Where the extension is not built the ``decode``
backend runs its PyTorch-op twin under the policy, and the same checks hold.
"""

from __future__ import annotations

import probe_reliability as pr
import torch

import attnkit
from attnkit import Causal, KeyPadding, SlidingWindow
from attnkit.backends import nonfinite
from attnkit.backends.decode import DecodeOptions
from attnkit.cache import quantize_int8
from attnkit.kv_handle import KVHandle
from attnkit.masks import Dense

NAN, INF = float("nan"), float("inf")
_SPLIT = DecodeOptions(native_split_tokens=256)


def _keep(mask, B, Hq, Tq, Tk):
    if mask is None:
        return torch.ones(B, Hq, Tq, Tk, dtype=torch.bool)
    return mask.materialize(Tq, Tk, q_offset=Tk - Tq, kv_offset=0, batch_size=B, num_heads=Hq).expand(B, Hq, Tq, Tk)


def contract(B=2, Hq=4, Hkv=2, Tq=1, Tk=700, D=32, mask=None, bad=(), dtype=torch.float32, bias=None, seed=0):
    """A probe: ``bad`` lists ``(tensor, b, head, position, value)`` ("q": query head and row, "k"/"v": K/V head
    and key) written at feature 1; ``mask`` a function of (B, Hq, Tq, Tk) or None."""
    def run():
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(B, Hq, Tq, D, generator=g).to(dtype)
        k, v = (torch.randn(B, Hkv, Tk, D, generator=g).to(dtype) for _ in range(2))
        m = None if mask is None else mask(B, Hq, Tq, Tk)

        def call(q, k, v):
            return attnkit.attention(q, k, v, mask=m, bias=bias, q_offset=Tk - Tq, backend="decode", options=_SPLIT)

        clean = call(q, k, v)
        x = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        keep = _keep(m, B, Hq, Tq, Tk)
        G = Hq // Hkv
        touched = torch.zeros(B, Hq, Tq, dtype=torch.bool)
        for name, b, h, j, value in bad:
            x[name][b, h, j, 1] = value
            if name == "q":
                touched[b, h, j] |= bool(keep[b, h, j].any())
            else:
                touched[b, h * G:(h + 1) * G] |= keep[b, h * G:(h + 1) * G, :, j]
        out = call(x["q"], x["k"], x["v"])
        if not torch.equal(out[~touched], clean[~touched]):
            return False
        return bool((~torch.isfinite(out[touched])).any(-1).all())
    return run


def inf_score(sign, Tk=700, D=32):
    """A key whose score is ``sign`` * Inf (k = Inf times the sign of q): +Inf makes its row NaN (inf - inf in
    the softmax), -Inf gives it weight 0 (the row equals the row with that key masked out); the other head's
    row is exact either way."""
    def run():
        g = torch.Generator().manual_seed(5)
        q = torch.randn(1, 2, 1, D, generator=g)
        k, v = (torch.randn(1, 2, Tk, D, generator=g) for _ in range(2))
        k[0, 0, 400] = sign * INF * torch.sign(q[0, 0, 0])
        out = attnkit.attention(q, k, v, backend="decode", options=_SPLIT)
        keep = torch.ones(1, 2, 1, Tk, dtype=torch.bool)
        keep[0, 0, 0, 400] = False
        want = pr.reference(q, k.nan_to_num(0.0, 0.0, 0.0), v, keep=keep)
        if not pr.close(out[:, 1], want[:, 1]):
            return False
        return pr.close(out, want) if sign < 0 else bool(torch.isnan(out[0, 0]).all())
    return run


def no_kv_scan():
    """Plain tensors on the native kernel: the policy scans neither K nor V (the twin, without the
    extension, is scanned: that is its contract)."""
    def run():
        g = torch.Generator().manual_seed(6)
        q = torch.randn(2, 8, 1, 64, generator=g)
        k, v = (torch.randn(2, 2, 2048, 64, generator=g) for _ in range(2))
        if "native C++ split-K decode kernel" not in str(attnkit.explain(q, k, v, backend="decode")):
            return True
        scanned, real = [], nonfinite.finite_only
        nonfinite.finite_only = lambda t: scanned.append(t) or real(t)
        try:
            for mask in (None, Causal(), KeyPadding([2048, 1000])):
                attnkit.attention(q, k, v, mask=mask, backend="decode")
        finally:
            nonfinite.finite_only = real
        return not any(t is k or t is v for t in scanned)
    return run


def int8_handle(window=64):
    """A contiguous int8 cache with rows of their own lengths: a NaN token stored as int8 stores it (zeros, scale
    NaN) hidden by a sliding window and one seen; NaN scales past each row's length."""
    def run():
        g = torch.Generator().manual_seed(7)
        B, Hq, Hkv, S, D, lengths = 3, 6, 2, 900, 40, (900, 611, 130)
        k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
        k[1, 0, 100, 2] = NAN  # hidden from row 1 (length 611) by the window
        v[2, 1, 129, 0] = NAN  # row 2's last key: seen
        (kq, ks), (vq, vs) = quantize_int8(k, finite=False), quantize_int8(v, finite=False)
        for b, n in enumerate(lengths):
            ks[b, :, n:] = vs[b, :, n:] = NAN
        q = torch.randn(B, Hq, 1, D, generator=g)
        h = KVHandle("int8", kq, vq, lengths, torch.float32, False, ks, vs)
        out = attnkit.attention(q, h, h, mask=SlidingWindow(window, 0), backend="decode")
        ok = bool(torch.isfinite(out[:2]).all()) and bool(torch.isnan(out[2, 3:]).any(-1).all())
        clean_h = KVHandle("int8", kq, vq, lengths, torch.float32, True, ks.nan_to_num(1.0), vs.nan_to_num(1.0))
        clean = attnkit.attention(q, clean_h, clean_h, mask=SlidingWindow(window, 0), backend="decode")
        return ok and pr.close(out[:2], clean[:2].double(), 1e-5) and pr.close(out[2, :3], clean[2, :3].double(), 1e-5)
    return run


def _per_head(B, Hq, Tq, Tk):
    keep = torch.rand(B, Hq, Tq, Tk, generator=torch.Generator().manual_seed(9)) < 0.8
    keep[:, 1::2, :, 300:310] = False  # odd heads never see keys 300..309, even heads (same group) do
    keep[:, 0::2, :, 300:310] = True
    return Dense(keep)


def _bias_minus_inf(B, Hq, Tq, Tk):
    bias = torch.zeros(B, Hq, Tq, Tk)
    bias[..., 250] = -INF
    return bias


PROBES: list[tuple[str, str, object, str]] = [
    ("plain tensors on the kernel: no K/V scan", "value", no_kv_scan(), ""),
    # one per defect class
    ("NaN value hidden from one head of a GQA group (Dense)", "value",
     contract(Hq=8, Hkv=2, mask=_per_head, bad=[("v", 0, 0, 305, NAN), ("v", 1, 1, 301, INF)]), ""),
    ("NaN value seen by the last query only (Causal, Tq=4)", "value",
     contract(Tq=4, mask=lambda *s: Causal(), bad=[("v", 0, 1, 699, NAN), ("k", 1, 0, 698, NAN)]), ""),
    ("NaN value at a key scored -inf by the bias: row NaN", "value",
     contract(bias=_bias_minus_inf(2, 4, 1, 700), bad=[("v", 1, 0, 250, NAN)]), ""),
    ("+Inf score: its row NaN, the other head exact", "value", inf_score(1), ""),
    ("-Inf score: weight 0", "value", inf_score(-1), ""),
    ("NaN query: its row only; a row that sees nothing stays 0", "value",
     contract(Tq=4, mask=lambda B, Hq, Tq, Tk: Dense(torch.arange(Tq).view(1, 1, Tq, 1).expand(B, Hq, Tq, Tk) > 0),
              bad=[("q", 0, 2, 0, NAN), ("q", 1, 3, 2, INF)]), ""),
    ("NaN past the key padding and outside the window", "value",
     contract(B=3, mask=lambda *s: SlidingWindow(100, 0) & KeyPadding([700, 500, 90]),
              bad=[("k", 1, 0, 550, NAN), ("v", 2, 1, 95, INF), ("v", 0, 0, 10, NAN), ("v", 0, 1, 650, NAN)]), ""),
    ("int8 handle: stored NaN hidden and seen, NaN scales past lengths", "value", int8_handle(), ""),
    # shapes the fixes were not made at
    ("bf16, Hq=12/Hkv=4, D=72, Tk=1537, Tq=3, Causal", "value",
     contract(B=2, Hq=12, Hkv=4, Tq=3, Tk=1537, D=72, dtype=torch.bfloat16, mask=lambda *s: Causal(),
              bad=[("v", 0, 3, 1536, NAN), ("k", 1, 2, 1535, NAN), ("v", 1, 0, 700, INF)]), ""),
    ("fp32, MHA D=128, Tk=5000, Tq=16, SlidingWindow(1000)", "value",
     contract(B=1, Hq=3, Hkv=3, Tq=16, Tk=5000, D=128, mask=lambda *s: SlidingWindow(1000, 0),
              bad=[("v", 0, 0, 3990, NAN), ("k", 0, 1, 4999, NAN), ("v", 0, 2, 100, NAN)]), ""),
    ("fp32, Hq=16/Hkv=1, D=20, Tk=333, per-head Dense", "value",
     contract(B=2, Hq=16, Hkv=1, Tk=333, D=20, mask=_per_head,
              bad=[("v", 0, 0, 303, NAN), ("k", 1, 0, 308, NAN)]), ""),
]
