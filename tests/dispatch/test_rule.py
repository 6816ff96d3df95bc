"""The rule ``auto`` follows (attnkit.dispatch.rule): the static order from each backend's declared
``Work``, the decode rule, the memory guard and the measured table, each checked as data."""

from __future__ import annotations

import json

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, SlidingWindow
from attnkit.dispatch import MATERIALIZE_LIMIT, builtin_order, priority, rule, table
from attnkit.inputs import AttentionInputs
from attnkit import registry
from attnkit.registry import Backend, Work, list_backends, register_backend

NATIVE = attnkit.backends.native.load_extension()[0] is not None


def _inp(B=1, H=4, Tq=64, Tk=64, D=16, Hkv=None, dtype=torch.float32, mask=None, grad=False):
    one = torch.zeros(1, 1, 1, 1, dtype=dtype)  # expanded: the shapes without the memory
    q = one.clone().requires_grad_(grad).expand(B, H, Tq, D)
    k = one.expand(B, Hkv or H, Tk, D)
    return AttentionInputs.create(q, k, k, mask=mask)


def _first_runnable(inp):
    known = list_backends()
    return next(n for n in priority(inp) if known[n].exact and known[n].can_run(inp))


def test_the_static_order_follows_the_declared_work():
    """Across the built-in order, the key (materializes this call's mask, loops, not fused, repeats grouped
    K/V) never decreases: the order is read from Work, not from any timing."""
    known = list_backends()
    for mask in (None, Causal(), SlidingWindow(8, 0), KeyPadding([40])):
        inp = _inp(mask=mask, Tq=64, Tk=64)
        order = builtin_order(inp)
        keys = [(rule._materialized(known[n], inp) > 0, *rule._work_key(known[n])) for n in order]
        assert keys == sorted(keys), (mask, order, keys)
        assert "naive" not in order and all(known[n].exact for n in order)


def test_fused_kernels_reading_grouped_kv_in_place_come_before_sdpa():
    order = builtin_order(_inp(Hkv=2, mask=Causal()))
    assert order.index("native") < order.index("sdpa")  # both fused; sdpa repeats grouped K/V
    if NATIVE:
        assert _first_runnable(_inp(Hkv=2, mask=Causal())) == "native"
    else:
        assert _first_runnable(_inp(Hkv=2, mask=Causal())) == "sdpa"


def test_a_backend_that_would_materialize_the_mask_goes_after_those_that_read_it():
    """SDPA given a window materializes it: the structure-reading backends come first."""
    inp = _inp(Tq=256, Tk=256, mask=SlidingWindow(16, 0))
    order = builtin_order(inp)
    assert list_backends()["sdpa"].dense_mask_elements(inp) > 0
    assert order.index("sliding_window") < order.index("sdpa")
    assert _first_runnable(inp) == ("native" if NATIVE else "sliding_window")


