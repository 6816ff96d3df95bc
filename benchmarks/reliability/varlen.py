"""Reliability probes of ``attnkit.varlen_attention`` (packed sequences, flash-attn's varlen layout).

Each valid call is checked against every sequence run alone in float64 (``probe_reliability.reference``,
per sequence; a query whose sequence has no keys gets a zero row). Covered: a whole query or key stream
that is empty and sequences empty on one side (zero rows, LSE -inf, zero finite gradients), built-in
score modifiers on the native kernel (the fused kernel when it is built, else tiled), and the messages of
shape mistakes, which must name the packed (total_tokens, H, D) layout.
"""

from __future__ import annotations

import probe_reliability as pr
import torch

import attnkit
from attnkit.score_mods import ALiBi, RelativeBias, SoftCap


def _native_or_tiled() -> str:
    return "native" if attnkit.list_backends()["native"].available() else "tiled"


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def _packed(lq, lk, Hq=2, Hkv=2, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(sum(lq), Hq, D, generator=g).to(dtype), torch.randn(sum(lk), Hkv, D, generator=g).to(dtype),
            torch.randn(sum(lk), Hkv, D, generator=g).to(dtype))


def _alone(q, k, v, lq, lk, *, causal=False, mod=None, sinks=None):
    """``(out (total_q, Hq, D), lse (Hq, total_q))`` in float64, every sequence on its own."""
    outs, lses = [], []
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for i in range(len(lq)):
        qi, ki, vi = (x.transpose(0, 1)[None].double() for x in (q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]],
                                                                    v[ck[i]:ck[i + 1]]))
        if lq[i] == 0:
            continue
        if lk[i] == 0:
            outs.append(torch.zeros(lq[i], q.shape[1], v.shape[2], dtype=torch.float64))
            fill = float("-inf") if sinks is None else 0.0
            lse = torch.full((q.shape[1], lq[i]), fill, dtype=torch.float64)
            lses.append(lse if sinks is None else lse + sinks.double()[:, None])
            continue
        out, lse = attnkit.attention(qi, ki, vi, mask=attnkit.Causal() if causal else None, score_mod=mod,
                                     sinks=None if sinks is None else sinks.double(), backend="naive",
                                     return_lse=True)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def p_empty_side(lq, lk, backend="auto", causal=True, sinks=None, Hq=2, Hkv=2, D=8, dtype=torch.float32):
    q, k, v = _packed(lq, lk, Hq, Hkv, D, dtype)
    same = lq == lk
    cu_q = _cu(lq)
    cu_k = cu_q if same else _cu(lk)
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, sinks=sinks, backend=backend,
                                        return_lse=True)
    if sum(lq) == 0:
        return out.shape == (0, Hq, D) and lse.shape == (Hq, 0)
    ref, ref_lse = _alone(q, k, v, lq, lk, causal=causal, sinks=sinks)
    finite = torch.isfinite(ref_lse)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return (pr.close(out, ref, tol) and torch.equal(finite, torch.isfinite(lse))
            and bool(((lse.double() - ref_lse).abs()[finite] <= tol).all()))


def p_empty_backward(lq, lk, backend):
    """Finite gradients, zero for the queries of sequences without keys and the keys/values of sequences
    without queries (nothing reads them)."""
    q, k, v = (x.requires_grad_() for x in _packed(lq, lk))
    out = attnkit.varlen_attention(q, k, v, _cu(lq), _cu(lk), causal=True, backend=backend)
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    unseen_q = torch.repeat_interleave(torch.tensor(lk) == 0, torch.tensor(lq))
    unread_k = torch.repeat_interleave(torch.tensor(lq) == 0, torch.tensor(lk))
    return (all(bool(torch.isfinite(g).all()) for g in (gq, gk, gv)) and bool((gq[unseen_q] == 0).all())
            and bool((gk[unread_k] == 0).all()) and bool((gv[unread_k] == 0).all()))


