"""The mask structure API is sound, masks see the call's batch and heads, and backends agree.

Structural answers (``band``, ``block_layout``, ``is_causal``, ``query_independent``,
``conjuncts``, ``split_globals``, batch/head dependence) are checked against the materialized keep
over random mask trees; ``Custom`` masks that read ``b`` and ``h`` are checked on every exact
backend that accepts them; a padded model forward materializes its mask once.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit.inputs import AttentionInputs
from attnkit import (
    BlockSparse, Causal, Custom, Dense, Document, GlobalTokens, KeyPadding, MaskSupport, Padding, SlidingWindow,
    longformer,
)
from attnkit.dispatch import table
from attnkit.masks import base as mask_base
from attnkit.registry import list_backends

from .reference import reference_attention
from .inputs import qkv

T, B, H = 24, 2, 2
_gen = torch.Generator().manual_seed(0)
VALID = torch.rand(B, T, generator=_gen) > 0.3
IDS = torch.tensor([[0] * 7 + [1] * 9 + [2] * 8, [0] * 12 + [1] * 12])
PER_KEY = torch.rand(B, 1, 1, T, generator=_gen) > 0.2
PER_HEAD = torch.rand(1, H, T, T, generator=_gen) > 0.4
HEAD_LAYOUT = torch.rand(H, T // 4, T // 4, generator=_gen) > 0.5

LEAVES = {
    "causal": lambda: Causal(),
    "window": lambda: SlidingWindow(3, 1),
    "window_left": lambda: SlidingWindow(None, 2),
    "window_right": lambda: SlidingWindow(2, None),
    "causal_window": lambda: SlidingWindow(None, 0),
    "padding": lambda: KeyPadding([7, 20]),
    "padding_b1": lambda: KeyPadding([15]),
    "holes": lambda: Padding(VALID),
    "holes_b1": lambda: Padding(VALID[:1]),
    "document": lambda: Document(IDS),
    "dense_key": lambda: Dense(PER_KEY),
    "dense_head": lambda: Dense(PER_HEAD),
    "bigbird": lambda: BlockSparse.bigbird(T // 4, 4, seed=1),
    "layout_head": lambda: BlockSparse(HEAD_LAYOUT, 4),
    "globals": lambda: GlobalTokens([0, 9]),
    "custom_bh": lambda: Custom(lambda b, h, q, k: (q + k + b + 2 * h) % 3 != 0, name="bh"),
}


@st.composite
def mask_trees(draw, depth=3):
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return LEAVES[draw(st.sampled_from(sorted(LEAVES)))]()
    parts = [draw(mask_trees(depth=depth - 1)) for _ in range(draw(st.integers(2, 3)))]
    out = parts[0]
    for p in parts[1:]:
        out = out & p if draw(st.booleans()) else out | p
    return out


def keep_of(mask):
    return mask.materialize(T, T, q_offset=0, kv_offset=0, batch_size=B, num_heads=H).expand(B, H, T, T)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mask=mask_trees())
def test_structure_answers_are_sound(mask):
    keep = keep_of(mask)
    pairs = keep.nonzero()  # (n, 4): b, h, q, k
    diff = pairs[:, 3] - pairs[:, 2]
    band = mask.band()
    if band.left is not None:
        assert (diff >= -band.left).all(), (mask, band)
    if band.right is not None:
        assert (diff <= band.right).all(), (mask, band)
    layout = mask.block_layout()
    if layout is not None:
        assert layout in mask.conjuncts()
        assert not (keep & ~keep_of(layout)).any(), mask  # nothing kept outside the layout
    if mask.is_causal():
        assert torch.equal(keep, keep_of(Causal())), mask
    if mask.query_independent:
        assert torch.equal(keep, keep[:, :, :1].expand_as(keep)), mask
    if not mask.depends_on_batch:
        assert torch.equal(keep[0], keep[1]), mask
    if not mask.depends_on_head:
        assert torch.equal(keep[:, 0], keep[:, 1]), mask
    conj = keep_of(mask.conjuncts()[0])
    for part in mask.conjuncts()[1:]:
        conj = conj & keep_of(part)
    assert torch.equal(conj, keep), mask
    core, glob = mask.split_globals()
    if glob is not None:
        assert isinstance(glob, GlobalTokens) and torch.equal(keep_of(core) | keep_of(glob), keep), mask
    assert all("(" not in leaf.structure_key() for leaf in mask.leaves())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mask=mask_trees(), q0=st.integers(0, T - 1), k0=st.integers(0, T - 1), n=st.integers(1, 9), m=st.integers(1, 9))
def test_block_status_is_sound_over_every_batch_and_head(mask, q0, k0, n, m):
    """FULL: every pair of the tile kept for every b and h; EMPTY: none (PARTIAL is always allowed)."""
    q_range, kv_range = (q0, min(q0 + n, T)), (k0, min(k0 + m, T))
    sizes = dict(q_offset=0, kv_offset=0, batch_size=B, num_heads=H)
    status = mask.block_status(q_range, kv_range, **sizes)
    keep = mask.evaluate(q_range, kv_range, **sizes)
    assert status is not attnkit.BlockStatus.FULL or keep.all(), mask
    assert status is not attnkit.BlockStatus.EMPTY or not keep.any(), mask


_G = torch.Generator().manual_seed(1)
Q, K, V = (torch.randn(B, H, T, 8, generator=_G), torch.randn(B, 1, T, 8, generator=_G),
           torch.randn(B, 1, T, 8, generator=_G))


@st.composite
def structured_trees(draw):
    """Mask trees that the structured backends can often take: ``& SlidingWindow(l, r)`` (a band,
    sometimes ``| GlobalTokens``) or ``& BlockSparse`` around a random tree."""
    tree = draw(mask_trees(depth=2))
    kind = draw(st.sampled_from(["band", "band_globals", "layout", "plain"]))
    if kind.startswith("band"):
        tree = tree & SlidingWindow(draw(st.integers(0, 6)), draw(st.integers(0, 3)))
        return (tree | GlobalTokens(draw(st.lists(st.integers(0, T - 1), max_size=3))) if kind == "band_globals"
                else tree)
    if kind == "layout":
        return tree & BlockSparse.bigbird(T // 4, 4, seed=draw(st.integers(0, 3)), random_blocks=1)
    return tree


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mask=structured_trees())
def test_every_exact_backend_that_accepts_a_mask_computes_it(mask):
    """A backend's declared mask support is honest: whatever it accepts, it computes exactly."""
    ref, _ = reference_attention(Q, K, V, mask=mask, q_offset=0)
    explained = attnkit.explain(Q, K, V, mask=mask, q_offset=0).reasons
    for name, impl in list_backends().items():
        if not impl.exact or explained.get(name):
            continue
        assert impl.mask_support.accepts(mask)
        out = attnkit.attention(Q, K, V, mask=mask, q_offset=0, backend=name)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5, msg=lambda m: f"{name} {mask!r}: {m}")


