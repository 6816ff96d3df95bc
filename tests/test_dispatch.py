"""Dispatch: priority policy, named backends checked not replaced, explain(), use_backend()."""

from __future__ import annotations

import threading

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, NoBackendError, SlidingWindow
from attnkit.dispatch import priority, select
from attnkit.inputs import AttentionInputs

q = torch.randn(1, 4, 16, 8)
k = v = torch.randn(1, 2, 16, 8)


def test_auto_prefers_sdpa_for_dense_and_causal():
    assert attnkit.explain(q, k, v).chosen == "sdpa"
    assert attnkit.explain(q, k, v, mask=Causal()).chosen == "sdpa"


def test_lse_request_goes_to_a_backend_that_can():
    e = attnkit.explain(q, k, v, mask=Causal(), return_lse=True)
    assert e.chosen != "sdpa"
    assert any("log-sum-exp" in r for r in e.reasons["sdpa"])
    assert "sdpa: not used" in str(e)


def test_named_backend_is_checked_not_replaced():
    with pytest.raises(NoBackendError) as info:
        attnkit.attention(q, k, v, backend="sdpa", return_lse=True)
    assert "sdpa" in str(info.value) and "log-sum-exp" in str(info.value)


def test_no_backend_error_lists_every_backend(monkeypatch):
    inp = AttentionInputs.create(q, k, v, return_lse=True)
    with attnkit.use_backend("sdpa"):
        with pytest.raises(NoBackendError, match="sdpa: cannot return the log-sum-exp"):
            select(inp)
    # With every backend refusing, auto's error names each of them with its reasons.
    for impl in attnkit.list_backends().values():
        monkeypatch.setattr(impl, "supports_lse", False)
    with pytest.raises(NoBackendError) as info:
        select(inp)
    for name in attnkit.list_backends():
        assert f"  {name}: " in str(info.value)


def test_use_backend_scopes_and_restores():
    with attnkit.use_backend("naive"):
        assert attnkit.explain(q, k, v).chosen == "naive"
        with attnkit.use_backend("sdpa"):
            assert attnkit.explain(q, k, v).chosen == "sdpa"
        assert attnkit.explain(q, k, v).chosen == "naive"
    assert attnkit.explain(q, k, v).chosen == "sdpa"


def test_use_backend_is_per_thread():
    seen = {}

    def other():
        seen["chosen"] = attnkit.explain(q, k, v).chosen

    with attnkit.use_backend("naive"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["chosen"] == "sdpa"


def test_use_backend_restores_after_exception():
    with pytest.raises(RuntimeError):
        with attnkit.use_backend("naive"):
            raise RuntimeError("boom")
    assert attnkit.explain(q, k, v).chosen == "sdpa"


def test_sdpa_plan_decides_forward_describe_and_the_dispatch_hint():
    sdpa = attnkit.list_backends()["sdpa"]

    def inputs(mask, Tq=16, Tk=16, **kw):
        return AttentionInputs.create(q[:, :, :Tq], k[:, :, :Tk], v[:, :, :Tk], mask=mask, **kw)

    cases = [
        (None, {}, "none"),
        (Causal(), {}, "causal"),  # Tq == Tk: bottom-right == top-left
        (Causal(), {"Tq": 1}, "none"),  # decode: hides nothing
        (Causal(), {"Tq": 4}, "dense"),  # chunked prefill: bottom-right != SDPA's top-left
        (Causal(), {"Tq": 4, "q_offset": 0}, "causal"),  # top-left, keys after the last query dropped
        (Causal() & Causal(), {}, "causal"),
        (SlidingWindow(4, 0), {}, "dense"),
    ]
    for mask, kw, expected in cases:
        inp = inputs(mask, **kw)
        assert sdpa.plan(inp) == expected, (mask, kw)
        assert (sdpa.dense_mask_elements(inp) > 0) == (expected == "dense")
        words = {"none": "no mask", "causal": "is_causal=True", "dense": "materialized"}[expected]
        assert words in sdpa.describe(inp)


def test_no_backend_imports_the_dispatcher():
    import ast
    import pathlib

    for path in pathlib.Path(attnkit.__file__).parent.joinpath("backends").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").endswith("dispatch"), path.name


def test_large_materialized_masks_prefer_tiled_when_registered():
    big_q = torch.empty(1, 8, 4096, 64)
    big_k = torch.empty(1, 8, 4096, 64)
    inp = AttentionInputs.create(big_q, big_k, big_k, mask=KeyPadding([4000]))
    order = priority(inp)
    if "tiled" in attnkit.list_backends():
        assert order.index("tiled") < order.index("sdpa")
    assert order[-1] == "naive"


def test_explain_str_is_plain_words():
    text = str(attnkit.explain(q, k, v, mask=Causal()))
    assert "chosen: sdpa" in text and "runs" in text


@pytest.mark.parametrize("Tq", [1, 3, 16])
def test_sdpa_paths_equal_naive(Tq):
    """is_causal fast path, dropped mask (decode) and materialized bottom-right mask all agree."""
    qq = torch.randn(1, 4, Tq, 8)
    for offset in (None, 0):
        a = attnkit.attention(qq, k, v, mask=Causal(), backend="sdpa", q_offset=offset)
        b = attnkit.attention(qq, k, v, mask=Causal(), backend="naive", q_offset=offset)
        assert torch.allclose(a, b, atol=1e-6)


def _varied_inputs():
    """Inputs that exercise every reason: masks, bias, dropout, LSE, gradients, GQA, dtypes, offsets."""
    from attnkit import BlockSparse

    base = torch.randn(1, 4, 64, 8)
    kv = torch.randn(1, 2, 64, 8)
    masks = [None, Causal(), SlidingWindow(8, 0), KeyPadding([40]), Causal() & KeyPadding([40]),
             BlockSparse.bigbird(5, 16, window=1, global_blocks=1, random_blocks=1, seed=0)]
    for mask in masks:
        for kw in ({}, dict(bias=torch.zeros(1, 4, 64, 64)), dict(dropout_p=0.1), dict(return_lse=True),
                   dict(q_offset=3), dict(q_offset=0)):
            yield base, kv, kv, dict(mask=mask, **kw)
    yield base.double(), kv.double(), kv.double(), dict(mask=Causal())
    yield base.bfloat16(), kv.bfloat16(), kv.bfloat16(), dict(mask=SlidingWindow(8, 0))
    grad = base.clone().requires_grad_()
    yield grad, kv, kv, dict(mask=Causal())


def test_can_run_agrees_with_the_reasons_and_select_with_explain():
    known = attnkit.list_backends()
    for qq, kk, vv, kw in _varied_inputs():
        inp = AttentionInputs.create(qq, kk, vv, **kw)
        for name, impl in known.items():
            assert impl.can_run(inp) == (not impl.not_supported_reasons(inp)), (name, inp)
        try:
            chosen = select(inp).name
        except attnkit.NoBackendError:
            chosen = None
        assert attnkit.explain(qq, kk, vv, **kw).chosen == chosen, inp
        if chosen is not None:
            assert known[chosen].can_run(inp)
