"""Reliability probes of gradients under the NaN/Inf policy (README, "NaN and Inf stay where they belong").

A row whose output is NaN because of a NaN/Inf it may see must get NaN gradients for what it read: its
query row and the K/V rows of every key it may see, whatever its upstream gradient. Nothing else may
change: the rows that cannot see it keep their gradients (checked against the float64 reference on the
clean inputs, the NaN rows' upstream gradient zeroed), the keys no NaN row reads keep finite ones, and a
NaN/Inf no row may see changes no gradient. The expected NaN rows and keys come from the materialized
mask, never from attnkit's policy code.
"""

from __future__ import annotations

import torch

import attnkit
import probe_reliability as pr
from attnkit import Causal, KeyPadding, SlidingWindow
from attnkit.masks import BlockSparse

NAN, INF = float("nan"), float("inf")
BACKENDS = [name for name in ("naive", "sdpa", "tiled", "native", "sliding_window", "block_sparse", "decode")
            if attnkit.list_backends()[name].available()]


def mask_for(backend, T, kind="causal", lengths=None):
    """A causal (or windowed, padded) mask in a form ``backend`` runs."""
    mask = {"causal": Causal(), "window": SlidingWindow(5, 0)}[kind] if backend != "sliding_window" else (
        SlidingWindow(5, 0) if kind == "window" else SlidingWindow(T, 0))
    if lengths is not None:
        mask = mask & KeyPadding(lengths)
    if backend == "block_sparse":
        n = -(-T // 8)
        mask = BlockSparse(torch.ones(1, n, n, dtype=torch.bool).tril(), 8) & mask
    return mask


def grads(backend, q, k, v, mask, dout, dtype=torch.float32, **kw):
    """``(out, dq, dk, dv)`` of ``backend`` on (q, k, v) with upstream gradient ``dout``."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out = attnkit.attention(q, k, v, mask=mask, backend=backend, **kw)
    out.backward(dout.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def reference_grads(q, k, v, keep, dout):
    """The float64 reference's ``(out, dq, dk, dv)``."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = pr.reference(q, k, v, keep)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def expected(keep, rows_seeing, Hkv):
    """``(rows, reads)``: NaN rows (B, Hq, Tq) and the keys they read (B, Hkv, Tk), from the mask."""
    B, Hq, _, Tk = keep.shape
    reads = (keep & rows_seeing[..., None]).any(dim=2).view(B, Hkv, Hq // Hkv, Tk).any(dim=2)
    return rows_seeing, reads


def nan_rows(x):
    nan = torch.isnan(x)
    return nan.all(-1) if bool((nan.any(-1) == nan.all(-1)).all()) else None  # None: a row NaN in part


def setup(B=1, Hq=6, Hkv=2, Tq=61, Tk=61, D=24, seed=11):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Tq, D, generator=g), torch.randn(B, Hkv, Tk, D, generator=g),
            torch.randn(B, Hkv, Tk, D, generator=g), torch.randn(B, Hq, Tq, D, generator=g))


def keep_of(mask, B, Hq, Tq, Tk):
    return mask.materialize(Tq, Tk, q_offset=Tk - Tq, kv_offset=0, batch_size=B, num_heads=Hq).expand(B, Hq, Tq, Tk)


def follows(backend, where, value, Tq=61, Tk=61, kind="causal", lengths=None, upstream="random",
            dtype=torch.float32, B=1):
    """NaN/Inf ``value`` at ``where = (tensor, index)``: NaN exactly where the mask says, the rest right."""
    q, k, v, dout = setup(B=B, Tq=Tq, Tk=Tk)
    Hq, Hkv = q.shape[1], k.shape[1]
    mask = mask_for(backend, Tk, kind, lengths)
    keep = keep_of(mask, B, Hq, Tq, Tk)
    name, index = where
    seeing = torch.zeros(B, Hq, Tq, dtype=torch.bool)
    if name == "q":
        seeing[index[:3]] = keep[index[:3]].any()
    else:
        b, h, j = index[:3]
        G = Hq // Hkv
        seeing[b, h * G:(h + 1) * G] = keep[b, h * G:(h + 1) * G, :, j]
    rows, reads = expected(keep, seeing, Hkv)
    bad = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    bad[name][index] = value
    if upstream == "zero":
        dout = dout.masked_fill(rows[..., None], 0.0)
    elif upstream == "nan":  # what out.pow(2) gives back on a NaN row
        dout = dout.masked_fill(rows[..., None], NAN)
    out, dq, dk, dv = grads(backend, bad["q"], bad["k"], bad["v"], mask, dout, dtype=dtype)
    got = [nan_rows(out), nan_rows(dq), nan_rows(dk), nan_rows(dv)]
    if any(x is None for x in got) or not (torch.equal(got[0], rows) and torch.equal(got[1], rows)
                                           and torch.equal(got[2], reads) and torch.equal(got[3], reads)):
        return False
    ref = reference_grads(q, k, v, keep, dout.masked_fill(rows[..., None], 0.0))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return (pr.close(out[~rows], ref[0][~rows], tol) and pr.close(dq[~rows], ref[1][~rows], tol)
            and pr.close(dk[~reads], ref[2][~reads], tol) and pr.close(dv[~reads], ref[3][~reads], tol))


