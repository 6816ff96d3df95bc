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


# --- the cost model follows the measurements it is given (injected: no machine's figures) ---------

from attnkit import BlockSparse, calibration  # noqa: E402
from attnkit.dispatch import kept_fraction  # noqa: E402

from .conftest import uniform_constants  # noqa: E402


def _meta_inputs(B, H, T, D, mask, dtype=torch.float32, Tk=None, **kw):
    x = torch.empty(B, H, T, D, dtype=dtype, device="meta")
    y = torch.empty(B, H, Tk or T, D, dtype=dtype, device="meta")
    return AttentionInputs.create(x, y, y, mask=mask, **kw)


def _with_constants(monkeypatch, constants):
    monkeypatch.setattr(calibration, "_CONSTANTS", [constants])
    calibration._GENERATION[0] += 1  # a new shape-class cache generation


def _faster(name, factor):
    """Constants of a machine where every backend runs its own modelled work at 10 GFLOP/s, except
    ``name`` at ``factor`` times that."""
    from attnkit import dispatch

    constants = uniform_constants(overhead=1e-5)
    known = attnkit.list_backends()
    for backend, classes in constants["reference_seconds"].items():
        for cls, inp in dispatch._reference_inputs(calibration.generation()).items():
            flops, _, _ = dispatch._work_terms(backend, known[backend], inp)
            classes[cls] = 1e-5 + flops / 1e10 / (factor if backend == name else 1.0)
    return constants


@pytest.mark.parametrize("mask, T, rival", [
    (Causal() & SlidingWindow(200, 0), 6000, "sliding_window"),
    (BlockSparse.bigbird(90, 48, window=1, global_blocks=1, random_blocks=2, seed=3), 90 * 48, "block_sparse"),
])
def test_cost_model_follows_the_measured_rates(monkeypatch, mask, T, rival):
    inp = _meta_inputs(1, 3, T, 40, mask)
    order = lambda: [n for n in priority(inp) if n in ("native", rival, "sdpa")]  # noqa: E731
    if "native" in attnkit.list_backends():
        _with_constants(monkeypatch, _faster("native", 4.0))
        assert order()[0] == "native"
        _with_constants(monkeypatch, _faster(rival, 20.0))
        assert order()[0] == rival
    # Whatever the rates, a long structured mask never goes to SDPA's materialized path.
    _with_constants(monkeypatch, _faster("sdpa", 1.2))
    assert order()[0] != "sdpa"


def test_close_estimates_keep_the_built_in_order(monkeypatch):
    inp = _meta_inputs(2, 5, 97, 24, None)
    _with_constants(monkeypatch, _faster("decode", 1.1))  # within the model's margin: no reordering
    order = priority(inp)
    assert order.index("sdpa") < order.index("decode")
    _with_constants(monkeypatch, _faster("decode", 2.0))  # beyond it: the measurement wins
    order = priority(inp)
    assert order.index("decode") < order.index("sdpa")
    x = torch.randn(2, 5, 97, 24)
    assert "estimated from the probed constants: " in attnkit.explain(x, x, x).measured


def test_backends_of_one_kind_are_ordered_by_their_estimates(monkeypatch):
    """Between two fused kernels the registry's order says nothing about speed: a 1.2x faster
    estimate puts the later one first (within SAME_KIND_MARGIN they keep the built-in order), while
    a PyTorch-op loop 1.2x faster still stays behind a fused kernel (MODEL_MARGIN)."""
    from attnkit import dispatch

    if "native" not in attnkit.list_backends() or not attnkit.list_backends()["native"].available():
        pytest.skip("native kernel not built")
    inp = _meta_inputs(2, 5, 300, 24, None)
    pair = lambda: [n for n in priority(inp) if n in ("native", "sdpa")]  # noqa: E731
    assert dispatch.SAME_KIND_MARGIN < 1.2 < dispatch.MODEL_MARGIN
    _with_constants(monkeypatch, _faster("native", 1.2))
    assert pair() == ["native", "sdpa"]
    _with_constants(monkeypatch, _faster("native", 1.02))
    assert pair() == ["sdpa", "native"]
    _with_constants(monkeypatch, _faster("tiled", 1.2))
    order = priority(inp)
    assert order.index("sdpa") < order.index("tiled")


