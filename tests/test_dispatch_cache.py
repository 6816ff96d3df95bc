"""attention()'s per-call cache (validation and selection per call class): hits skip both, and no
choice outlives the measured table, registry or scope it was made under."""

from __future__ import annotations

import contextvars

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, SlidingWindow
from attnkit.backends import nonfinite
from attnkit.dispatch import calls, select, table
from attnkit.inputs import AttentionInputs
from attnkit.registry import Backend, Work, register_backend

from .test_dispatch_work import scratch_registry  # noqa: F401  (a fixture)

q = torch.randn(1, 2, 5, 8)  # 5 queries over 24 keys: a decoding step for the rule
kv = torch.randn(1, 2, 24, 8)


def _auto(*args, **kwargs) -> str:
    """What a fresh selection picks for ``attention(*args, **kwargs)`` (no cache)."""
    return select(AttentionInputs.create(*args, **kwargs)).name


def _register_decoder(name: str, **attrs) -> None:
    """A fused test backend with a kernel for decoding steps: by the decode rule it leads the call
    ``q, kv, kv`` (a decoding step) wherever it can run."""
    naive = attnkit.list_backends()["naive"]
    register_backend(type(f"Test_{name}", (Backend,), {
        "name": name, "work": Work(fused=True), "decodes": classmethod(lambda cls, inp: True),
        "forward": classmethod(lambda cls, inp, options: naive.forward(inp, None)), **attrs}))


@pytest.fixture
def ran(monkeypatch):
    """The names of the backends attention() runs, in order."""
    names: list[str] = []
    real = nonfinite.run
    monkeypatch.setattr(nonfinite, "run",
                        lambda impl, inp, options, host=None: names.append(impl.name) or real(impl, inp, options, host))
    monkeypatch.setattr(calls, "_CALLS", {})
    monkeypatch.setattr(calls, "_BY_IDENTITY", {})
    monkeypatch.setattr(calls, "_BY_MODIFIER", {})
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
    # a mask holding tensors is keyed by its identity: the same mask hits, an equal new one is validated
    padding = KeyPadding([20])
    for _ in range(2):
        attnkit.attention(q, kv, kv, mask=padding)
    assert sum(created) == 6
    attnkit.attention(q, kv, kv, mask=KeyPadding([20]))
    assert sum(created) == 7
    assert all(key[1] is None or "KeyPadding" not in repr(key[1]) for key in calls._CALLS)  # (.., mask, ..)


def test_a_cached_class_still_refuses_what_validation_refuses(ran):
    attnkit.attention(q, kv, kv, mask=Causal(), q_offset=19, kv_finite=True)
    with pytest.raises(TypeError, match="q_offset"):
        attnkit.attention(q, kv, kv, mask=Causal(), q_offset=True, kv_finite=True)  # True == 1 as a key
    with pytest.raises(TypeError, match="kv_finite"):
        attnkit.attention(q, kv, kv, mask=Causal(), q_offset=19, kv_finite=1)
    with pytest.raises(ValueError, match="v:"):
        attnkit.attention(q, kv, kv[:, :, :23], mask=Causal(), q_offset=19, kv_finite=True)


def test_a_new_table_changes_the_next_call(ran, tmp_path, monkeypatch):
    square = kv.clone()  # Tq == Tk: the measured table's kind of problem (a decoding step is not)
    static = _auto(square, kv, kv)
    attnkit.attention(square, kv, kv)
    assert ran[-1] == static != "tiled"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "cal.json"))
    key = table.entry_key("cpu", "float32", "none", "forward", heads=2, head_dim=8)
    table.save({"entries": {key: [{"n": 24, "order": ["tiled", "sdpa"], "times": {"tiled": 1e-5, "sdpa": 1e-3}}]}})
    attnkit.attention(square, kv, kv)
    assert ran[-1] == "tiled"
    (tmp_path / "cal.json").unlink()
    attnkit.attention(square, kv, kv)
    assert ran[-1] == "tiled"  # the table is read at reload(), never per call
    attnkit.attention(square, kv, kv, mask=KeyPadding([20]))  # a decision kept by the mask's identity
    assert calls._CALLS and calls._BY_IDENTITY
    table.reload()
    assert not calls._CALLS and not calls._BY_IDENTITY  # the decisions taken from the old table are forgotten
    attnkit.attention(square, kv, kv)
    assert ran[-1] == static


@pytest.mark.usefixtures("scratch_registry")
def test_a_newly_registered_backend_is_seen_by_the_next_call(ran):
    before = _auto(q, kv, kv)
    attnkit.attention(q, kv, kv)
    assert ran[-1] == before != "quick"
    _register_decoder("quick")  # the registry changed: no cache to clear by hand
    attnkit.attention(q, kv, kv)
    assert ran[-1] == "quick"


