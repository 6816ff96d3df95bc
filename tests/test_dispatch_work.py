"""How each backend computes is its own class data (``Backend.work``): the dispatcher's static order
reads it, so a new backend needs no dispatcher edit. The order is a pure function of the input and
the registry: the decode rule, then fused kernels (grouped K/V read in place before repeated), whole-
tensor PyTorch ops, Python tile loops, a backend that materializes this call's mask after all that
read its structure, registration order breaking ties, and the memory guard last."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, SlidingWindow, registry
from attnkit.dispatch import DECODE_QUERIES, MATERIALIZE_LIMIT, builtin_order, priority
from attnkit.inputs import AttentionInputs
from attnkit.registry import Backend, Work, register_backend


@pytest.fixture
def scratch_registry(monkeypatch):
    """Register test backends into a copy of the registry (restored afterwards)."""
    attnkit.list_backends()
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_NAMES", [tuple(registry._REGISTRY)])
    yield


def _naive_like(name: str, work: Work | None = None, **attrs) -> type[Backend]:
    naive = attnkit.list_backends()["naive"]
    attrs = {"name": name, "forward": classmethod(lambda cls, inp, options: naive.forward(inp, None)), **attrs}
    if work is not None:
        attrs["work"] = work
    return register_backend(type(f"Test_{name}", (Backend,), attrs))


def _meta(B, H, Tq, D, mask=None, Tk=None, grad=False):
    x = torch.empty(B, H, Tq, D, device="meta", requires_grad=grad)
    y = torch.empty(B, H, Tk or Tq, D, device="meta")
    return AttentionInputs.create(x, y, y, mask=mask)


def _among(order, *names):
    return [n for n in order if n in names]


def _materializes(impl: type[Backend], inp: AttentionInputs) -> int:
    """Mask elements ``impl`` builds for ``inp``, as its declarations say (0: it reads the structure)."""
    if inp.mask is None:
        return 0
    elements = impl.dense_mask_elements(inp)
    return max(elements, inp.B * inp.Hq * inp.Tq * inp.Tk) if impl.work.materializes else elements


def _static_key(impl: type[Backend], inp: AttentionInputs) -> tuple[bool, bool, bool, bool]:
    """The static order's key as the rule states it (smaller first)."""
    work = impl.work
    return (_materializes(impl, inp) > 0, work.loop_ops > 0, not work.fused, work.gqa == "repeats")