def test_structure_of_known_masks():
    assert (Causal() & Causal()).is_causal() and (Causal() & SlidingWindow(None, 0)).is_causal()
    assert not (Causal() & KeyPadding([3])).is_causal()
    assert (SlidingWindow(4, 0) & Causal()).band().bounded and not (Causal() & KeyPadding([3])).band().bounded
    assert (SlidingWindow(4, 2) & Causal()).band() == attnkit.Band(4, 0)
    core, glob = longformer(3, [0]).split_globals()
    assert core == SlidingWindow(3, 3) and glob.positions.tolist() == [0]
    core, glob = (SlidingWindow(2, 2) | GlobalTokens([5]) | GlobalTokens([0, 5])).split_globals()
    assert core == SlidingWindow(2, 2) and glob.positions.tolist() == [0, 5]
    causal_lf = longformer(3, [0], causal=True)
    assert causal_lf.split_globals()[1] is None and not causal_lf.band().bounded  # global keys far left
    assert (KeyPadding([3]) & Padding(VALID)).query_independent and not (KeyPadding([3]) & Causal()).query_independent
    assert Custom(lambda b, h, q, k: q >= k).depends_on_batch and (
        Causal() & Custom(lambda b, h, q, k: q >= k)).depends_on_head


def test_structure_key_tells_combinations_apart_for_the_measured_table():
    kinds = {table.mask_kind(m) for m in (
        None, Causal(), Causal() & KeyPadding([3]), Causal() & Document(IDS), KeyPadding([3]) & Causal(),
        SlidingWindow(4, 0) | GlobalTokens([0]),
    )}
    assert kinds == {"none", "Causal", "And(Causal,KeyPadding)", "And(Causal,Document)",
                     "Or(GlobalTokens,SlidingWindow)"}