def test_training_pays_each_backends_measured_backward_overhead(monkeypatch):
    """A backend twice as fast per FLOP whose forward+backward costs 2 ms per call even on a tiny
    input: picked for training only where the work outweighs that cost; its forward is unaffected."""
    if "native" not in attnkit.list_backends() or not attnkit.list_backends()["native"].available():
        pytest.skip("native kernel not built")
    constants = _faster("native", 2.0)
    constants["train_backend_seconds"]["native"] = 2e-3
    _with_constants(monkeypatch, constants)
    first = lambda inp: next(n for n in priority(inp) if n in ("native", "sdpa"))  # noqa: E731
    small, large = _meta_inputs(1, 4, 128, 32, None), _meta_inputs(1, 4, 2048, 32, None)
    assert first(small) == "native" and first(large) == "native"
    small_train = _meta_inputs(1, 4, 128, 32, None)
    small_train.q.requires_grad_()
    large_train = _meta_inputs(1, 4, 2048, 32, None)
    large_train.q.requires_grad_()
    assert first(small_train) == "sdpa" and first(large_train) == "native"
    del constants["train_backend_seconds"]  # an older probe's constants: three forwards
    _with_constants(monkeypatch, constants)
    assert first(small_train) == "native"


def test_training_is_priced_by_each_backends_measured_backward(monkeypatch):
    """Two backends equally fast forward: the one whose forward and backward on the causal reference
    took twice as long is priced twice as high for training (less the per-call costs), and the
    forward prices stay equal; constants without that measurement price a backward as two forwards."""
    from attnkit import dispatch

    constants = uniform_constants()
    reference = constants["reference_seconds"]["sdpa"]["causal"]
    constants["train_reference_seconds"] = {"sdpa": 4 * reference, "tiled": 8 * reference}
    inp = _meta_inputs(1, 8, 512, 64, Causal())
    train = _meta_inputs(1, 8, 512, 64, Causal())
    train.q.requires_grad_()
    fwd = {n: dispatch.estimated_seconds(n, inp, constants) for n in ("sdpa", "tiled")}
    assert fwd["sdpa"] == pytest.approx(fwd["tiled"])
    est = {n: dispatch.estimated_seconds(n, train, constants) - constants["train_backend_seconds"][n]
           for n in ("sdpa", "tiled")}
    assert est["tiled"] / est["sdpa"] == pytest.approx((8 * reference - 3e-4) / (4 * reference - 3e-4), rel=1e-6)
    del constants["train_reference_seconds"]
    assert dispatch.estimated_seconds("tiled", train, constants) == pytest.approx(
        constants["train_backend_seconds"]["tiled"] + 3 * (fwd["tiled"] - constants["backend_seconds"]["tiled"]))


def test_a_decode_step_goes_to_the_backend_estimated_faster(monkeypatch):
    """Decoding is priced from a decode reference (bytes read per second): the decode backend,
    last of the built-in order for prefill (its PyTorch-op twin materializes the scores), leads a
    decode step it is estimated 1.2x faster on, within MODEL_MARGIN."""
    from attnkit import dispatch

    constants = _faster("decode", 1.2)
    _with_constants(monkeypatch, constants)
    step = _meta_inputs(4, 8, 1, 64, Causal() & KeyPadding([4096, 3000, 2000, 1000]), Tk=4096)
    order = priority(step)
    assert 1.2 < dispatch.MODEL_MARGIN and order.index("decode") < order.index("sdpa")
    prefill = _meta_inputs(1, 8, 256, 64, None)
    order = priority(prefill)
    assert order.index("sdpa") < order.index("decode")  # prefill: the margin keeps the fused kernel first


def test_kept_fraction_reads_the_mask_structure():
    inp = _meta_inputs(1, 1, 1000, 8, Causal())
    assert abs(kept_fraction(inp, (1, 1)) - 0.5) < 0.02
    window = _meta_inputs(1, 1, 3000, 8, Causal() & SlidingWindow(99, 0))
    assert abs(kept_fraction(window, (1, 1)) - 100 / 3000) < 0.01
    assert kept_fraction(window, (100, 100)) > kept_fraction(window, (1, 1))  # partial tiles count whole
    layout = BlockSparse.bigbird(20, 16, window=1, global_blocks=1, random_blocks=1, seed=1)
    sparse = _meta_inputs(1, 1, 320, 8, layout)
    assert abs(kept_fraction(sparse, (16, 16)) - layout.density(320, 320)) < 0.03  # from 64 sampled rows
    assert kept_fraction(_meta_inputs(1, 1, 50, 8, KeyPadding([20])), (8, 8)) == 1.0  # unknown: all


