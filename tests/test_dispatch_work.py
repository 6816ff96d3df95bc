"""What each backend skips, fuses and materializes is its own class data (``Backend.work``): the
dispatcher's built-in order and cost model read it, so a new backend needs no dispatcher edit."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, calibration, dispatch, registry
from attnkit.dispatch import builtin_order, priority
from attnkit.inputs import AttentionInputs
from attnkit.registry import Backend, Work, register_backend

from .conftest import uniform_constants


@pytest.fixture
def scratch_registry(monkeypatch):
    """Register test backends into a copy of the registry (restored afterwards)."""
    attnkit.list_backends()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_NAMES", [tuple(registry._REGISTRY)])
    yield
    builtin_order.cache_clear()


def _naive_like(name: str, work: Work | None = None) -> type[Backend]:
    naive = attnkit.list_backends()["naive"]
    attrs = {"name": name, "forward": classmethod(lambda cls, inp, options: naive.forward(inp, None))}
    if work is not None:
        attrs["work"] = work
    return register_backend(type(f"Test_{name}", (Backend,), attrs))


def test_every_builtin_backend_declares_its_work_and_the_dispatcher_names_none():
    import inspect

    for name, impl in attnkit.list_backends().items():
        assert isinstance(impl.work, Work), name
        assert impl.capabilities()["work"]["skips"] in ("nothing", "tiles", "layout")
    source = inspect.getsource(dispatch)
    for name in attnkit.list_backends():  # no backend table in the dispatcher: names only in prose
        assert f'"{name}": Work(' not in source and "WORK" not in source


def test_builtin_order_follows_the_declared_work():
    order = builtin_order(registry.registered_names())
    known = attnkit.list_backends()
    ranks = [known[n].work.rank() for n in order]
    assert ranks == sorted(ranks)  # fused first, then whole-tensor ops, loops, materializing
    assert order.index("sdpa") < order.index("tiled") < order.index("naive")
    assert all(known[n].exact for n in order)


def test_a_new_backend_without_declared_work_is_ranked_by_measurement(scratch_registry, monkeypatch):
    _naive_like("plain")  # declares nothing: the default Work
    assert registry.get_backend("plain").work == Work()
    x = torch.empty(1, 2, 300, 16, device="meta")
    inp = AttentionInputs.create(x, x, x, mask=Causal())
    constants = uniform_constants()
    monkeypatch.setattr(calibration, "_CONSTANTS", [constants])
    calibration._GENERATION[0] += 1
    assert "plain" in priority(inp) and priority(inp).index("plain") > priority(inp).index("sdpa")
    # the probe says it is 50x faster on every reference problem: the cost model puts it first
    constants = uniform_constants()
    constants["backend_seconds"]["plain"] = 1e-7
    constants["reference_seconds"]["plain"] = {c: 2e-5 for c in ("causal", "band", "layout", "decode")}
    monkeypatch.setattr(calibration, "_CONSTANTS", [constants])
    calibration._GENERATION[0] += 1
    assert priority(inp)[0] == "plain"


def test_declared_work_places_a_new_backend_in_the_builtin_order(scratch_registry):
    _naive_like("fused_one", Work("tiles", (64, 64), fused=True))
    _naive_like("loopy", Work("tiles", (64, 64), loop_ops=5))
    order = builtin_order(registry.registered_names())
    assert order.index("fused_one") < order.index("tiled") and order.index("loopy") > order.index("sliding_window")
    with pytest.raises(TypeError, match="work must be a Work"):
        register_backend(type("Bad", (Backend,), {"name": "bad_work", "work": {"skips": "tiles"}}))
    with pytest.raises(ValueError, match="Work.skips"):
        Work("everything")
    with pytest.raises(ValueError, match="Work.gqa"):
        Work(gqa="expands")


@pytest.mark.usefixtures("scratch_registry")
def test_the_probe_leaves_out_a_backend_that_fails_while_timed():
    # the probe times every backend's calls in rounds: one that fails in a later round (here on its
    # third call of the layout reference) is ranked by none of its figures; the others keep theirs
    naive = attnkit.list_backends()["naive"]
    seen = {"layout": 0}

    def forward(cls, inp, options):
        if inp.mask is not None and inp.mask.block_layout() is not None and inp.Tq > 32:
            seen["layout"] += 1
            if seen["layout"] == 3:
                raise RuntimeError("fails on its third call")
        return naive.forward(inp, None)

    register_backend(type("Test_flaky", (Backend,), {"name": "flaky", "forward": classmethod(forward)}))
    constants = calibration.probe_constants()
    assert seen["layout"] >= 3
    for table in ("backend_seconds", "train_backend_seconds", "reference_seconds", "decode_small_seconds",
                  "decode_tiny_seconds", "half_reference_seconds"):
        assert "flaky" not in constants[table], table
    assert set(constants["reference_seconds"]["sdpa"]) == {"causal", "band", "layout", "decode"}