# -- Custom masks see every b and h (FlexAttention's contract) ------------------------------------------------
def _qkv(Bq=3, Hq=4, Hkv=2, Tq=16, Tk=16, D=8, seed=0):
    return qkv(Bq, Hq, Hkv, Tq, Tk, D, seed=seed)


LENGTHS = torch.tensor([5, 16, 11])
CUSTOM_CASES = {
    # name: (mask, equivalent mask without Custom, or None)
    "per_batch": (Custom(lambda b, h, q, k: k < LENGTHS[b]), KeyPadding(LENGTHS)),
    "per_batch_causal": (Causal() & Custom(lambda b, h, q, k: k < LENGTHS[b]), Causal() & KeyPadding(LENGTHS)),
    "per_head": (Custom(lambda b, h, q, k: (k <= q) | (h % 2 == 1)), None),
    "per_head_window": (SlidingWindow(3, 2) & Custom(lambda b, h, q, k: (q + k + h + b) % 3 != 0), None),
    "per_head_layout": (BlockSparse.bigbird(4, 4, seed=2) & Custom(lambda b, h, q, k: (k + h) % 2 == 0), None),
}


def _exact_cases():
    """(backend, case) for every exact backend whose declared mask support accepts the case."""
    x = torch.zeros(1, 1, 4, 8)
    runs_here = lambda impl: impl.can_run(AttentionInputs.create(x, x, x))  # noqa: E731 (built, not opt-in here)
    return [(name, case) for name, impl in list_backends().items() if impl.exact and runs_here(impl)
            for case, (mask, _) in sorted(CUSTOM_CASES.items()) if impl.mask_support.accepts(mask)]


