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
                  "decode_tiny_seconds", "half_reference_seconds", "train_reference_seconds"):
        assert "flaky" not in constants[table], table
    assert set(constants["reference_seconds"]["sdpa"]) == {"causal", "band", "layout", "decode"}
    assert "sdpa" in constants["train_reference_seconds"]  # its forward and backward on the causal reference


@pytest.mark.usefixtures("scratch_registry")
def test_the_probe_times_a_fused_kernel_in_its_steady_state():
    """A fused kernel's reference calls are timed in bursts, the first call of each left out: a kernel
    that runs slower right after other backends' calls (its memory out of the caches) is priced at
    the speed a loop of its calls runs at, not ranked by that first call."""
    import time

    naive = attnkit.list_backends()["naive"]
    last = [None]

    def forward(cls, inp, options):
        if last[0] is not inp:  # the first of a run of calls on this input: cold
            time.sleep(0.02)
        last[0] = inp
        return naive.forward(inp, None)

    register_backend(type("Test_cold_first", (Backend,), {
        "name": "cold_first", "forward": classmethod(forward), "work": Work("nothing", fused=True)}))
    constants = calibration.probe_constants()
    assert max(constants["reference_seconds"]["cold_first"].values()) < 0.02


def _fused_pair(constants: dict, structure_s: float, materializing_s: float) -> dict:
    """Two fused test backends on every reference problem: ``reads`` reads the mask's structure,
    ``builds`` materializes any mask but the causal one (as SDPA does)."""
    for name, seconds in (("reads", structure_s), ("builds", materializing_s)):
        constants["backend_seconds"][name] = 1e-6
        constants["train_backend_seconds"][name] = 3e-6
        constants["reference_seconds"][name] = {c: seconds for c in ("causal", "band", "layout", "decode")}
    return constants


def _register_pair() -> None:
    _naive_like("builds", Work("nothing", fused=True))
    reads = _naive_like("reads", Work("tiles", (64, 64), fused=True))
    builds = registry.get_backend("builds")
    builds.dense_mask_elements = classmethod(
        lambda cls, inp: 0 if inp.mask is None or inp.mask.is_causal() else inp.B * inp.Hq * inp.Tq * inp.Tk)
    assert builtin_order(registry.registered_names()).index("builds") < builtin_order(
        registry.registered_names()).index("reads")  # registered first: first among fused kernels
    return reads


def test_a_backend_that_would_materialize_this_mask_ranks_after_those_that_read_it(scratch_registry, monkeypatch):
    _register_pair()
    x = torch.empty(1, 2, 512, 16, device="meta")
    window = AttentionInputs.create(x, x, x, mask=attnkit.SlidingWindow(100, 0))
    plain = AttentionInputs.create(x, x, x)

    def install(builds_s: float) -> dict:
        constants = _fused_pair(uniform_constants(), 4e-3, builds_s)
        monkeypatch.setattr(calibration, "_CONSTANTS", [constants])
        calibration._GENERATION[0] += 1
        return constants

    def estimates(inp, constants) -> dict:
        return {n: dispatch.estimated_seconds(n, inp, constants) for n in ("reads", "builds")}

    def builds_time_for(inp, speedup: float) -> float:
        """The reference time of `builds` at which it is estimated ``speedup`` times faster on ``inp``
        (the estimate is affine in the reference time)."""
        lo, hi = (estimates(inp, _fused_pair(uniform_constants(), 4e-3, t))["builds"] for t in (1e-3, 2e-3))
        reads = estimates(inp, _fused_pair(uniform_constants(), 4e-3, 1e-3))["reads"]
        return 1e-3 + (reads / speedup - lo) / (hi - lo) * 1e-3

    # `builds` would materialize the window: estimated 1.15x faster, less than MODEL_MARGIN: `reads` stays first
    est = estimates(window, install(builds_time_for(window, 1.15)))
    assert est["reads"] / est["builds"] == pytest.approx(1.15, rel=1e-3)
    assert [n for n in priority(window) if n in ("reads", "builds")] == ["reads", "builds"]
    # estimated 2x faster: past the margin, it goes first
    install(builds_time_for(window, 2.0))
    assert [n for n in priority(window) if n in ("reads", "builds")] == ["builds", "reads"]
    # no mask: two fused kernels of one kind, where a 1.15x estimate decides
    est = estimates(plain, install(builds_time_for(plain, 1.15)))
    assert est["reads"] / est["builds"] == pytest.approx(1.15, rel=1e-3)
    assert [n for n in priority(plain) if n in ("reads", "builds")] == ["builds", "reads"]


def test_a_layout_that_keeps_every_block_is_priced_as_no_mask_unless_materialized(scratch_registry):
    _register_pair()
    constants = _fused_pair(uniform_constants(), 4e-3, 4e-3)
    constants["reference_seconds"]["reads"]["layout"] = 8e-3  # half the causal rate on a sparse layout
    constants["reference_seconds"]["builds"]["layout"] = 8e-3
    x = torch.empty(1, 8, 256, 64, device="meta")
    full = attnkit.BlockSparse(torch.ones(4, 4, dtype=torch.bool), 64)
    sparse = attnkit.BlockSparse(torch.eye(4, dtype=torch.bool), 64)
    none = AttentionInputs.create(x, x, x)
    est = {m: {n: dispatch.estimated_seconds(n, AttentionInputs.create(x, x, x, mask=mask), constants)
               for n in ("reads", "builds")} for m, mask in (("full", full), ("sparse", sparse))}
    no_mask = dispatch.estimated_seconds("reads", none, constants)
    assert est["full"]["reads"] == pytest.approx(no_mask)  # every tile whole: the rate with no mask
    # it materializes the layout: a masked call, at the layout reference's rate, plus the mask's traffic
    assert est["full"]["builds"] > 1.9 * dispatch.estimated_seconds("builds", none, constants)
    # a sparse layout keeps the layout reference's rate, over the blocks it keeps
    assert est["sparse"]["reads"] == pytest.approx(2 * no_mask / 4, rel=0.05)
