"""Reliability probes of gated linear attention (``attnkit.gated_linear_attention``): the gated delta
rule, KDA and SSD, chunked and recurrent.

The reference is the recurrence itself in float64 (``method="recurrent"`` on float64 inputs, every
decay exact). NaN/Inf in token ``t`` may change only what can see it: that token's output and,
through the state, every later token of its own sequence (only token ``t`` for a bad query).
"""

from __future__ import annotations

import torch

import attnkit

RULES = ("gated_delta", "kda", "ssd")


def inputs(rule, B=1, Hk=2, Hv=2, T=40, Dk=8, Dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hk, T, Dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, Hk, T, Dk, generator=gen), dim=-1)
    v = torch.randn(B, Hv, T, Dv, generator=gen)
    g = -torch.rand((B, Hv, T, Dk) if rule in ("kda", "gla") else (B, Hv, T), generator=gen)
    beta = None if rule in ("ssd", "gla") else torch.rand(B, Hv, T, generator=gen)
    return q, k, v, g, beta


def truth(q, k, v, g, beta, **kw):
    """The float64 recurrence (the naive twin run in float64)."""
    return attnkit.gated_linear_attention(q.double(), k.double(), v.double(), g.double(),
                                          None if beta is None else beta.double(), method="recurrent", **kw)


def close(out, ref, tol=1e-4):
    out, ref = out.double(), ref.double()
    return out.shape == ref.shape and bool(((out - ref).abs() <= tol * (1 + ref.abs())).all())


def poisoned(x):
    return bool(torch.isnan(x).all())


def p_bad_token_stays_local(rule, method, what="v", bad=float("nan"), T=40, at=30, chunk=None):
    """A NaN/Inf in ``what`` at token ``at`` (of batch row 1, value head 0): earlier tokens and the other
    row and head equal the clean run; token ``at`` and later ones (only ``at`` for q) are NaN."""
    q, k, v, g, beta = inputs(rule, B=2, T=T, seed=T)
    clean = attnkit.gated_linear_attention(q, k, v, g, beta, method=method, chunk_size=chunk)
    x = {"q": q, "k": k, "v": v, "g": g, "beta": beta}[what].clone()
    x[1, 0, at] = bad
    args = {"q": q, "k": k, "v": v, "g": g, "beta": beta, what: x}
    out = attnkit.gated_linear_attention(**args, method=method, chunk_size=chunk, check_gates=False)
    seen = slice(at, at + 1) if what == "q" else slice(at, None)
    keep = torch.ones(2, 2, T, dtype=torch.bool)
    keep[1, 0, seen] = False
    return close(out[keep], clean[keep], 1e-5) and poisoned(out[1, 0, seen])


def p_padding_nan_batch(rule):
    """A right-padded batch whose padding holds NaN: each row's real tokens equal the row run alone."""
    q, k, v, g, beta = inputs(rule, B=2, T=50, seed=3)
    lengths = (50, 33)
    v = v.clone()
    v[1, :, lengths[1]:] = float("nan")
    out = attnkit.gated_linear_attention(q, k, v, g, beta)
    ok = True
    for b, n in enumerate(lengths):
        alone = attnkit.gated_linear_attention(*(x[b : b + 1, :, :n] for x in (q, k, v, g)),
                                               None if beta is None else beta[b : b + 1, :, :n])
        ok &= close(out[b : b + 1, :, :n], alone, 1e-5)
    return ok


def p_packed_nan(rule, method):
    """cu_seqlens: a NaN in the second sequence leaves the first and the third, and the earlier tokens
    of the second, as they were; that sequence's final state is NaN, the others' finite."""
    q, k, v, g, beta = inputs(rule, T=60, seed=5)
    cu = torch.tensor([0, 20, 45, 60])
    clean, s_clean = attnkit.gated_linear_attention(q, k, v, g, beta, cu_seqlens=cu, method=method, return_state=True)
    v = v.clone()
    v[0, :, 37] = float("nan")
    out, s = attnkit.gated_linear_attention(q, k, v, g, beta, cu_seqlens=cu, method=method, return_state=True)
    keep = torch.ones(60, dtype=torch.bool)
    keep[37:45] = False
    return (close(out[:, :, keep], clean[:, :, keep], 1e-5) and poisoned(out[:, :, 37:45])
            and poisoned(s[1]) and close(s[0::2], s_clean[0::2], 1e-5))


def p_nan_gradients(rule):
    """Backward of a loss over the tokens before a NaN: every gradient is finite."""
    q, k, v, g, beta = inputs(rule, T=48, seed=7)
    v = v.clone()
    v[0, 1, 40] = float("nan")
    leaves = [x.requires_grad_() for x in (q, k, v, g) + (() if beta is None else (beta,))]
    out = attnkit.gated_linear_attention(q, k, v, g, beta, check_gates=False)
    out[:, :, :40].square().sum().backward()
    return all(bool(torch.isfinite(x.grad).all()) for x in leaves)


def p_gla_per_channel_no_beta(method, T=23):
    """Per-channel gates with beta=None: the recurrence without the delta rule (gated linear attention)."""
    q, k, v, g, _ = inputs("gla", T=T, seed=11)
    out, s = attnkit.gated_linear_attention(q, k, v, g, None, method=method, return_state=True)
    ref, s_ref = truth(q, k, v, g, None, return_state=True)
    return close(out, ref) and close(s, s_ref)