def p_score_mod(mod_name, lq, lk, backend=None, Hq=4, Hkv=2):
    backend = backend or _native_or_tiled()
    mods = {"softcap": SoftCap(1.0), "alibi": ALiBi.geometric(Hq),
            "relative bias": RelativeBias(torch.randn(Hq, 16, generator=torch.Generator().manual_seed(4)),
                                          max_distance=32, bidirectional=False),
            "alibi >> softcap": ALiBi.geometric(Hq) >> SoftCap(3.0)}
    mod = mods[mod_name]
    q, k, v = _packed(lq, lk, Hq, Hkv, D=16, seed=2)
    cu_q = _cu(lq)
    cu_k = cu_q if lq == lk else _cu(lk)
    out, lse = attnkit.varlen_attention(q, k, v, cu_q, cu_k, causal=True, score_mod=mod, backend=backend,
                                        return_lse=True)
    ref, ref_lse = _alone(q, k, v, lq, lk, causal=True, mod=mod)
    finite = torch.isfinite(ref_lse)
    return pr.close(out, ref) and bool(((lse.double() - ref_lse).abs()[finite] <= 1e-4).all())


def n_varlen(lq, lk, edit):
    def run():
        q, k, v = _packed(lq, lk)
        q, k, v = edit(q, k, v)
        return attnkit.varlen_attention(q, k, v, _cu(lq), _cu(lk))

    return run


PROBES = [
    # defect classes of the fix, at the shapes its tests use or close to them
    ("no keys at all (auto)", "value", lambda: p_empty_side([3, 2], [0, 0]), ""),
    ("no queries at all (auto)", "value", lambda: p_empty_side([0, 0], [4, 2]), ""),
    ("nothing on either side, one cu_seqlens (auto)", "value", lambda: p_empty_side([0, 0], [0, 0]), ""),
    ("no keys at all: zero gradients (tiled)", "value", lambda: p_empty_backward([3, 2], [0, 0], "tiled"), ""),
    *[(f"built-in score_mod {m} (native, else tiled)", "value", (lambda m=m: p_score_mod(m, [5, 9, 3], [5, 9, 3])),
       "") for m in ("softcap", "alibi", "relative bias")],
    ("ALiBi, different q/k offsets (native, else tiled)", "value",
     lambda: p_score_mod("alibi", [1, 3, 17, 2], [5, 3, 37, 9]), ""),
    ("v of another length: message in packed layout", "reject", n_varlen([3, 4], [3, 4], lambda q, k, v: (q, k, v[:6])),
     "total_k"),
    ("head dim 0: message in packed layout", "reject",
     n_varlen([3, 4], [3, 4], lambda q, k, v: (q[..., :0], k[..., :0], v)), "q.shape[2]"),
    # other shapes, not the ones the fix was made at
    ("no keys, GQA 8/2, D=24, sinks (LSE = sink)", "value",
     lambda: p_empty_side([4, 1, 6], [0, 0, 0], Hq=8, Hkv=2, D=24, sinks=torch.linspace(-1.0, 1.0, 8)), ""),
    ("no queries, bf16, 3 sequences (native, else tiled)", "value",
     lambda: p_empty_side([0, 0, 0], [7, 1, 30], backend=_native_or_tiled(), dtype=torch.bfloat16), ""),
    ("no keys at all, not causal (native, else tiled)", "value",
     lambda: p_empty_side([33, 2], [0, 0], backend=_native_or_tiled(), causal=False), ""),
    ("empty sequences between others, zero gradients (native, else tiled)", "value",
     lambda: p_empty_backward([0, 5, 0, 9, 2], [7, 0, 3, 9, 0], _native_or_tiled()), ""),
    ("relative bias, Tq > Tk per sequence (native, else tiled)", "value",
     lambda: p_score_mod("relative bias", [6, 40, 1], [2, 33, 12]), ""),
    ("ALiBi >> soft-cap, 70-token sequences (native, else tiled)", "value",
     lambda: p_score_mod("alibi >> softcap", [70, 64], [70, 64], Hq=6, Hkv=3), ""),
]
