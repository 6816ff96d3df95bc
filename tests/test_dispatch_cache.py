"""attention()'s per-call cache (validation and selection per call class): hits skip both, and no
choice outlives the calibration, machine constants, registry or scope it was made under."""

from __future__ import annotations

import contextvars

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, SlidingWindow, calibration, dispatch
from attnkit.backends import nonfinite
from attnkit.inputs import AttentionInputs
from attnkit.registry import Backend, register_backend

from .conftest import uniform_constants
from .test_dispatch_work import scratch_registry  # noqa: F401  (a fixture)

q = torch.randn(1, 2, 5, 8)
kv = torch.randn(1, 2, 24, 8)


@pytest.fixture
def ran(monkeypatch):
    """The names of the backends attention() runs, in order."""
    names: list[str] = []
    real = nonfinite.run
    monkeypatch.setattr(nonfinite, "run",
                        lambda impl, inp, options, host=None: names.append(impl.name) or real(impl, inp, options, host))
    monkeypatch.setattr(dispatch, "_CALLS", {})
    return names


def test_a_repeated_call_is_validated_and_selected_once(ran, monkeypatch):
    created = []
    real = AttentionInputs.create
    monkeypatch.setattr(AttentionInputs, "create",
                        lambda *a, **kw: created.append(a[0].device.type != "meta") or real(*a, **kw))
    mask = Causal() & SlidingWindow(6, 0)
    outs = [attnkit.attention(q, kv, kv, mask=Causal() & SlidingWindow(6, 0)) for _ in range(3)]
    assert sum(created) == 1 and len(set(ran)) == 1
    torch.testing.assert_close(outs[-1], attnkit.attention(q, kv, kv, mask=mask, backend="naive"))
    # another shape, offset or option is another call class
    attnkit.attention(q, kv, kv, mask=mask, q_offset=19)
    attnkit.attention(q[:, :, :4], kv, kv, mask=mask)
    attnkit.attention(q, kv, kv, mask=mask, return_lse=True)
    assert sum(created) == 5  # and backend="naive" above
    # a mask holding tensors is never stored (an entry would keep them alive): validated every call
    for _ in range(2):
        attnkit.attention(q, kv, kv, mask=KeyPadding([20]))
    assert sum(created) == 7
    assert all(key[1] is None or "KeyPadding" not in repr(key[1]) for key in dispatch._CALLS)  # (.., mask, ..)


def test_a_cached_class_still_refuses_what_validation_refuses(ran):
    attnkit.attention(q, kv, kv, mask=Causal(), q_offset=19, kv_finite=True)
    with pytest.raises(TypeError, match="q_offset"):
        attnkit.attention(q, kv, kv, mask=Causal(), q_offset=True, kv_finite=True)  # True == 1 as a key
    with pytest.raises(TypeError, match="kv_finite"):
        attnkit.attention(q, kv, kv, mask=Causal(), q_offset=19, kv_finite=1)
    with pytest.raises(ValueError, match="v:"):
        attnkit.attention(q, kv, kv[:, :, :23], mask=Causal(), q_offset=19, kv_finite=True)


def test_a_new_calibration_changes_the_next_call(ran, tmp_path, monkeypatch):
    square = kv.clone()  # Tq == Tk: the calibration table's kind of problem (a decode step is not)
    attnkit.attention(square, kv, kv)
    assert ran[-1] == "sdpa"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "cal.json"))
    key = calibration.entry_key("cpu", "float32", "none", "forward", heads=2, head_dim=8)
    calibration.save({"entries": {key: [{"n": 24, "order": ["naive", "sdpa"],
                                         "times": {"naive": 1e-5, "sdpa": 1e-3}}]}})
    attnkit.attention(square, kv, kv)
    assert ran[-1] == "naive"
    (tmp_path / "cal.json").unlink()
    calibration.reload()
    attnkit.attention(square, kv, kv)
    assert ran[-1] == "sdpa"


def test_new_machine_constants_change_the_next_call(ran, monkeypatch):
    constants = uniform_constants()
    constants["reference_seconds"]["tiled"] = {c: 1.0 for c in ("causal", "band", "layout", "decode")}  # slow
    monkeypatch.setattr(calibration, "_CONSTANTS", [constants])
    calibration._GENERATION[0] += 1
    attnkit.attention(q, kv, kv, mask=Causal())
    first = ran[-1]
    constants = uniform_constants()
    constants["backend_seconds"]["tiled"] = 1e-9
    constants["reference_seconds"]["tiled"] = {c: 1e-7 for c in ("causal", "band", "layout", "decode")}
    monkeypatch.setattr(calibration, "_CONSTANTS", [constants])
    calibration._GENERATION[0] += 1
    attnkit.attention(q, kv, kv, mask=Causal())
    assert first != "tiled" and ran[-1] == "tiled"