def test_the_memory_guard_puts_huge_materializations_last():
    n = int((MATERIALIZE_LIMIT // 4) ** 0.5) + 64  # B=1, H=4: past the limit
    inp = _inp(Tq=n, Tk=n, mask=KeyPadding([n - 3]))
    order = priority(inp)
    known = list_backends()
    exact = [x for x in order if known[x].exact and x != "naive"]
    heavy = [x for x in exact if rule._materialized(known[x], inp) > MATERIALIZE_LIMIT]
    assert heavy, "the test's input should be past the limit for some backend"
    light = [x for x in exact if x not in heavy]
    assert max(order.index(x) for x in light) < min(order.index(h) for h in heavy)


def test_decode_rule_sends_a_decoding_step_to_a_decode_kernel():
    inp = _inp(Tq=1, Tk=777, Hkv=2, mask=Causal())
    decode = list_backends()["decode"]
    order = builtin_order(inp)
    if decode.decodes(inp):
        assert order[0] == "decode"
    else:  # no native decode kernel here: the static order decides, decode's PyTorch twin is not preferred
        assert order[0] != "decode"
    # a prefill, a training step and more queries than keys are no decoding steps
    for other in (_inp(Tq=17, Tk=777), _inp(Tq=1, Tk=777, grad=True), _inp(Tq=8, Tk=4)):
        assert builtin_order(other)[0] != "decode" or not decode.decodes(other)


def test_a_registered_backend_joins_the_order_by_its_work(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_NAMES", [tuple(registry._REGISTRY)])

    @register_backend
    class Plain(Backend):
        name = "plain_rule_test"
        work = Work()

        @classmethod
        def forward(cls, inp, options):
            raise AssertionError("never run")

    order = builtin_order(_inp(mask=Causal()))
    assert order.index("plain_rule_test") > order.index("sdpa")  # PyTorch ops after fused kernels
    assert order.index("plain_rule_test") < order.index("tiled")  # whole-tensor ops before tile loops


def _write_table(path, entries, **machine):
    from attnkit import hardware

    data = {"version": table.VERSION, "machine_id": {**hardware.machine_id(), **machine}, "entries": entries}
    path.write_text(json.dumps(data))


def test_the_measured_table_leads_where_it_has_a_row(tmp_path, monkeypatch):
    key = table.entry_key("cpu", "float32", "Causal", "forward", heads=4, head_dim=16)
    _write_table(tmp_path / "t.json", {key: [
        {"n": 64, "order": ["tiled", "sdpa"], "times": {"tiled": 1e-3, "sdpa": 2e-3},
         "interleaved": {"ratio": 1.9, "rounds": 5}}]})
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "t.json"))
    table.reload()
    inp = _inp(mask=Causal())
    assert priority(inp)[:2] == ("tiled", "sdpa")
    assert "tiled 1.90x faster than sdpa" in attnkit.explain(*_tensors(), mask=Causal()).measured
    # no row for another mask, head count or a decoding step: the static rule
    assert priority(_inp(mask=None))[0] != "tiled"
    assert priority(_inp(H=8, mask=Causal()))[0] != "tiled"
    assert priority(_inp(Tq=1, Tk=64, mask=Causal()))[0] != "tiled"


def _tensors(H=4, T=64, D=16):
    x = torch.randn(1, H, T, D)
    return x, x, x


def test_a_table_at_another_thread_count_is_ignored_quietly(tmp_path, monkeypatch, recwarn):
    key = table.entry_key("cpu", "float32", "Causal", "forward", heads=4, head_dim=16)
    _write_table(tmp_path / "t.json", {key: [{"n": 64, "order": ["tiled"], "times": {"tiled": 1e-3}}]},
                 threads=torch.get_num_threads() + 7)
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "t.json"))
    table.reload()
    assert priority(_inp(mask=Causal()))[0] != "tiled"
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert "threads" in table.status() and "not used" in table.status()


def test_explain_names_the_rule_in_one_line():
    line = attnkit.explain(*_tensors(), mask=Causal()).measured
    assert "static rule" in line and "\n" not in line
    q = torch.randn(1, 4, 1, 16)
    k = torch.randn(1, 2, 300, 16)
    e = attnkit.explain(q, k, k, mask=Causal())
    if list_backends()["decode"].decodes(AttentionInputs.create(q, k, k, mask=Causal())):
        assert e.chosen == "decode" and "decoding step" in e.measured


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_path_follows_cpu_features_not_timing(monkeypatch, dtype):
    from attnkit import hardware
    from attnkit.backends import native

    feature = hardware.HALF_MATMUL_FEATURES[dtype][0]
    try:
        for has in (True, False):
            monkeypatch.setattr(hardware, "cpu_features", lambda has=has: {feature: has})
            monkeypatch.delenv("ATTNKIT_HALF_MATMUL", raising=False)
            hardware.refresh()
            monkeypatch.setattr(hardware, "matmul_rate", lambda *a, **k: pytest.fail("timed"))
            assert hardware.half_matmul_is_fast(dtype) is has
            assert (feature in hardware.half_matmul_reason(dtype))
            note = native.half_tiles_note(dtype)
            assert ("tiles in the kernel" in note) is has and feature in note
        monkeypatch.setenv("ATTNKIT_HALF_MATMUL", "fast")
        hardware.refresh()
        assert hardware.half_matmul_is_fast(dtype) and "ATTNKIT_HALF_MATMUL" in hardware.half_matmul_reason(dtype)
        monkeypatch.setenv("ATTNKIT_HALF_MATMUL", "sometimes")
        hardware.refresh()
        with pytest.raises(ValueError, match="ATTNKIT_HALF_MATMUL"):
            hardware.half_matmul_is_fast(dtype)
    finally:
        monkeypatch.undo()
        hardware.refresh()