def _code_strings(module) -> set[str]:
    """The string literals of ``module``'s code (docstrings left out)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    docs = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs}


def test_every_builtin_backend_declares_its_work_and_the_dispatcher_names_none():
    import inspect

    from attnkit import dispatch

    fields = {f.name for f in dataclasses.fields(Work)}
    assert fields == {"fused", "loop_ops", "materializes", "gqa"}
    for name, impl in attnkit.list_backends().items():
        assert isinstance(impl.work, Work), name
        assert set(impl.capabilities()["work"]) == fields, name
    for module in (dispatch.rule, dispatch.calls, dispatch.explain, dispatch.table, dispatch.tuning):
        # no backend table in the dispatcher: names only in prose (naive, the reference, always last)
        named = _code_strings(module) & set(attnkit.list_backends())
        assert named <= {"naive"}, (module.__name__, named)
        source = inspect.getsource(module)
        assert "Work(" not in source and "WORK" not in source, module.__name__


@pytest.mark.parametrize("mask", [None, Causal(), SlidingWindow(100, 0), KeyPadding([400])])
def test_builtin_order_follows_the_declared_work(mask):
    inp = _meta(1, 2, 512, 16, mask)
    order = builtin_order(inp)
    known = attnkit.list_backends()
    keys = [_static_key(known[n], inp) for n in order]
    assert keys == sorted(keys)  # fused, in place, whole-tensor ops, loops; materializing last
    assert all(known[n].exact for n in order) and "naive" not in order
    if mask is None or mask.is_causal():  # SDPA reads these (no mask, or its is_causal path)
        assert order.index("sdpa") < order.index("tiled")
    else:  # it would materialize them
        assert order.index("tiled") < order.index("sdpa")
    assert set(order) == {n for n, impl in known.items() if impl.exact and n != "naive"}
    registered = [n for n in registry.registered_names() if n in order]
    for a, b in zip(order, order[1:]):  # equal keys keep registration order
        if keys[order.index(a)] == keys[order.index(b)]:
            assert registered.index(a) < registered.index(b), (a, b)
    assert priority(inp)[-1] == "naive" and priority(inp)[:len(order)] == order


def test_the_order_is_the_same_in_every_call_and_reads_no_clock(monkeypatch):
    import time

    inp = _meta(2, 4, 300, 32, Causal() & SlidingWindow(40, 0))
    first = priority(inp)
    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("the rule timed something"))
    assert all(priority(inp) == first for _ in range(3))


def test_a_new_backend_without_declared_work_ranks_after_fused_kernels_and_before_loops(scratch_registry):
    _naive_like("plain")  # declares nothing: the default Work (PyTorch ops over whole tensors)
    assert registry.get_backend("plain").work == Work()
    inp = _meta(1, 2, 300, 16, Causal())
    order = priority(inp)
    assert order.index("sdpa") < order.index("plain") < order.index("tiled")
    # registered last among whole-tensor backends: after the built-in ones of its kind
    assert order.index("sliding_window") < order.index("plain")


def test_declared_work_places_a_new_backend_in_the_static_order(scratch_registry):
    _naive_like("fused_one", Work(fused=True))
    _naive_like("loopy", Work(loop_ops=5))
    inp = _meta(1, 2, 300, 16, Causal())
    order = builtin_order(inp)
    # a fused kernel reading grouped K/V in place: before SDPA (which repeats them), after the
    # built-in fused kernels registered before it; a tile loop: after the whole-tensor backends
    assert order.index("native") < order.index("fused_one") < order.index("sdpa") < order.index("tiled")
    assert order.index("tiled") < order.index("loopy")  # loop_ops 5 and 12: registration breaks the tie
    with pytest.raises(TypeError, match="work must be a Work"):
        register_backend(type("Bad", (Backend,), {"name": "bad_work", "work": {"fused": True}}))
    with pytest.raises(ValueError, match="Work.gqa"):
        Work(gqa="expands")
    with pytest.raises(ValueError, match="Work.loop_ops"):
        Work(loop_ops=-1)


def test_among_fused_kernels_reading_grouped_heads_in_place_comes_first(scratch_registry):
    _naive_like("repeater", Work(fused=True, gqa="repeats"))
    _naive_like("in_place", Work(fused=True))
    order = builtin_order(_meta(1, 2, 64, 16))
    assert _among(order, "repeater", "in_place", "tiled") == ["in_place", "repeater", "tiled"]


def _register_pair() -> None:
    """Two fused test backends: ``builds`` (registered first) materializes any mask but the causal
    one (as SDPA does), ``reads`` reads the mask's structure."""
    _naive_like("builds", Work(fused=True), dense_mask_elements=classmethod(
        lambda cls, inp: 0 if inp.mask is None or inp.mask.is_causal() else inp.B * inp.Hq * inp.Tq * inp.Tk))
    _naive_like("reads", Work(fused=True))


def test_a_backend_that_would_materialize_this_mask_ranks_after_those_that_read_it(scratch_registry):
    _register_pair()
    for mask, first in ((None, "builds"), (Causal(), "builds"), (SlidingWindow(100, 0), "reads"),
                        (KeyPadding([400]), "reads")):
        order = priority(_meta(1, 2, 512, 16, mask))
        assert _among(order, "builds", "reads")[0] == first, mask
    window = priority(_meta(1, 2, 512, 16, SlidingWindow(100, 0)))
    assert window.index("tiled") < window.index("builds")  # after every backend that reads the mask