@pytest.mark.usefixtures("scratch_registry")
def test_scopes_and_reason_contexts_are_part_of_the_key(ran):
    allowed = contextvars.ContextVar("test_allowed", default=False)

    def reasons(cls, inp):
        return [] if allowed.get() else ["only inside the test scope"]

    _register_decoder("scoped", reason_contexts=(allowed,), extra_reasons=classmethod(reasons))
    auto = _auto(q, kv, kv)
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
    assert ran == [auto, "scoped", auto, "tiled", auto] and auto != "scoped"


def test_a_hit_runs_what_a_fresh_select_chooses(ran):
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


@pytest.mark.usefixtures("scratch_registry")
def test_an_entry_decided_under_another_registry_is_never_used(ran):
    """A thread that decided before a registration may store its entry after the registry changed:
    the entry names the registry it was decided under, and is used only while that one holds."""
    auto = _auto(q, kv, kv)
    attnkit.attention(q, kv, kv)
    assert ran[-1] == auto != "naive"
    key, (impl, fields, names, cpu, generation) = next(iter(calls._CALLS.items()))
    naive = attnkit.list_backends()["naive"]
    calls._CALLS[key] = (naive, fields, names, cpu, generation)  # as if naive had won then
    attnkit.attention(q, kv, kv)
    assert ran[-1] == "naive"  # the same registry: the entry is used
    register_backend(type("Test_idle", (Backend,), {  # runs nothing: it changes the registry, not the choice
        "name": "idle", "extra_reasons": classmethod(lambda cls, inp: ["a test backend that never runs"])}))
    calls._CALLS[key] = (naive, fields, names, cpu, generation)
    attnkit.attention(q, kv, kv)
    assert ran[-1] == auto
    assert all(entry[2] == attnkit.registry.registered_names() for entry in calls._CALLS.values())


def test_an_entry_keeps_no_tensor_of_its_call_alive(ran):
    import gc
    import weakref

    x = torch.randn(1, 2, 5, 8)
    attnkit.attention(x, kv, kv, mask=Causal())
    assert not any(isinstance(value, torch.Tensor) for entry in calls._CALLS.values() for value in entry[1].values())
    gone = weakref.ref(x)
    del x
    gc.collect()
    assert gone() is None
    y = torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(attnkit.attention(y, kv, kv, mask=Causal()),  # the hit runs on this call's tensors
                               attnkit.attention(y, kv, kv, mask=Causal(), backend="naive"))


def test_an_entry_decided_before_a_table_reload_is_never_used(ran):
    """A thread that decided under the old table may store its entry after reload() cleared the cache:
    the entry names the generation it was decided in."""
    auto = _auto(q, kv, kv)
    attnkit.attention(q, kv, kv)
    key, (impl, fields, names, cpu, generation) = next(iter(calls._CALLS.items()))
    table.reload()
    calls._CALLS[key] = (attnkit.list_backends()["naive"], fields, names, cpu, generation)  # stored late
    attnkit.attention(q, kv, kv)
    assert ran[-1] == auto


def _decode_step(H=4, T=40, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, T, D, generator=g)


def test_score_modifiers_and_sinks_are_part_of_the_key(ran, monkeypatch):
    """Calls with a score modifier or sinks take the cache too: the same objects hit, another
    object is validated anew, and an equal soft-cap (a value) hits."""
    from attnkit.score_mods import ALiBi, SoftCap

    created = []
    real = AttentionInputs.create
    monkeypatch.setattr(AttentionInputs, "create", lambda *a, **kw: created.append(1) or real(*a, **kw))
    qs, ks = _decode_step()
    alibi, sinks = ALiBi.geometric(4), torch.zeros(4)
    for _ in range(3):
        attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=alibi, sinks=sinks)
    assert len(created) == 1
    attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=ALiBi.geometric(4), sinks=sinks)
    attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=alibi, sinks=torch.zeros(4))
    assert len(created) == 3
    for _ in range(2):
        attnkit.attention(qs, ks, ks, score_mod=SoftCap(20.0))
    assert len(created) == 4
    with pytest.raises(ValueError, match="sinks"):  # a cached class still refuses a bad argument
        attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=alibi, sinks=torch.zeros(3))
    # a modifier holding tensors is known by its identity, in a cache of its own: one built anew per
    # call churns that cache only, never the plain calls' decisions
    attnkit.attention(qs, ks, ks, mask=Causal())
    plain = dict(calls._CALLS)
    for _ in range(calls._BY_MODIFIER_SIZE + 5):
        attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=ALiBi.geometric(4))
    assert calls._CALLS == plain and 0 < len(calls._BY_MODIFIER) <= calls._BY_MODIFIER_SIZE


