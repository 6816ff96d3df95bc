"""Reliability probes of ``torch.compile(fullgraph=True)`` over attnkit: no graph break, no recompile.

A "value" probe is right when the compiled function traces in one graph (``fullgraph=True``: a graph
break raises), compiles once for every length it is called with (``dynamic=True``: a graph specialized
on a length compiles again at the next one, and past the recompile limit fails), and its results equal
the eager calls'. Covered: key lengths across one and several key tiles with every band mask, key
padding built inside the compiled function, masks evaluated per tile (``|``, ``Custom``), queries and
keys growing together, packed sequences of changing lengths, padded and packed models, half
precision. ``aot_eager`` traces what inductor would, without generating code. Each series starts
with sizes that differ from one another: Dynamo's duck sizing makes sizes equal in the first call equal
in its graph (one more graph when they differ later, whatever the library does).
"""

from __future__ import annotations

import probe_reliability as pr
import torch
import torch.nn.functional as F

import attnkit
from attnkit import Causal, Custom, KeyPadding, SlidingWindow

# key lengths below, across and above 128 and 256 keys (one, two, three tiles), in a jumbled order
KEY_LENGTHS = (45, 300, 129, 90, 257, 128, 377, 31, 200)


def _compiled_once(f, calls, tol=1e-5) -> bool:
    """``f`` compiled with dynamic shapes, called on each argument tuple of ``calls``: True when every
    result equals eager ``f`` and Dynamo built one graph for all of them."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    try:
        right = all(pr.close(compiled(*args), f(*args).double(), tol) for args in calls)
        return right and counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()


def _key_calls(Tq=5, Hq=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    calls = []
    for Tk in KEY_LENGTHS:
        q = torch.randn(3, Hq, Tq, D, generator=g)
        k, v = (torch.randn(3, Hkv, Tk, D, generator=g) for _ in range(2))
        calls.append((q, k, v, torch.tensor([Tk, Tk - 7, Tk // 3])))
    return calls


def p_dynamic_keys(make_mask, backend="auto"):
    def f(q, k, v, lengths):
        return attnkit.attention(q, k, v, mask=make_mask(lengths), backend=backend)

    return _compiled_once(f, _key_calls())


def p_dynamic_queries_and_keys():
    """Chunked prefill: Tq and Tk both change (the queries' offset Tk - Tq too)."""
    g = torch.Generator().manual_seed(1)
    calls = []
    for Tq, Tk in ((30, 250), (64, 64), (131, 131), (97, 333), (250, 260)):
        q = torch.randn(1, 2, Tq, 8, generator=g)
        calls.append((q, *(torch.randn(1, 2, Tk, 8, generator=g) for _ in range(2))))

    def f(q, k, v):
        return attnkit.attention(q, k, v, mask=SlidingWindow(40, 0) & Causal())

    return _compiled_once(f, calls)


def p_dynamic_varlen(mask):
    g = torch.Generator().manual_seed(2)
    calls = []
    for lengths in ([3, 90, 41, 9, 2], [200, 12], [7, 7, 7, 7], [1, 140, 60, 33], [64, 64]):
        cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
        calls.append((*(torch.randn(sum(lengths), 4, 8, generator=g) for _ in range(3)), cu))

    def f(q, k, v, cu):
        return attnkit.varlen_attention(q, k, v, cu, cu, mask=mask)

    return _compiled_once(f, calls)


def p_model_without_breaks(kind, dtype):
    """A GPT on a right-padded batch or packed sequences: no graph break, compiled equals eager."""
    from attnkit.nn.layers import TransformerConfig
    from attnkit.nn.models import GPT

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, max_len=64, embed_dim=24, num_layers=2, num_heads=6, num_kv_heads=3)
    model = GPT(cfg).to(dtype)
    g = torch.Generator().manual_seed(3)
    if kind == "padded":
        attention_mask = torch.ones(3, 21, dtype=torch.long)
        attention_mask[1, 13:] = 0
        attention_mask[2, 4:] = 0
        x, kwargs = torch.randint(0, 50, (3, 21), generator=g), {"attention_mask": attention_mask}
    else:
        x, kwargs = torch.randint(0, 50, (1, 40), generator=g), {"cu_seqlens": torch.tensor([0, 11, 12, 40])}
    torch._dynamo.reset()
    try:
        if torch._dynamo.explain(model)(x, **kwargs).graph_break_count:
            return False
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(x, **kwargs)
    finally:
        torch._dynamo.reset()
    ref = model(x, **kwargs)
    return pr.close(got, ref.double(), 1e-4 if dtype == torch.float32 else 3e-2)


def p_half(dtype, backend):
    q, k, v = pr.qkv(B=2, H=4, Hkv=2, T=70, D=16, dtype=dtype, seed=4)
    mask = SlidingWindow(11, 0) & Causal()

    def f(q, k, v):
        return attnkit.attention(q, k, v, mask=mask, backend=backend)

    torch._dynamo.reset()
    try:
        if torch._dynamo.explain(f)(q, k, v).graph_break_count:
            return False
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    finally:
        torch._dynamo.reset()
    keep = torch.ones(70, 70, dtype=torch.bool).tril() & ~torch.ones(70, 70, dtype=torch.bool).tril(-12)
    return pr.close(got, f(q, k, v).double(), 1e-2) and pr.close(got, pr.reference(q, k, v, keep), 3e-2)


def _native() -> str:
    return "native" if attnkit.list_backends()["native"].available() else "tiled"


PROBES = [
    ("dynamic keys: Causal (auto)", "value", lambda: p_dynamic_keys(lambda n: Causal()), None),
    ("dynamic keys: SlidingWindow(6, 2)", "value", lambda: p_dynamic_keys(lambda n: SlidingWindow(6, 2)), None),
    ("dynamic keys: SlidingWindow & Causal", "value",
     lambda: p_dynamic_keys(lambda n: SlidingWindow(30, 0) & Causal()), None),
    ("dynamic keys: KeyPadding built traced", "value", lambda: p_dynamic_keys(lambda n: KeyPadding(n)), None),
    ("dynamic keys: KeyPadding & Causal, native", "value",
     lambda: p_dynamic_keys(lambda n: KeyPadding(n) & Causal(), _native()), None),
    ("dynamic keys: Or of windows (evaluated per tile)", "value",
     lambda: p_dynamic_keys(lambda n: SlidingWindow(9, 0) | SlidingWindow(0, 3)), None),
    ("dynamic keys: Custom", "value",
     lambda: p_dynamic_keys(lambda n: Custom(lambda b, h, q, k: (q - k) % 4 != 1)), None),
    ("dynamic keys: sdpa with grouped heads", "value", lambda: p_dynamic_keys(lambda n: Causal(), "sdpa"), None),
    ("dynamic queries and keys (chunked prefill)", "value", p_dynamic_queries_and_keys, None),
    ("dynamic varlen: SlidingWindow & Causal", "value", lambda: p_dynamic_varlen(SlidingWindow(5, 0) & Causal()), None),
    ("dynamic varlen: Or of windows", "value", lambda: p_dynamic_varlen(SlidingWindow(2, 0) | SlidingWindow(0, 4)),
     None),
    ("GPT padded: no graph break (float32)", "value", lambda: p_model_without_breaks("padded", torch.float32), None),
    ("GPT packed: no graph break (bfloat16)", "value", lambda: p_model_without_breaks("packed", torch.bfloat16), None),
    ("bfloat16 native: no graph break", "value", lambda: p_half(torch.bfloat16, _native()), None),
    ("float16 auto: no graph break", "value", lambda: p_half(torch.float16, "auto"), None),
]