def p_huge_log_decay(rule, T=40, at=5, chunk=None):
    """A valid log-decay of -1e16 early in a chunk: the gates after it stay exact."""
    q, k, v, g, beta = inputs(rule, T=T, seed=13)
    g = g.clone()
    g[:, :, at] = -1e16
    out = attnkit.gated_linear_attention(q, k, v, g, beta, chunk_size=chunk)
    return close(out, truth(q, k, v, g, beta))


def p_batch_zero(rule, method):
    q, k, v, g, beta = inputs(rule, B=0, T=20)
    out, s = attnkit.gated_linear_attention(q, k, v, g, beta, method=method, return_state=True)
    return out.shape == (0, 2, 20, 8) and s.shape == (0, 2, 8, 8)


def p_scale(scale):
    q, k, v, g, beta = inputs("gated_delta", T=20)
    out = attnkit.gated_linear_attention(q, k, v, g, beta, scale=scale)
    return close(out, truth(q, k, v, g, beta, scale=scale))


def n_empty_dims(Hk=1, Dk=8, Dv=8):
    q, k, v = torch.randn(1, Hk, 6, Dk), torch.randn(1, Hk, 6, Dk), torch.randn(1, 2, 6, Dv)
    return lambda: attnkit.gated_linear_attention(q, k, v, -torch.rand(1, 2, 6), torch.rand(1, 2, 6))


def n_scale(scale):
    q, k, v, g, beta = inputs("gated_delta", T=20)
    return lambda: attnkit.gated_linear_attention(q, k, v, g, beta, scale=scale)


PROBES: list[tuple[str, str, object, str]] = [
    # NaN/Inf locality (the shapes the fix was made at: T=40, NaN at token 30)
    *[(f"NaN in v at token 30 ({r}, {m})", "value", (lambda r=r, m=m: p_bad_token_stays_local(r, m)), "")
      for r in RULES for m in ("chunked", "recurrent")],
    *[(f"right-padded batch, NaN padding ({r})", "value", (lambda r=r: p_padding_nan_batch(r)), "") for r in RULES],
    *[(f"cu_seqlens, NaN in sequence 2 ({r}, {m})", "value", (lambda r=r, m=m: p_packed_nan(r, m)), "")
      for r in RULES for m in ("chunked", "recurrent")],
    *[(f"NaN token: finite grads before it ({r})", "value", (lambda r=r: p_nan_gradients(r)), "") for r in RULES],
    # edges
    *[(f"per-channel g, beta=None ({m})", "value", (lambda m=m: p_gla_per_channel_no_beta(m)), "")
      for m in ("chunked", "recurrent")],
    *[(f"log-decay -1e16 ({r})", "value", (lambda r=r: p_huge_log_decay(r)), "") for r in RULES],
    *[(f"B=0 ({r}, {m})", "value", (lambda r=r, m=m: p_batch_zero(r, m)), "")
      for r in RULES for m in ("chunked", "recurrent")],
    ("scale=nan", "reject", n_scale(float("nan")), "scale"),
    ("scale=inf", "reject", n_scale(float("inf")), "scale"),
    ("scale='0.5'", "reject", n_scale("0.5"), "scale"),
    # other shapes than the fixes used
    *[(f"{w}=NaN at token {t} of T={T}, chunk {c} ({r})", "value",
       (lambda r=r, w=w, T=T, t=t, c=c: p_bad_token_stays_local(r, "chunked", w, T=T, at=t, chunk=c)), "")
      for r, w, T, t, c in (("gated_delta", "k", 97, 70, 16), ("kda", "g", 33, 17, 8), ("ssd", "q", 130, 64, 64),
                            ("gated_delta", "beta", 65, 64, None), ("kda", "v", 5, 0, None),
                            ("ssd", "g", 70, 1, 32))],
    *[(f"v=+inf at token {t} of T={T} ({r})", "value",
       (lambda r=r, T=T, t=t: p_bad_token_stays_local(r, "chunked", "v", float("inf"), T=T, at=t)), "")
      for r, T, t in (("gated_delta", 129, 100), ("ssd", 31, 12))],
    ("per-channel g, beta=None, T=130 (chunked)", "value", lambda: p_gla_per_channel_no_beta("chunked", T=130), ""),
    *[(f"log-decay -1e16 at token {t}, T={T}, chunk {c} ({r})", "value",
       (lambda r=r, T=T, t=t, c=c: p_huge_log_decay(r, T=T, at=t, chunk=c)), "")
      for r, T, t, c in (("gated_delta", 100, 64, 32), ("kda", 21, 0, 7), ("ssd", 77, 70, 16))],
    *[(f"scale={s}", "value", (lambda s=s: p_scale(s)), "") for s in (0.0, -0.25)],
    ("scale=-inf", "reject", n_scale(float("-inf")), "scale"),
    ("no key heads (Hk=0)", "reject", n_empty_dims(Hk=0), "key heads"),
    ("Dk=0", "reject", n_empty_dims(Dk=0), "Dk"),
]
