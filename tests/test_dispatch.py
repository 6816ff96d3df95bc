"""Dispatch: the rule auto follows (static order, decode rule, measured table), named backends
checked not replaced, explain(), use_backend(), autotune()."""

from __future__ import annotations

import threading

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, NoBackendError, SlidingWindow
from attnkit.dispatch import DECODE_QUERIES, priority, select, table
from attnkit.inputs import AttentionInputs

q = torch.randn(1, 4, 24, 8)  # more queries than a decoding step: the static order decides
k = v = torch.randn(1, 2, 24, 8)


def _fused(**kwargs) -> str:
    """auto's pick for q, k, v by the static rule (no mask, or a causal one SDPA reads as is_causal):
    the fused kernel that reads grouped K/V in place (native) where it can run, else SDPA (fused,
    but repeating the grouped heads; flex runs on the CPU only when allowed)."""
    inp = AttentionInputs.create(q, k, v, **kwargs)
    return "native" if attnkit.list_backends()["native"].can_run(inp) else "sdpa"


AUTO = _fused()


def test_auto_takes_the_first_fused_kernel_for_dense_and_causal():
    assert attnkit.explain(q, k, v).chosen == AUTO
    assert attnkit.explain(q, k, v, mask=Causal()).chosen == _fused(mask=Causal())
    order = priority(AttentionInputs.create(q, k, v))
    assert order.index("native") < order.index("sdpa") < order.index("tiled")  # in place before repeats


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
        with attnkit.use_backend("tiled"):
            assert attnkit.explain(q, k, v).chosen == "tiled"
        assert attnkit.explain(q, k, v).chosen == "naive"
    assert attnkit.explain(q, k, v).chosen == AUTO
    with pytest.raises(ValueError, match="unknown backend 'fastest'"):
        with attnkit.use_backend("fastest"):
            pass
    with pytest.raises(ValueError, match="at least one backend name"):
        with attnkit.use_backend():
            pass
    with attnkit.use_backend(["sliding_window", "tiled"]):  # a list: the first that can run
        assert attnkit.explain(q, k, v).chosen == "tiled"
    with pytest.raises(TypeError, match=r"use_backend: expected backend names \(str\) or lists of them, got 3"):
        with attnkit.use_backend(3):
            pass
    with pytest.raises(TypeError, match=r"backend: expected a backend name \(str\), got NoneType"):
        with attnkit.use_backend(["tiled", None]):
            pass