@pytest.mark.usefixtures("scratch_registry")
def test_a_newly_registered_backend_is_seen_by_the_next_call(ran, monkeypatch):
    naive = attnkit.list_backends()["naive"]
    attnkit.attention(q, kv, kv)
    assert ran[-1] == "sdpa"
    register_backend(type("Quick", (Backend,), {
        "name": "quick", "forward": classmethod(lambda cls, inp, options: naive.forward(inp, None))}))
    constants = uniform_constants()
    constants["backend_seconds"]["quick"] = 1e-9
    constants["reference_seconds"]["quick"] = {c: 1e-7 for c in ("causal", "band", "layout", "decode")}
    monkeypatch.setattr(calibration, "_CONSTANTS", [constants])  # the registry changed: no generation bump
    attnkit.attention(q, kv, kv)
    assert ran[-1] == "quick"


@pytest.mark.usefixtures("scratch_registry")
def test_scopes_and_reason_contexts_are_part_of_the_key(ran, monkeypatch):
    allowed = contextvars.ContextVar("test_allowed", default=False)
    naive = attnkit.list_backends()["naive"]

    def reasons(cls, inp):
        return [] if allowed.get() else ["only inside the test scope"]

    register_backend(type("Scoped", (Backend,), {
        "name": "scoped", "reason_contexts": (allowed,), "extra_reasons": classmethod(reasons),
        "forward": classmethod(lambda cls, inp, options: naive.forward(inp, None))}))
    constants = uniform_constants()
    constants["backend_seconds"]["scoped"] = 1e-9
    constants["reference_seconds"]["scoped"] = {c: 1e-7 for c in ("causal", "band", "layout", "decode")}
    monkeypatch.setattr(calibration, "_CONSTANTS", [constants])
    calibration._GENERATION[0] += 1
    attnkit.attention(q, kv, kv)
    token = allowed.set(True)
    try:
        attnkit.attention(q, kv, kv)
    finally:
        allowed.reset(token)
    attnkit.attention(q, kv, kv)
    with attnkit.use_backend("tiled"):
        attnkit.attention(q, kv, kv)
    attnkit.attention(q, kv, kv)
    assert ran == ["sdpa", "scoped", "sdpa", "tiled", "sdpa"]


def test_a_hit_runs_what_a_fresh_select_chooses(ran):
    from attnkit.dispatch import select

    cases = [dict(), dict(mask=Causal()), dict(mask=Causal() & SlidingWindow(6, 0)), dict(mask=Causal(), q_offset=19),
             dict(return_lse=True), dict(kv_finite=True), dict(mask=SlidingWindow(3, 2), scale=0.5)]
    for kwargs in cases:
        for _ in range(2):  # a miss, then a hit
            attnkit.attention(q, kv, kv, **kwargs)
        fresh = select(AttentionInputs.create(q, kv, kv, **kwargs)).name
        assert ran[-2:] == [fresh, fresh], kwargs
    for Tk in (1, 5, 300):  # decode and prefill shapes
        k = torch.randn(1, 2, Tk, 8)
        for _ in range(2):
            attnkit.attention(q[:, :, :1], k, k, mask=Causal(), kv_finite=True)
        assert ran[-1] == select(AttentionInputs.create(q[:, :, :1], k, k, mask=Causal(), kv_finite=True)).name


def test_an_entry_decided_under_an_older_calibration_is_never_used(ran):
    """A thread that decided under the previous calibration may store its entry after another
    thread's recalibration emptied the cache: the entry names its generation, and is not used."""
    attnkit.attention(q, kv, kv)
    assert ran[-1] == "sdpa"
    key, (impl, fields, generation, names, cpu) = next(iter(dispatch._CALLS.items()))
    dispatch._CALLS[key] = (attnkit.list_backends()["naive"], fields, generation, names, cpu)  # as if naive won then
    attnkit.attention(q, kv, kv)
    assert ran[-1] == "naive"  # same generation: the entry is used
    calibration._GENERATION[0] += 1  # a recalibration that has not emptied the cache yet
    dispatch._CALLS[key] = (attnkit.list_backends()["naive"], fields, generation, names, cpu)
    attnkit.attention(q, kv, kv)
    assert ran[-1] == "sdpa"
    assert all(entry[2] == calibration.generation() for entry in dispatch._CALLS.values())


def test_an_entry_keeps_no_tensor_of_its_call_alive(ran):
    import gc
    import weakref

    x = torch.randn(1, 2, 5, 8)
    attnkit.attention(x, kv, kv, mask=Causal())
    assert not any(isinstance(value, torch.Tensor) for entry in dispatch._CALLS.values() for value in entry[1].values())
    gone = weakref.ref(x)
    del x
    gc.collect()
    assert gone() is None
    y = torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(attnkit.attention(y, kv, kv, mask=Causal()),  # the hit runs on this call's tensors
                               attnkit.attention(y, kv, kv, mask=Causal(), backend="naive"))