@pytest.mark.parametrize("backend, case", _exact_cases())
def test_custom_masks_use_every_batch_and_head(backend, case):
    """Regression: Custom masks used to be evaluated at b = 0, h = 0 only and broadcast."""
    mask, same = CUSTOM_CASES[case]
    q, k, v = _qkv()
    out = attnkit.attention(q, k, v, mask=mask, backend=backend)
    ref, _ = reference_attention(q, k, v, mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    if same is not None:
        torch.testing.assert_close(out, attnkit.attention(q, k, v, mask=same, backend=backend), atol=2e-5, rtol=1e-5)
    b0 = Custom(lambda b, h, q, k: mask.mask_mod(b * 0, h * 0, q, k))  # what the old evaluation computed
    assert not torch.allclose(out, attnkit.attention(q, k, v, mask=b0, backend="naive"), atol=1e-3)


def test_custom_mask_without_the_call_sizes_is_refused():
    with pytest.raises(ValueError, match=r"batch_size=None: .* may depend on the batch index b"):
        Custom(lambda b, h, q, k: q >= k).materialize(4, 4)
    keep = Custom(lambda b, h, q, k: k <= b + h).materialize(1, 4, batch_size=2, num_heads=3)
    assert keep.shape == (2, 3, 1, 4) and keep[1, 2, 0].tolist() == [True, True, True, True]
    empty = torch.randn(0, 2, 4, 8)  # an empty batch stays valid
    for backend in ("naive", "sdpa", "tiled"):
        out = attnkit.attention(empty, empty, empty, mask=Causal() & Custom(lambda b, h, q, k: q >= k), backend=backend)
        assert out.shape == (0, 2, 4, 8)


@pytest.mark.parametrize("backend", ["naive", "sdpa", "tiled"])
def test_batch_one_padding_broadcasts_inside_an_and_with_a_per_batch_mask(backend):
    """Regression: KeyPadding/Padding of batch 1 indexed b = 1 and raised IndexError."""
    q, k, v = _qkv(Bq=2)
    for single in (KeyPadding([9]), Padding(torch.arange(16)[None] < 9)):
        mask = single & Document(torch.tensor([[0] * 6 + [1] * 10, [0] * 10 + [1] * 6]))
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
        torch.testing.assert_close(out.double(), reference_attention(q, k, v, mask=mask)[0], atol=2e-5, rtol=1e-5)


def test_lsh_honours_a_repeated_causal_mask():
    """Regression: lsh read isinstance(mask, Causal), so Causal() & Causal() ran non-causally."""
    q, _, v = _qkv(Bq=1, Hq=2, Hkv=2, Tq=32, Tk=32)
    opts = attnkit.backends.lsh.LSHOptions(n_hashes=2, bucket_size=8, seed=0)
    twice = attnkit.attention(q, q, v, mask=Causal() & Causal(), backend="lsh", options=opts)
    once = attnkit.attention(q, q, v, mask=Causal(), backend="lsh", options=opts)
    free = attnkit.attention(q, q, v, backend="lsh", options=opts)
    assert torch.equal(twice, once) and not torch.allclose(twice, free)


# -- declared mask support: the capability table and the reasons say the same ------------------------------
def test_declared_mask_support_is_what_capabilities_print_and_reasons_name():
    q = torch.randn(1, 2, 8, 4)
    for name, impl in list_backends().items():
        assert isinstance(impl.mask_support, MaskSupport)
        printed = impl.capabilities()["masks"]
        assert printed == str(impl.mask_support)
        for mask in (None, Causal(), Causal() & KeyPadding([5]), SlidingWindow(2, 0), BlockSparse.bigbird(2, 4)):
            reasons = attnkit.explain(q, q, q, mask=mask, backend=name).reasons.get(name) or []
            declined = any(printed in r for r in reasons)
            assert declined == (not impl.mask_support.accepts(mask)), (name, mask, reasons)
    assert list_backends()["sliding_window"].capabilities()["masks"] == "banded"
    assert list_backends()["block_sparse"].capabilities()["masks"] == "BlockSparse layout"
    assert list_backends()["linear"].capabilities()["masks"] == "no mask or per-key"


def test_registering_a_backend_with_the_old_mask_kinds_is_refused():
    from attnkit.registry import Backend, register_backend

    class OldStyle(Backend):
        name = "old_style_mask_kinds"
        mask_kinds = frozenset({Causal})

    with pytest.raises(TypeError, match="mask_kinds is no longer read"):
        register_backend(OldStyle)
    OldStyle.mask_support = "causal"
    del OldStyle.mask_kinds
    with pytest.raises(TypeError, match="must be a MaskSupport"):
        register_backend(OldStyle)
    assert "old_style_mask_kinds" not in list_backends()


def test_mask_support_rejects_unknown_forms():
    with pytest.raises(ValueError, match="unknown or missing form"):
        MaskSupport("banded")
    assert MaskSupport("none", "causal").accepts(Causal() & Causal()) and not MaskSupport("causal").accepts(None)


# -- a model forward prepares its mask once ------------------------------------------------------------------
def test_padded_gpt_forward_materializes_its_mask_once(monkeypatch):
    """Every layer reuses the forward's mask: one evaluation per forward, not one per layer (with a
    backend that materializes it: SDPA)."""
    from attnkit.nn import GPT, TransformerConfig

    model = GPT(TransformerConfig(vocab_size=32, max_len=16, embed_dim=16, num_layers=6, num_heads=2,
                                  backend="sdpa")).eval()
    ids = torch.randint(0, 32, (2, 9))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, 6:] = 0
    calls = []
    original = mask_base.Mask.evaluate

    def counting(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(mask_base.Mask, "evaluate", counting)
    with torch.no_grad():
        out = model(ids, attention_mask=attention_mask)
        assert calls == ["And"], calls
        again = model(ids, attention_mask=attention_mask)  # a new forward builds (and prepares) a new mask
    assert calls == ["And", "And"] and torch.equal(out, again)


def test_materialize_cache_is_keyed_and_bounded():
    mask = Causal() & KeyPadding([3, 5])
    a = mask.materialize(4, 6)
    assert mask.materialize(4, 6) is a  # same call: the prepared tensor
    b = mask.materialize(4, 6, q_offset=0)
    c = mask.materialize(2, 6)
    assert not torch.equal(a, b) and c.shape[-2] == 2
    assert mask.materialize(2, 6) is c and mask.materialize(4, 6, q_offset=0) is b
    assert mask.materialize(4, 6) is not a and torch.equal(mask.materialize(4, 6), a)  # evicted: two entries kept
    with torch.inference_mode():
        d = mask.materialize(2, 6)
    assert d is not c and torch.equal(d, c)  # inference tensors are never handed to autograd code


def test_materialize_cache_does_not_pin_large_tensors(monkeypatch):
    monkeypatch.setattr(mask_base, "_CACHE_BYTES", 100)
    mask = Causal() & KeyPadding([3, 5])
    small, large = mask.materialize(4, 6), mask.materialize(16, 16)
    assert mask.materialize(4, 6) is small and mask.materialize(16, 16) is not large