def test_a_backend_that_materializes_every_mask_is_ordered_by_that_declaration(scratch_registry):
    _naive_like("always_dense", Work(fused=True, materializes=True))
    assert _among(priority(_meta(1, 2, 64, 16)), "always_dense", "sdpa") == ["always_dense", "sdpa"]  # no mask
    causal = priority(_meta(1, 2, 64, 16, Causal()))
    assert causal.index("tiled") < causal.index("always_dense")


def test_the_memory_guard_puts_a_large_materialized_mask_last(scratch_registry):
    # SDPA materializes a key-padding mask per head; `batch_mask` a tile loop that builds one
    # (Tq, Tk) mask per batch row: by the static order SDPA (fused) comes first, but over
    # MATERIALIZE_LIMIT elements SDPA goes after every backend that stays under it
    _naive_like("batch_mask", Work(loop_ops=3),
                dense_mask_elements=classmethod(lambda cls, inp: 0 if inp.mask is None else inp.B * inp.Tq * inp.Tk))
    small = _meta(1, 8, 512, 64, KeyPadding([400]))
    assert 8 * 512 * 512 <= MATERIALIZE_LIMIT
    assert _among(priority(small), "sdpa", "batch_mask") == ["sdpa", "batch_mask"]
    T = 4096
    big = _meta(1, 8, T, 64, KeyPadding([4000]))
    assert T * T <= MATERIALIZE_LIMIT < 8 * T * T
    order = priority(big)
    assert order.index("tiled") < order.index("batch_mask") < order.index("sdpa") and order[-1] == "naive"
    known = attnkit.list_backends()
    heavy = [n for n in order if n != "naive" and _materializes(known[n], big) > MATERIALIZE_LIMIT]
    assert "sdpa" in heavy and "batch_mask" not in heavy
    exact = [n for n in order if known[n].exact and n != "naive"]
    assert exact[-len(heavy):] == heavy


class _Stepper(Backend):
    """A test backend with a kernel for decoding steps."""
    name = "stepper"

    @classmethod
    def decodes(cls, inp):
        return True

    @classmethod
    def forward(cls, inp, options):
        return attnkit.list_backends()["naive"].forward(inp, None)


@pytest.mark.parametrize("Tq, Tk, grad, decoding", [
    (1, 300, False, True), (DECODE_QUERIES, 300, False, True), (DECODE_QUERIES, DECODE_QUERIES, False, True),
    (DECODE_QUERIES + 1, 300, False, False),  # more queries: a prefill chunk
    (1, 300, True, False),  # training: not an inference step
    (8, 4, False, False),  # fewer keys than queries
])
def test_the_decode_rule_puts_a_decode_kernel_first_for_a_decoding_step(scratch_registry, Tq, Tk, grad, decoding):
    register_backend(_Stepper)
    inp = _meta(1, 2, Tq, 16, Causal() if Tk >= Tq else None, Tk=Tk, grad=grad)
    order = builtin_order(inp)
    assert (order[0] == "stepper") is decoding, order
    if not decoding:  # the static order: a backend of the default Work after the fused kernels
        assert order.index("native") < order.index("stepper") < order.index("tiled")


def test_the_decode_rule_keeps_the_work_order_among_decode_kernels_and_the_memory_guard_applies(scratch_registry):
    register_backend(_Stepper)
    _naive_like("fused_stepper", Work(fused=True), decodes=classmethod(lambda cls, inp: True))
    step = _meta(1, 2, 1, 16, KeyPadding([3000]), Tk=4096)
    assert _among(builtin_order(step), "stepper", "fused_stepper", "sdpa") == ["fused_stepper", "stepper", "sdpa"]
    # a decoding step over a huge cache: the decode kernels first, SDPA (which would materialize the
    # padding mask, past MATERIALIZE_LIMIT) after every backend within the limit
    huge = _meta(64, 32, 1, 16, KeyPadding([3000] * 64), Tk=2**16)
    assert 64 * 32 * 2**16 > MATERIALIZE_LIMIT
    order = builtin_order(huge)
    assert order[:2] == ("fused_stepper", "stepper") and order.index("tiled") < order.index("sdpa")