def test_priority_is_cached_per_shape_class_with_exact_offsets(monkeypatch):
    from attnkit import dispatch

    calls = []
    real = dispatch._priority
    monkeypatch.setattr(dispatch, "_priority", lambda inp: calls.append(1) or real(inp))
    monkeypatch.setattr(dispatch, "_PRIORITY_CACHE", {})
    a = _meta_inputs(1, 2, 1, 16, Causal(), Tk=300)
    for _ in range(3):
        priority(a)
    assert len(calls) == 1
    priority(_meta_inputs(1, 2, 1, 16, Causal(), Tk=300, q_offset=5))  # other positions: decided again
    assert len(calls) == 2


def test_the_real_probe_measures_every_exact_backend(tmp_path, monkeypatch):
    constants = calibration.probe_constants()
    assert calibration._constants_problem(constants) is None
    for name in ("sdpa", "naive"):
        assert constants["backend_seconds"][name] > 0
    assert set(constants["reference_seconds"]["sdpa"]) == {"causal", "band", "layout", "decode"}
    assert "naive" not in constants["reference_seconds"]  # never ranked by cost: its references are not timed
    assert set(constants["decode_small_seconds"]) == {n for n, r in constants["reference_seconds"].items()
                                                      if "decode" in r} and "sdpa" in constants["decode_small_seconds"]
    assert set(constants["decode_tiny_seconds"]) == set(constants["decode_small_seconds"])


def _table_preferring_naive(tmp_path, monkeypatch):
    """A calibration table (this machine) ranking naive first at (2 heads, head dim 8, n=32); its path."""
    path = tmp_path / "cal.json"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    key = calibration.entry_key("cpu", "float32", "none", "forward", heads=2, head_dim=8)
    calibration.save({"entries": {key: [{"n": 32, "order": ["naive", "sdpa"],
                                         "times": {"naive": 1e-4, "sdpa": 1e-3}}]}})
    return path


@pytest.mark.parametrize("field, theirs", [("cpu", "Another CPU 9000"), ("attnkit", "0.0.1"),
                                           ("native", "0123456789abcdef")])
def test_calibration_from_another_machine_is_ignored_with_one_warning(tmp_path, monkeypatch, field, theirs):
    """Another CPU, attnkit release or native kernel build: its backends ran at other speeds."""
    import json
    import warnings

    path = _table_preferring_naive(tmp_path, monkeypatch)
    x = torch.randn(1, 2, 32, 8)
    assert attnkit.explain(x, x, x).chosen == "naive"
    assert attnkit.explain(torch.randn(1, 3, 32, 8), torch.randn(1, 3, 32, 8),
                           torch.randn(1, 3, 32, 8)).chosen != "naive"
    data = json.loads(path.read_text())
    data["machine_id"][field] = theirs
    path.write_text(json.dumps(data))
    calibration.reload()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = [attnkit.explain(x, x, x).chosen for _ in range(3)]
    msgs = [str(w.message) for w in caught if "calibration" in str(w.message)]
    assert len(msgs) == 1 and "another machine, torch version or attnkit build" in msgs[0] and theirs in msgs[0]
    assert chosen == ["sdpa"] * 3


def test_a_tie_within_noise_is_not_applied(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "cal.json"))
    key = calibration.entry_key("cpu", "float32", "none", "forward", heads=2, head_dim=8)
    calibration.save({"entries": {key: [{"n": 32, "order": ["naive", "sdpa"], "times": {"naive": 1e-4, "sdpa": 1.01e-4},
                                         "tie": True}]}})
    x = torch.randn(1, 2, 32, 8)
    e = attnkit.explain(x, x, x)
    assert e.chosen == "sdpa" and "within noise" in e.measured


# --- autotuning: opt-in, once per shape class, thread-safe, explained -----------------------------