def _kernel_memo_used(qs, ks, **kwargs) -> bool:
    """Whether the decode kernel ran this call from a cache entry's memo (needs the built extension)."""
    _, inp, _ = calls.resolve_call(qs, ks, ks, kwargs.get("mask"), None, 0.0, None, 0, False, None, "auto",
                                   kwargs.get("score_mod"), kwargs.get("sinks"))
    memo = inp.memo()
    return memo is not None and bool(memo.get("decode_plan"))


def test_in_place_changes_to_modifiers_and_sinks_reach_the_next_call(ran):
    """What a backend keeps per call class (the decode kernel's arguments) follows in-place updates
    of slopes, relative-bias tables and sinks, ``.data =`` assignments, and the thread count."""
    from attnkit.backends.decode_native import kernel_reasons
    from attnkit.score_mods import ALiBi, RelativeBias

    qs, ks = _decode_step(T=300)
    # float64 slopes and sinks: the kernel reads float32 copies of them, which must follow the originals
    alibi = ALiBi(ALiBi.geometric(4).slopes.double())
    rel = RelativeBias(torch.randn(4, 16), max_distance=64, bidirectional=False)
    sinks = torch.zeros(4, dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        for step in range(13):
            for mod in (alibi, rel):
                for _ in range(2):  # a miss, then a hit
                    out = attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=mod, sinks=sinks)
                ref = attnkit.attention(qs.double(), ks.double(), ks.double(), mask=Causal(), backend="naive",
                                        score_mod=type(mod)(**{f: getattr(mod, f).double() if f in ("slopes", "table")
                                                               else getattr(mod, f) for f in mod.__dataclass_fields__}),
                                        sinks=sinks.double())
                torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
                if not kernel_reasons(AttentionInputs.create(qs, ks, ks, mask=Causal(), score_mod=mod, sinks=sinks)):
                    assert ran[-3:-1] == ["decode", "decode"]  # the kernel ran both (then the reference)
                    assert _kernel_memo_used(qs, ks, mask=Causal(), score_mod=mod, sinks=sinks)
            # one change at a time, so each must be seen on its own
            (lambda: alibi.slopes.mul_(1.5), lambda: rel.table.add_(torch.randn(4, 16)), lambda: sinks.add_(1.0),
             lambda: torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2),
             lambda: setattr(sinks, "data", torch.randn(4, dtype=torch.float64)),
             lambda: setattr(alibi.slopes, "data", alibi.slopes * 0.5))[step % 6]()
    finally:
        torch.set_num_threads(threads)


def test_a_learnable_modifier_selects_anew_when_it_starts_requiring_grad(ran):
    from attnkit.score_mods import RelativeBias

    qs, ks = _decode_step()
    rel = RelativeBias(torch.randn(4, 16), max_distance=64, bidirectional=False)
    first = attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=rel)
    assert first.grad_fn is None
    rel.table.requires_grad_(True)
    out = attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=rel)
    out.sum().backward()
    assert rel.table.grad is not None and rel.table.grad.abs().sum() > 0
    torch.testing.assert_close(out.detach(), first)
    with torch.no_grad():
        assert attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=rel).grad_fn is None


def test_inference_tensors_and_tuples_of_modifiers_stay_exact(ran):
    """Tensors made under inference mode have no version counter: calls with them are never served
    from a memo of what was derived from their values. A tuple of modifiers is validated per call
    (its parts' tensors are not in a key)."""
    from attnkit.score_mods import ALiBi, RelativeBias, SoftCap

    qs, ks = _decode_step()
    with torch.inference_mode():
        alibi, sinks = ALiBi(ALiBi.geometric(4).slopes.double()), torch.zeros(4, dtype=torch.float64)
        for _ in range(3):
            out = attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=alibi, sinks=sinks)
            ref = attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=alibi, sinks=sinks, backend="naive")
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            sinks.add_(1.0)
            alibi.slopes.mul_(2.0)
        table = RelativeBias(torch.randn(4, 16), max_distance=64, bidirectional=False)
        for _ in range(3):
            out = attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=table)
            ref = attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=table, backend="naive")
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            table.table.mul_(-1.5)
    rel = RelativeBias(torch.randn(4, 16), max_distance=64, bidirectional=False)
    pair = (rel, SoftCap(50.0))
    first = attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=pair)
    rel.table.requires_grad_(True)
    out = attnkit.attention(qs, ks, ks, mask=Causal(), score_mod=pair)
    out.sum().backward()
    assert rel.table.grad is not None and rel.table.grad.abs().sum() > 0
    torch.testing.assert_close(out.detach(), first)