def sdpa_property(backend):
    """PyTorch's SDPA property: an Inf query row is NaN, so is its dq; the other rows are finite."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    q[0, :, 3] = INF
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attnkit.attention(q, k, v, mask=mask_for(backend, 8), backend=backend)
    out.sum().backward()
    others = [i for i in range(8) if i != 3]
    return (bool(torch.isnan(out[:, :, 3]).all()) and bool(torch.isnan(q.grad[:, :, 3]).all())
            and bool(torch.isfinite(out[:, :, others]).all()) and bool(torch.isfinite(q.grad[:, :, others]).all()))


def hidden_changes_nothing(backend):
    """A NaN key hidden by padding (and an Inf query of a row with no allowed key): no gradient moves."""
    q, k, v, dout = setup(B=2, Tq=40, Tk=40)
    mask = mask_for(backend, 40, "window", [40, 17])  # batch 1: rows 22.. see none of their window
    bad_q, bad_k = q.clone(), k.clone()
    bad_k[1, 1, 30, 4] = NAN
    bad_q[1, 5, 33, 0] = INF
    return all(torch.equal(a, b) for a, b in zip(grads(backend, bad_q, bad_k, v, mask, dout),
                                                 grads(backend, q, k, v, mask, dout)))


PROBES = [
    *[(f"Inf query: its dq NaN, others finite ({b})", "value", (lambda b=b: sdpa_property(b)), "")
      for b in BACKENDS],
    *[(f"Inf in q row: dq/dK/dV follow the mask ({b})", "value",
       (lambda b=b: follows(b, ("q", (0, 4, 40, 7)), INF)), "") for b in BACKENDS],
    *[(f"NaN key: its readers' grads NaN ({b})", "value",
       (lambda b=b: follows(b, ("k", (0, 1, 17, 2)), NAN)), "") for b in BACKENDS],
    *[(f"-Inf value, windowed ({b})", "value",
       (lambda b=b: follows(b, ("v", (0, 0, 30, 3)), -INF, kind="window")), "") for b in BACKENDS],
    *[(f"NaN upstream grad stays in its keys ({b})", "value",
       (lambda b=b: follows(b, ("q", (0, 2, 12, 1)), NAN, upstream="nan")), "") for b in BACKENDS],
    *[(f"zero upstream grad still poisons ({b})", "value",
       (lambda b=b: follows(b, ("q", (0, 2, 12, 1)), INF, upstream="zero")), "") for b in BACKENDS],
    *[(f"hidden NaN/Inf changes no gradient ({b})", "value", (lambda b=b: hidden_changes_nothing(b)), "")
      for b in BACKENDS],
    # shapes unlike the tests': queries fewer than keys (a chunk after a cache), batch > 1, bfloat16
    *[(f"Tq < Tk, NaN key ({b})", "value",
       (lambda b=b: follows(b, ("k", (0, 1, 50, 0)), NAN, Tq=9, Tk=70)), "") for b in ("naive", "tiled", "native")
      if b in BACKENDS],
    *[(f"B=3 padded, Inf query ({b})", "value",
       (lambda b=b: follows(b, ("q", (2, 3, 20, 5)), INF, B=3, lengths=[61, 44, 25])), "")
      for b in ("sdpa", "tiled", "native") if b in BACKENDS],
    *[(f"bfloat16 NaN key ({b})", "value",
       (lambda b=b: follows(b, ("k", (0, 0, 8, 3)), NAN, dtype=torch.bfloat16)), "")
      for b in ("naive", "tiled", "native") if b in BACKENDS],
]