def test_use_backend_is_per_thread():
    seen = {}

    def other():
        seen["chosen"] = attnkit.explain(q, k, v).chosen

    with attnkit.use_backend("naive"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["chosen"] == AUTO


def test_use_backend_restores_after_exception():
    with pytest.raises(RuntimeError):
        with attnkit.use_backend("naive"):
            raise RuntimeError("boom")
    assert attnkit.explain(q, k, v).chosen == AUTO


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

    for path in pathlib.Path(attnkit.__file__).parent.joinpath("backends").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert "dispatch" not in (node.module or "").split("."), path.name
            if isinstance(node, ast.Import):
                assert not any("dispatch" in alias.name.split(".") for alias in node.names), path.name


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
    assert f"chosen: {_fused(mask=Causal())}" in text and "runs" in text
    assert "policy: the static rule" in text and "no table at" in text


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


# --- the measured table: followed where it has a row for the call, in the setting it was measured in


def _table(tmp_path, monkeypatch, points, *, heads=2, head_dim=8, kind="none", passes="forward", device="cpu"):
    """Write a measured table (this machine) with ``points`` ((n, order) or (n, order, extra)) for
    one (device, float32, mask kind, pass, heads, head dim) key; the sweep's times follow the order."""
    path = tmp_path / "cal.json"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    key = table.entry_key(device, "float32", kind, passes, heads=heads, head_dim=head_dim)
    rows = []
    for n, order, *extra in points:
        rows.append({"n": n, "order": order, "times": {b: 1e-4 * (i + 1) for i, b in enumerate(order)},
                     **(extra[0] if extra else {})})
    table.save({"entries": {key: rows}})
    return path


def test_the_table_leads_at_the_nearest_measured_length_and_nowhere_else(tmp_path, monkeypatch):
    # tiled comes after every fused kernel in the static order: leading, it can only be the table's doing
    _table(tmp_path, monkeypatch, [(32, ["tiled", "sdpa"]), (512, ["sdpa", "tiled"])])
    chosen = lambda *shape, **kw: attnkit.explain(*(torch.randn(*s, **kw) for s in shape)).chosen  # noqa: E731
    for n, expected in ((16 + 1, "tiled"), (32, "tiled"), (127, "tiled"), (129, "sdpa"), (600, "sdpa")):
        assert chosen((1, 2, n, 8), (1, 2, n, 8), (1, 2, n, 8)) == expected, n  # sqrt(32 * 512) = 128
    x = torch.randn(1, 2, 32, 8)
    order = priority(AttentionInputs.create(x, x, x))
    assert order[:2] == ("tiled", "sdpa") and order[-1] == "naive" and len(order) == len(set(order))
    assert set(order) == set(attnkit.list_backends())
    assert attnkit.explain(x, x, x).measured == ("measured on this machine: tiled 2.00x faster than sdpa at n=32 for "
                                                 "none float32 forward H2 D8 on cpu")
    assert chosen((1, 3, 32, 8), (1, 3, 32, 8), (1, 3, 32, 8)) != "tiled"  # another head count
    assert chosen((1, 2, 32, 16), (1, 2, 32, 16), (1, 2, 32, 16)) != "tiled"  # another head dim
    assert attnkit.explain(x, x, x, mask=Causal()).chosen != "tiled"  # another mask kind
    assert attnkit.explain(x.clone().requires_grad_(), x, x).chosen != "tiled"  # training: another pass
    assert attnkit.explain(x.double(), x.double(), x.double()).chosen != "tiled"  # another dtype


def test_an_interleaved_figure_is_what_explain_quotes(tmp_path, monkeypatch):
    _table(tmp_path, monkeypatch, [(32, ["tiled", "sdpa"], {"interleaved": {"ratio": 1.31, "rounds": 5}})])
    x = torch.randn(1, 2, 32, 8)
    assert attnkit.explain(x, x, x).measured == ("measured on this machine: tiled 1.31x faster than sdpa at n=32 for "
                                                  "none float32 forward H2 D8 on cpu (interleaved, median of 5 rounds)")


def test_the_memory_guard_applies_to_the_tables_ranking(tmp_path, monkeypatch):
    # SDPA would materialize this key-padding mask: 8 * 4096**2 elements, past MATERIALIZE_LIMIT
    _table(tmp_path, monkeypatch, [(4096, ["sdpa", "tiled"])], heads=8, head_dim=64, kind="KeyPadding")
    x = torch.empty(1, 8, 4096, 64)
    order = priority(AttentionInputs.create(x, x, x, mask=KeyPadding([4000])))
    assert order.index("tiled") < order.index("sdpa")
    small = torch.empty(1, 8, 512, 64)  # the same row, nearest point, under the limit: the table leads
    assert priority(AttentionInputs.create(small, small, small, mask=KeyPadding([400])))[:2] == ("sdpa", "tiled")


def test_a_table_that_ranks_naive_first_still_tries_naive_last(tmp_path, monkeypatch):
    _table(tmp_path, monkeypatch, [(32, ["naive", "tiled", "sdpa"])])
    x = torch.randn(1, 2, 32, 8)
    order = priority(AttentionInputs.create(x, x, x))
    assert order[:2] == ("tiled", "sdpa") and order[-1] == "naive" and order.count("naive") == 1


@pytest.mark.parametrize("field, theirs", [("cpu", "Another CPU 9000"), ("attnkit", "0.0.1"),
                                           ("native", "0123456789abcdef"), ("torch", "1.0.0")])
def test_a_table_from_another_machine_is_ignored_with_one_warning(tmp_path, monkeypatch, field, theirs):
    """Another CPU, torch, attnkit release or native kernel build: its backends ran at other speeds."""
    import json
    import warnings

    path = _table(tmp_path, monkeypatch, [(32, ["tiled", "sdpa"])])
    x = torch.randn(1, 2, 32, 8)
    assert attnkit.explain(x, x, x).chosen == "tiled"
    data = json.loads(path.read_text())
    data["machine_id"][field] = theirs
    path.write_text(json.dumps(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table.reload()  # the file is read here (and at import), never per call
        chosen = [attnkit.explain(x, x, x).chosen for _ in range(3)]
    msgs = [str(w.message) for w in caught if "calibration" in str(w.message)]
    assert len(msgs) == 1 and "another machine, torch version or attnkit build" in msgs[0] and theirs in msgs[0]
    assert "Fix: run `python -m attnkit bench`" in msgs[0]
    assert chosen == [_fused()] * 3
    assert "ignored: measured on another machine" in table.status()


def test_a_table_of_another_thread_count_is_ignored_quietly_and_status_says_so(tmp_path, monkeypatch):
    import json
    import warnings

    path = _table(tmp_path, monkeypatch, [(32, ["tiled", "sdpa"])])
    data = json.loads(path.read_text())
    here = data["machine_id"]["threads"]
    data["machine_id"]["threads"] = here + 3
    path.write_text(json.dumps(data))
    x = torch.randn(1, 2, 32, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table.reload()
        e = attnkit.explain(x, x, x)
    assert e.chosen == _fused()
    assert f"measured at {here + 3} threads, this process runs {here}: not used" in table.status()
    assert f"measured at {here + 3} threads" in e.measured  # the policy line quotes the status


def test_the_table_does_not_rank_decoding(tmp_path, monkeypatch):
    """The table times square problems (Tq == Tk); a decoding step (a few queries over many keys) is
    left to the rule, whatever the table says at the length sqrt(Tq * Tk) would map to."""
    _table(tmp_path, monkeypatch, [(32, ["tiled", "sdpa"])])
    square = torch.randn(1, 2, 32, 8)
    assert attnkit.explain(square, square, square).chosen == "tiled"
    for Tq in (1, DECODE_QUERIES):
        qq, kk = torch.randn(1, 2, Tq, 8), torch.randn(1, 2, 1024 // Tq, 8)  # sqrt(Tq * Tk) = 32: the table's point
        e = attnkit.explain(qq, kk, kk)
        assert e.chosen != "tiled" and e.measured.startswith("the static rule"), Tq


# --- the decode rule: a decoding step goes to a kernel built for it ---------------------------------

def _step(Tq=1, Tk=300, grad=False, mask=Causal()):
    qq = torch.randn(1, 4, Tq, 8, requires_grad=grad)
    kk = torch.randn(1, 2, Tk, 8)
    return qq, kk, kk, dict(mask=mask)


def test_a_decoding_step_goes_to_the_decode_kernel():
    known = attnkit.list_backends()
    qq, kk, vv, kw = _step()
    if not known["decode"].decodes(AttentionInputs.create(qq, kk, vv, **kw)):
        pytest.skip("native kernel not built: the decode backend runs its PyTorch-op twin")
    for Tq, Tk in ((1, 300), (DECODE_QUERIES, 300), (1, 1)):
        e = attnkit.explain(*_step(Tq, Tk)[:3], mask=Causal())
        assert e.chosen == "decode", (Tq, Tk)
        assert e.measured == (f"the static rule: a decoding step ({Tq} queries over {Tk} keys) goes to a decode "
                              "kernel")
    prefill = AttentionInputs.create(*_step(DECODE_QUERIES + 1)[:3], mask=Causal())
    assert priority(prefill)[0] != "decode"
    train = _step(grad=True)
    assert attnkit.explain(*train[:3], **train[3]).chosen != "decode"
    # a mask the kernel reads from its structure; one it would have to materialize is no decoding kernel's
    pad = AttentionInputs.create(qq, kk, vv, mask=Causal() & KeyPadding([200]))
    assert priority(pad)[0] == "decode"


def test_a_decoding_step_without_a_decode_kernel_follows_the_static_order(monkeypatch):
    decode = attnkit.list_backends()["decode"]
    monkeypatch.setattr(decode, "decodes", classmethod(lambda cls, inp: False))
    qq, kk, vv, kw = _step()
    inp = AttentionInputs.create(qq, kk, vv, **kw)
    order = priority(inp)
    assert order.index("decode") > order.index("tiled")  # its Work: it materializes masks
    assert select(inp).name == next(n for n in order if attnkit.list_backends()[n].can_run(inp))


# --- autotuning: opt-in, once per shape class, thread-safe, explained -----------------------------

def test_autotune_times_once_per_shape_class_and_explain_quotes_it(monkeypatch):
    from attnkit.dispatch import tuning

    monkeypatch.setattr(tuning, "_TUNED", {})
    timed = []

    def fake(inp, candidates, known):  # injected measurements: the last candidate is fastest
        timed.append(tuple(candidates))
        return candidates[-1], {n: 1e-3 * (len(candidates) - i) for i, n in enumerate(candidates)}

    monkeypatch.setattr(tuning, "_time", fake)
    x = torch.randn(1, 3, 41, 12)
    inp = AttentionInputs.create(x, x, x, mask=SlidingWindow(5, 0))
    untuned = select(inp).name
    assert not tuning.enabled()
    with attnkit.autotune():
        threads = [threading.Thread(target=select, args=(inp,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winner = select(inp).name
        assert len(timed) == 1 and len(timed[0]) >= 2 and winner == timed[0][-1] != untuned
        assert list(timed[0]) == [n for n in priority(inp) if attnkit.list_backends()[n].exact
                                  and attnkit.list_backends()[n].can_run(inp)][:tuning.AUTOTUNE_CANDIDATES]
        e = attnkit.explain(x, x, x, mask=SlidingWindow(5, 0))
        assert e.chosen == winner and "autotuned" in e.measured and f"{winner} 1 ms" in e.measured
        select(AttentionInputs.create(x[:, :, :40], x[:, :, :40], x[:, :, :40], mask=SlidingWindow(5, 0)))
        assert len(timed) == 2  # another shape class
        torch.testing.assert_close(attnkit.attention(x, x, x, mask=SlidingWindow(5, 0)),
                                   attnkit.attention(x, x, x, mask=SlidingWindow(5, 0), backend="naive"),
                                   atol=1e-5, rtol=1e-5)
    assert select(inp).name == untuned  # off again after the block
    assert "autotuned" not in attnkit.explain(x, x, x, mask=SlidingWindow(5, 0)).measured


def test_autotune_real_timing_picks_a_candidate_and_skips_dropout(monkeypatch):
    from attnkit.dispatch import tuning

    monkeypatch.setattr(tuning, "_TUNED", {})
    x = torch.randn(1, 2, 24, 8)
    with attnkit.autotune():
        inp = AttentionInputs.create(x, x, x, mask=Causal() & KeyPadding([20]))
        chosen = select(inp).name
        ((key, (winner, times)),) = tuning._TUNED.items()
        assert chosen == winner and set(times) <= set(key[1]) and all(t > 0 for t in times.values())
        select(AttentionInputs.create(x, x, x, mask=Causal(), dropout_p=0.5))
        assert len(tuning._TUNED) == 1
    with pytest.raises(TypeError, match="autotune: expected True or False, got 'yes'"):
        attnkit.autotune("yes")