def test_autotune_times_once_per_shape_class_and_explain_quotes_it(monkeypatch):
    from attnkit import dispatch

    monkeypatch.setattr(dispatch, "_TUNED", {})
    timed = []

    def fake(inp, candidates, known):  # injected measurements: the last candidate is fastest
        timed.append(tuple(candidates))
        return candidates[-1], {n: 1e-3 * (len(candidates) - i) for i, n in enumerate(candidates)}

    monkeypatch.setattr(dispatch, "_time_candidates", fake)
    x = torch.randn(1, 3, 41, 12)
    inp = AttentionInputs.create(x, x, x, mask=SlidingWindow(5, 0))
    untuned = select(inp).name
    with attnkit.autotune():
        threads = [threading.Thread(target=select, args=(inp,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winner = select(inp).name
        assert len(timed) == 1 and len(timed[0]) >= 2 and winner == timed[0][-1] != untuned
        e = attnkit.explain(x, x, x, mask=SlidingWindow(5, 0))
        assert e.chosen == winner and "autotuned" in e.measured and f"{winner} 1 ms" in e.measured
        select(AttentionInputs.create(x[:, :, :40], x[:, :, :40], x[:, :, :40], mask=SlidingWindow(5, 0)))
        assert len(timed) == 2  # another shape class
        torch.testing.assert_close(attnkit.attention(x, x, x, mask=SlidingWindow(5, 0)),
                                   attnkit.attention(x, x, x, mask=SlidingWindow(5, 0), backend="naive"),
                                   atol=1e-5, rtol=1e-5)
    assert select(inp).name == untuned  # off again after the block


def test_autotune_real_timing_picks_a_candidate_and_skips_dropout(monkeypatch):
    from attnkit import dispatch

    monkeypatch.setattr(dispatch, "_TUNED", {})
    x = torch.randn(1, 2, 24, 8)
    with attnkit.autotune():
        inp = AttentionInputs.create(x, x, x, mask=Causal() & KeyPadding([20]))
        chosen = select(inp).name
        ((key, (winner, times)),) = dispatch._TUNED.items()
        assert chosen == winner and set(times) <= set(key[1]) and all(t > 0 for t in times.values())
        select(AttentionInputs.create(x, x, x, mask=Causal(), dropout_p=0.5))
        assert len(dispatch._TUNED) == 1
    with pytest.raises(TypeError, match="autotune"):
        attnkit.autotune("yes")


def test_decoding_is_modelled_by_the_bytes_it_reads(monkeypatch):
    """A few queries over a cache cost the K/V bytes they read, at each backend's measured bytes per
    second: the estimate grows with the keys and the stored element size, not with the queries, and
    the backend that reads faster on the reference leads at long contexts."""
    from attnkit import dispatch

    _with_constants(monkeypatch, _faster("decode", 3.0))
    constants = calibration.machine_constants()
    over = constants["backend_seconds"]["decode"]  # the per-call part, beside the bytes
    # no mask: no mask bytes beside the cache's
    est = lambda *a, **kw: dispatch.estimated_seconds("decode", _meta_inputs(*a, None, **kw), constants) - over  # noqa: E731
    base = est(1, 4, 1, 64, Tk=8192)
    assert est(1, 4, 1, 64, Tk=16384) == pytest.approx(2 * base, rel=1e-6)
    assert est(1, 4, 16, 64, Tk=8192) == pytest.approx(base, rel=1e-6)
    assert est(1, 4, 1, 64, Tk=8192, dtype=torch.bfloat16) == pytest.approx(base / 2, rel=1e-6)
    long = _meta_inputs(1, 8, 1, 64, Causal(), Tk=32768)
    assert priority(long)[0] == "decode"
    _with_constants(monkeypatch, _faster("sdpa", 3.0))
    assert priority(long)[0] == "sdpa"


def test_decoding_is_priced_by_a_fixed_part_and_a_cost_per_byte_from_two_decode_problems(monkeypatch):
    """With a backend's times on the 16-key, the small and the reference decode problems (here on one
    line per backend), a decode step costs that line: a backend with a large fixed part but fewer
    seconds per byte loses short caches and wins long ones; the crossover is where the lines meet."""
    from attnkit import dispatch

    def kv_bytes(problem):  # K and V of a float32 problem
        (B, H, _, Tk, D), _mask = problem
        return 2 * B * H * Tk * D * 4

    ref_bytes = kv_bytes(calibration.reference_problems()["decode"])
    small_bytes = kv_bytes(calibration.decode_small_problem())
    constants = _faster("decode", 1.0)
    big = constants["reference_seconds"]["sdpa"]["decode"]
    for name in constants["reference_seconds"]:
        constants["reference_seconds"][name]["decode"] = big
    # sdpa: no fixed part, `big` at the reference; decode: 50 us fixed, half sdpa's cost per byte
    per_byte = big / ref_bytes
    constants["decode_small_seconds"] = {"sdpa": per_byte * small_bytes, "decode": 50e-6 + per_byte / 2 * small_bytes}
    tiny_bytes = kv_bytes(calibration.decode_tiny_problem())  # the 16-key step on the same lines
    constants["decode_tiny_seconds"] = {"sdpa": per_byte * tiny_bytes,
                                        "decode": 50e-6 + per_byte / 2 * tiny_bytes}
    constants["reference_seconds"]["decode"]["decode"] = 50e-6 + per_byte / 2 * ref_bytes
    _with_constants(monkeypatch, constants)
    constants = calibration.machine_constants()

    def est(name, Tk, **kw):
        return dispatch.estimated_seconds(name, _meta_inputs(1, 8, 1, 64, Causal(), Tk=Tk, **kw), constants)

    row = 2 * 8 * 64 * 4  # K/V bytes per key of these inputs
    assert est("sdpa", 4096) == pytest.approx(per_byte * 4096 * row, rel=1e-6)
    assert est("decode", 8192) == pytest.approx(50e-6 + per_byte / 2 * 8192 * row, rel=1e-6)
    assert est("decode", 512, dtype=torch.bfloat16) == pytest.approx(50e-6 + per_byte / 2 * 512 * row / 2, rel=1e-6)
    crossover = 50e-6 / (per_byte / 2 * row)  # keys where sdpa's cost equals decode's
    short, long = int(crossover / 2), int(crossover * 2)
    assert est("sdpa", short) < est("decode", short) and est("decode", long) < est("sdpa", long)
    assert priority(_meta_inputs(1, 8, 1, 64, Causal(), Tk=short)).index("sdpa") < priority(
        _meta_inputs(1, 8, 1, 64, Causal(), Tk=short)).index("decode")
    assert priority(_meta_inputs(1, 8, 1, 64, Causal(), Tk=long))[0] == "decode"
    # no small (and 16-key) problem measured: the bytes per second after the overhead
    del constants["decode_small_seconds"]
    over = constants["backend_seconds"]["decode"]
    ref = constants["reference_seconds"]["decode"]["decode"]
    assert est("decode", 8192) == pytest.approx(over + (ref - over) * 8192 * row / ref_bytes)


def test_a_short_cache_costs_the_line_from_the_16_key_step_to_the_small_one(monkeypatch):
    """Below the small decode problem a step costs the line from the 16-key call's time (its fixed
    part) to the small call's: never less than that fixed part, so a backend with the smaller fixed
    part takes short caches even where its cost per byte is higher."""
    from attnkit import dispatch

    def kv_bytes(problem):  # K and V of a float32 problem
        (B, H, _, Tk, D), _mask = problem
        return 2 * B * H * Tk * D * 4

    small_bytes, tiny_bytes = kv_bytes(calibration.decode_small_problem()), kv_bytes(calibration.decode_tiny_problem())
    constants = _faster("decode", 1.0)
    for name in constants["reference_seconds"]:
        constants["reference_seconds"][name]["decode"] = 5e-3
    # sdpa: 10 us fixed, 200 us at the small problem; decode: 40 us fixed, 100 us there
    constants["decode_tiny_seconds"] = {"sdpa": 10e-6, "decode": 40e-6}
    constants["decode_small_seconds"] = {"sdpa": 200e-6, "decode": 100e-6}
    _with_constants(monkeypatch, constants)
    constants = calibration.machine_constants()

    def est(name, Tk):
        return dispatch.estimated_seconds(name, _meta_inputs(1, 8, 1, 64, Causal(), Tk=Tk), constants)

    row = 2 * 8 * 64 * 4  # K/V bytes per key of these inputs
    assert est("sdpa", 4) == pytest.approx(10e-6) and est("decode", 16) == pytest.approx(40e-6)  # the fixed part
    mid = (tiny_bytes + small_bytes) // 2 // row
    assert est("sdpa", mid) == pytest.approx(10e-6 + 190e-6 * (mid * row - tiny_bytes) / (small_bytes - tiny_bytes))
    assert priority(_meta_inputs(1, 8, 1, 64, Causal(), Tk=32))[0] == "sdpa"  # the smaller fixed part
    assert priority(_meta_inputs(1, 8, 1, 64, Causal(), Tk=small_bytes // row))[0] == "decode"


def test_a_backend_that_repeats_grouped_heads_reads_them_once_per_query_head():
    """SDPA on the CPU repeats grouped K/V per query head (Work.gqa == "repeats"): a decode step with
    4 query heads per K/V head reads 4x its cache's bytes there, and once in the decode kernel."""
    from attnkit import dispatch

    known = attnkit.list_backends()
    assert known["sdpa"].work.gqa == "repeats" and known["decode"].work.gqa == "in_place"
    for name, factor in (("sdpa", 4.0), ("decode", 1.0)):
        mha = dispatch._work_terms(name, known[name], _meta_inputs(1, 8, 1, 64, Causal(), Tk=4096))[0]
        x, kv = torch.empty(1, 32, 1, 64, device="meta"), torch.empty(1, 8, 4096, 64, device="meta")
        gqa = dispatch._work_terms(name, known[name], AttentionInputs.create(x, kv, kv, mask=Causal()))[0]
        assert gqa == pytest.approx(factor * mha)


def test_a_table_of_another_thread_count_says_so(tmp_path, monkeypatch):
    import json

    path = _table_preferring_naive(tmp_path, monkeypatch)
    data = json.loads(path.read_text())
    here = data["machine_id"]["threads"]
    data["machine_id"]["threads"] = here + 3
    path.write_text(json.dumps(data))
    calibration.reload()
    x = torch.randn(1, 2, 32, 8)
    with pytest.warns(RuntimeWarning, match=f"measured with {here + 3} threads, this process runs {here}"):
        assert attnkit.explain(x, x, x).chosen != "naive"


def test_half_precision_follows_each_backends_own_measured_speed(monkeypatch):
    """A backend whose bfloat16 path is slower than its float32 one on this machine (a kernel that does
    not use the fast half GEMMs) is priced by that measurement, not by the machine's GEMM ratio."""
    if "native" not in attnkit.list_backends() or not attnkit.list_backends()["native"].available():
        pytest.skip("native kernel not built")
    constants = _faster("native", 1.0)
    for name, times in constants["half_reference_seconds"].items():
        times["bfloat16"] = constants["reference_seconds"][name]["causal"]
    # no mask: both compute every tile (their tile sizes differ, and so would what a causal mask skips)
    inp = _meta_inputs(1, 8, 512, 64, None, dtype=torch.bfloat16)
    _with_constants(monkeypatch, constants)
    order = [n for n in priority(inp) if n in ("native", "sdpa")]
    assert order == ["sdpa", "native"]  # equal speeds: the built-in order
    constants = {**constants, "half_reference_seconds": {**constants["half_reference_seconds"]}}
    constants["half_reference_seconds"]["sdpa"] = {"bfloat16": 3 * constants["reference_seconds"]["sdpa"]["causal"]}
    _with_constants(monkeypatch, constants)
    assert [n for n in priority(inp) if n in ("native", "sdpa")] == ["native", "sdpa"]
    fp32 = _meta_inputs(1, 8, 512, 64, None)
    assert [n for n in priority(fp32) if n in ("native", "sdpa")] == ["sdpa", "native"]  # float32 unchanged


def test_the_calibration_table_does_not_rank_decoding(tmp_path, monkeypatch):
    """The table times square problems (Tq == Tk); a decode step (a few queries over many keys) is left
    to the cost model, whatever the table says at the length sqrt(Tq * Tk) would map to."""
    _table_preferring_naive(tmp_path, monkeypatch)
    square = torch.randn(1, 2, 32, 8)
    assert attnkit.explain(square, square, square).chosen == "naive"
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1024, 8)  # sqrt(1 * 1024) = 32: the table's point
    e = attnkit.explain(q, k, k)
    assert e.chosen != "naive" and "decoding (1 queries)" in e.measured
