"""Declared capabilities agree with what forward computes.

Over hypothesis-generated calls whose masks are random trees of every mask kind (``Causal``,
``SlidingWindow``, ``KeyPadding``, ``Padding``, ``Document``, ``Dense``, ``Custom``, ``BlockSparse``,
``GlobalTokens``, nested ``And``/``Or``, duplicates such as ``Causal() & Causal()``), every
registered backend that reports no reasons must compute the right thing: exact backends the float64
reference (flash-attn's 2x/3x rule, float64 inputs), approximate ones their own naive twin
(``linear``/``performer``: the masked quadratic form of their features; ``lsh`` with one bucket: exact
attention under Reformer's self-exclusion rule). And ``select()`` picks what ``explain()`` reports.

The strategies here are shared with ``test_properties_fuzz.py``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import Causal, Custom, Dense, Document, KeyPadding, Padding, SlidingWindow
from attnkit.backends import lsh
from attnkit.dispatch import select
from attnkit.inputs import AttentionInputs
from attnkit.masks import BlockSparse, GlobalTokens
from attnkit.score_mods import CustomScoreMod

from .reference import DEVICE, device_unavailable, flash_rule_ok, keep_grid, max_error, reference_attention

if device_unavailable():
    pytest.skip(device_unavailable(), allow_module_level=True)

BACKENDS = list(attnkit.list_backends())

# Behaviour not fixed yet, in one place: name -> predicate(backend, mask, keep). Checks matching one
# are not asserted by the property tests; each has a strict-xfail test below that fails loudly once
# the behaviour is fixed (then drop the entry).
KNOWN_WRONG: dict = {}


def known_wrong(backend: str, mask, keep) -> str | None:
    return next((name for name, pred in KNOWN_WRONG.items() if pred(backend, mask, keep)), None)


# -- strategies -------------------------------------------------------------------------------------
@st.composite
def calls(draw, *, max_len=12, max_batch=2, max_kv_heads=2, max_groups=2, max_dim=16, queries_first=False):
    """A call's sizes and positions: ``dict(B, Hq, Hkv, Tq, Tk, D, Dv, q_offset, kv_offset, end)``;
    ``end`` is one past the last absolute position (what position-indexed masks must cover). Half
    of the calls are self-attention (Tq == Tk, equal offsets), which ``lsh`` needs.
    ``queries_first``: the first query sits before the first key (``q_offset < kv_offset``): an
    explicit smaller ``q_offset``, or the bottom-right default with ``Tq > Tk``."""
    B = draw(st.integers(1, max_batch))
    Hkv = draw(st.integers(1, max_kv_heads))
    Hq = Hkv * draw(st.integers(1, max_groups))
    Tk = draw(st.integers(1, max_len))
    D = draw(st.integers(1, max_dim))
    Dv = draw(st.one_of(st.just(D), st.integers(1, max_dim)))
    kv_offset = draw(st.integers(0, 4))
    if queries_first:
        kv_offset = draw(st.integers(1, 6))
        if Tk < max_len and draw(st.booleans()):  # bottom-right with more queries than keys
            Tq, q_offset = draw(st.integers(Tk + 1, max_len)), None
        else:
            Tq, q_offset = draw(st.integers(1, max_len)), draw(st.integers(0, kv_offset - 1))
    elif draw(st.booleans()):
        Tq, q_offset = Tk, kv_offset
    else:
        Tq = draw(st.integers(1, max_len))
        q_offset = draw(st.one_of(st.none(), st.integers(0, 6)))
    q0 = kv_offset + Tk - Tq if q_offset is None else q_offset
    assert q0 < kv_offset or not queries_first
    end = max(q0 + Tq, kv_offset + Tk)
    return dict(B=B, Hq=Hq, Hkv=Hkv, Tq=Tq, Tk=Tk, D=D, Dv=Dv, q_offset=q_offset, kv_offset=kv_offset, end=end)


def _bools(draw, shape, p_true=0.7):
    seed = draw(st.integers(0, 2**16))
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < p_true


LEAF_KINDS = ["Causal", "CausalTwice", "SlidingWindow", "KeyPadding", "Padding", "Document", "Dense", "Custom",
              "BlockSparse", "GlobalTokens"]


@st.composite
def leaf_masks(draw, call, kind=None, *, custom_uses_batch_and_head=False):
    """One primitive mask valid for ``call`` (masks indexed by position cover ``0..end-1``)."""
    B, H, end = call["B"], call["Hq"], max(call["end"], 1)
    kind = draw(st.sampled_from(LEAF_KINDS) if kind is None else st.just(kind))
    side = st.one_of(st.none(), st.integers(0, 6))
    if kind == "Causal":
        return Causal()
    if kind == "CausalTwice":
        return Causal() & Causal()
    if kind == "SlidingWindow":
        return SlidingWindow(draw(side), draw(side))
    if kind == "KeyPadding":
        return KeyPadding(draw(st.lists(st.integers(0, end), min_size=B, max_size=B)))
    if kind == "Padding":
        return Padding(_bools(draw, (B, end)))
    if kind == "Document":
        cuts = _bools(draw, (B, end), p_true=0.25)
        return Document(cuts.long().cumsum(dim=1))
    if kind == "Dense":
        shape = (draw(st.sampled_from([1, B])), draw(st.sampled_from([1, H])),
                 draw(st.sampled_from([1, call["Tq"]])), call["Tk"])
        return Dense(_bools(draw, shape).to(DEVICE))
    if kind == "Custom":
        a, m = draw(st.integers(1, 3)), draw(st.integers(2, 4))
        if custom_uses_batch_and_head:
            return Custom(lambda b, h, q, k: (a * q + k + b + 2 * h) % m != 0, name=f"bh-mod{m}")
        return Custom(lambda b, h, q, k: (a * q + k) % m != 0, name=f"mod{m}")
    if kind == "BlockSparse":
        bs = draw(st.sampled_from([1, 2, 4]))
        n = -(-end // bs)
        layout = _bools(draw, (draw(st.sampled_from([1, H])), n, n), p_true=0.6)
        return BlockSparse(layout, bs)
    positions = draw(st.lists(st.integers(0, end - 1), min_size=0, max_size=3))
    return GlobalTokens(positions)


FAMILIES = ("tree", "banded", "layout", "longformer", "causal")
CAUSAL_SPELLINGS = [Causal() & Causal(), Causal(), Causal() & (Causal() | Causal()), SlidingWindow(None, 0),
                    Causal() | Causal()]


@st.composite
def mask_trees(draw, call, family="tree", depth=2, **leaf_kwargs):
    """A mask valid for ``call`` of a ``family``: ``tree``, None, a primitive or an And/Or tree of
    depth <= ``depth`` of primitives; shaped for the structured backends: ``banded`` (a finite
    window & a random tree), ``layout`` (a BlockSparse & a random tree), ``longformer`` (window |
    GlobalTokens); ``causal``: causal spelled several ways (what lsh and the kernelized backends take)."""
    if family == "causal":
        return draw(st.sampled_from(CAUSAL_SPELLINGS))
    if family != "tree":
        window = SlidingWindow(draw(st.integers(0, 5)), draw(st.integers(0, 5)))
        core = draw(leaf_masks(call, "BlockSparse")) if family == "layout" else window
        rest = draw(mask_trees(call, depth=1, **leaf_kwargs))
        core = core & rest if rest is not None and draw(st.booleans()) else core
        return core | draw(leaf_masks(call, "GlobalTokens")) if family == "longformer" else core
    if depth == 2 and draw(st.integers(0, 9)) == 0:
        return None
    if depth == 0 or draw(st.booleans()):
        return draw(leaf_masks(call, **leaf_kwargs))
    left = draw(mask_trees(call, depth=depth - 1, **leaf_kwargs))
    right = draw(mask_trees(call, depth=depth - 1, **leaf_kwargs))
    if left is None or right is None:
        return left if right is None else right
    return left & right if draw(st.booleans()) else left | right


def tensors(call, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(call["B"], call["Hq"], call["Tq"], call["D"], generator=g)
    k = torch.randn(call["B"], call["Hkv"], call["Tk"], call["D"], generator=g)
    v = torch.randn(call["B"], call["Hkv"], call["Tk"], call["Dv"], generator=g)
    do = torch.randn(call["B"], call["Hq"], call["Tq"], call["Dv"], generator=g)
    return [x.to(DEVICE, dtype) for x in (q, k, v)], do.to(DEVICE, dtype)


def positions(call) -> dict:
    return dict(q_offset=call["q_offset"], kv_offset=call["kv_offset"])


def grads_of(fn, qkv, do):
    """``(out, (dq, dk, dv))`` of ``fn(q, k, v)`` on fresh leaves."""
    leaves = [x.detach().clone().requires_grad_(True) for x in qkv]
    out = fn(*leaves)
    out.backward(do.to(out.dtype))
    return out.detach(), tuple(x.grad for x in leaves)


# -- the naive twins of the approximate backends, written here from their papers -------------------
def _expanded(k, v, Hq):
    return k.repeat_interleave(Hq // k.shape[1], 1), v.repeat_interleave(Hq // v.shape[1], 1)


def quadratic_twin(phi_q, phi_k, v, keep):
    """Kernelized attention's naive form: ``A = φ(Q) φ(K)ᵀ`` masked by ``keep``, rows normalized
    (rows that see nothing give 0), times ``V``."""
    a = torch.where(keep, phi_q @ phi_k.transpose(-2, -1), 0.0)  # (B, H, Tq, Tk)
    den = a.sum(-1, keepdim=True)
    return (a @ v) / torch.where(den == 0, 1.0, den)


def approximate_case(backend: str, call, mask, q, k, v):
    """``(options, twin_fn)``: options that make the backend deterministic and ``twin_fn(q, k, v)``,
    its naive twin on the same mask (evaluated by the test's own ``keep_grid``)."""
    keep = keep_grid(mask, call["B"], call["Hq"], call["Tq"], call["Tk"], device=q.device, **positions(call))
    scale = call["D"] ** -0.5
    Options = attnkit.get_backend(backend).Options
    if backend == "linear":  # φ(x) = elu(x) + 1 (Katharopoulos et al. 2020)
        def twin(q, k, v):
            k, v = _expanded(k, v, call["Hq"])
            phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
            return quadratic_twin(phi(q), phi(k), v, keep)
        return Options(chunk=3, segment=5), twin
    if backend == "performer":  # FAVOR+: φ(x) = exp(W x' - |x'|² / 2), x' = x · scale^½ (Choromanski et al. 2021)
        w = torch.randn(16, call["D"], generator=torch.Generator().manual_seed(0)).to(q.device, q.dtype)
        def twin(q, k, v):
            k, v = _expanded(k, v, call["Hq"])
            def phi(x):
                x = x * scale**0.5
                return torch.exp(x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True))
            return quadratic_twin(phi(q), phi(k), v, keep)
        return Options(projection=w, chunk=3, segment=5), twin
    if backend == "lsh":
        exclude = bool((call["Tq"] + call["B"]) % 2)
        opts = lsh.LSHOptions(n_hashes=1 + call["Tq"] % 2, n_buckets=1, bucket_size=call["Tq"], exclude_self=exclude)
        twin_keep = lsh.self_exclusion(keep) if exclude else keep
        return opts, lambda q, k, v: reference_attention(q, k, v, mask=Dense(twin_keep))[0].to(q.dtype)
    raise AssertionError(f"{backend} is approximate but has no naive twin here: add it to approximate_case")


# -- the checks ----------------------------------------------------------------------------------------
def check_backend(backend: str, call, mask, qkv, do, *, skip_known_wrong=True) -> bool:
    """Assert that ``backend``, if it reports no reasons for the call, computes the right result.
    Returns whether it ran (``skip_known_wrong``: not for the cases listed in ``KNOWN_WRONG``)."""
    kwargs = dict(mask=mask, **positions(call))
    impl = attnkit.get_backend(backend)
    if impl.not_supported_reasons(AttentionInputs.create(*qkv, **kwargs)):
        return False
    keep = keep_grid(mask, call["B"], call["Hq"], call["Tq"], call["Tk"], device=qkv[0].device, **positions(call))
    if skip_known_wrong and known_wrong(backend, mask, keep):
        return False
    if impl.exact:
        out, grads = grads_of(lambda q, k, v: attnkit.attention(q, k, v, backend=backend, **kwargs), qkv, do)
        ref, ref_grads = grads_of(lambda q, k, v: reference_attention(q, k, v, **kwargs)[0], qkv, do)
        dtype = qkv[0].dtype
        assert flash_rule_ok(max_error(out, ref), 0.0, factor=2, dtype=dtype), (backend, mask, max_error(out, ref))
        for name, g, rg in zip("qkv", grads, ref_grads):
            assert flash_rule_ok(max_error(g, rg), 0.0, factor=3, dtype=dtype), (
                backend, mask, f"d{name}", max_error(g, rg))
        return True
    options, twin = approximate_case(backend, call, mask, *qkv)
    out = attnkit.attention(*qkv, backend=backend, options=options, **kwargs)
    expected = twin(*qkv)
    assert max_error(out, expected) < 1e-9, (backend, mask, max_error(out, expected))
    return True


def draw_valid_call(data, family, dtype, mask=None, queries_first=False):
    """``(call, mask, qkv, do)`` drawn for ``family`` (or with ``mask(call)``); calls that
    ``attention()`` refuses for everyone (e.g. Document ids that end before its last position) are rejected."""
    call = data.draw(calls(max_batch=3 if mask else 2, queries_first=queries_first))
    mask = data.draw(mask_trees(call, family) if mask is None else mask(call))
    qkv, do = tensors(call, dtype)
    try:
        AttentionInputs.create(*qkv, mask=mask, **positions(call))
    except ValueError:
        assume(False)
    return call, mask, qkv, do


SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(data=st.data())
def test_capabilities_agree_with_forward(family, data):
    """Every backend without reasons matches the float64 reference or its naive twin."""
    call, mask, qkv, do = draw_valid_call(data, family, torch.float64)
    # every spelling of causal on each drawn call: what lsh and the kernelized backends take
    for mask in CAUSAL_SPELLINGS if family == "causal" else [mask]:
        ran = [b for b in BACKENDS if check_backend(b, call, mask, qkv, do)]
        assert "naive" in ran  # the reference backend accepts every valid call


@pytest.mark.parametrize("family", FAMILIES)
@settings(SETTINGS, max_examples=25)
@given(data=st.data())
def test_queries_before_keys(family, data):
    """The same property when the first query sits before the first key (``q_offset < kv_offset``,
    or ``Tq > Tk`` bottom-right): the rows before the keys see nothing, and masks relative to the
    call (``Dense``) still index from its first query."""
    call, mask, qkv, do = draw_valid_call(data, family, torch.float64, queries_first=True)
    masks = CAUSAL_SPELLINGS if family == "causal" else [mask]
    if family == "banded":  # a band with a call-relative conjunct, whose rows must not shift
        window = SlidingWindow(data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)))
        masks = masks + [window & data.draw(leaf_masks(call, "Dense"))]
    for mask in masks:
        ran = [b for b in BACKENDS if check_backend(b, call, mask, qkv, do)]
        assert "naive" in ran


SCORE_MOD_BACKENDS = [b for b in BACKENDS if attnkit.get_backend(b).exact and attnkit.get_backend(b).supports_score_mod]


@pytest.mark.parametrize("family", ("tree", "banded", "layout"))
@settings(SETTINGS, max_examples=25)
@given(data=st.data())
def test_score_mod_nan_where_the_mask_hides_the_pair(family, data):
    """A score modifier that is the identity where the mask keeps a pair and NaN where it hides it
    changes nothing, output or gradients, on every backend that applies score modifiers (the mask
    comes after the modifier, and no hidden pair may reach a result, padding included)."""
    call, mask, qkv, do = draw_valid_call(data, family, torch.float64, queries_first=data.draw(st.booleans()))
    assume(mask is not None)
    q0 = call["kv_offset"] + call["Tk"] - call["Tq"] if call["q_offset"] is None else call["q_offset"]
    hidden_nan = CustomScoreMod(
        lambda s, b, h, qi, ki: torch.where(mask.mask_mod(b, h, qi, ki, q_offset=q0, kv_offset=call["kv_offset"]),
                                            s, float("nan")), name="nan_where_hidden")
    kwargs = dict(mask=mask, **positions(call))
    ref, ref_grads = grads_of(lambda q, k, v: reference_attention(q, k, v, **kwargs)[0], qkv, do)
    for backend in SCORE_MOD_BACKENDS:
        if attnkit.get_backend(backend).not_supported_reasons(
                AttentionInputs.create(*qkv, score_mod=hidden_nan, **kwargs)):
            continue
        out, grads = grads_of(
            lambda q, k, v: attnkit.attention(q, k, v, backend=backend, score_mod=hidden_nan, **kwargs), qkv, do)
        assert torch.isfinite(out).all() and flash_rule_ok(max_error(out, ref), 0.0, factor=2, dtype=torch.float64), (
            backend, mask, max_error(out, ref))
        for name, g, rg in zip("qkv", grads, ref_grads):
            assert torch.isfinite(g).all() and flash_rule_ok(max_error(g, rg), 0.0, factor=3, dtype=torch.float64), (
                backend, mask, f"d{name}", max_error(g, rg))


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(data=st.data())
def test_select_agrees_with_explain(family, data):
    call, mask, qkv, _ = draw_valid_call(data, family, torch.float32)
    kwargs = dict(mask=mask, **positions(call))
    inp = AttentionInputs.create(*qkv, **kwargs)
    explanation = attnkit.explain(*qkv, **kwargs)
    assert select(inp).name == explanation.chosen
    assert not explanation.reasons[explanation.chosen]
    assert attnkit.get_backend(explanation.chosen).exact


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_custom_masks_using_batch_and_head(data):
    """The same property when Custom masks depend on ``b`` and ``h`` (FlexAttention's contract)."""
    def with_custom(call):
        @st.composite
        def masks(draw):
            custom = draw(leaf_masks(call, "Custom", custom_uses_batch_and_head=True))
            tree = draw(mask_trees(call, custom_uses_batch_and_head=True))
            return custom if tree is None else tree & custom if draw(st.booleans()) else tree | custom
        return masks()

    call, mask, qkv, do = draw_valid_call(data, "tree", torch.float64, mask=with_custom)
    for backend in BACKENDS:
        check_backend(backend, call, mask, qkv, do)


def test_lsh_honours_causal_written_twice():
    """The regression the property test was built for: lsh ran ``Causal() & Causal()`` non-causally."""
    call = dict(B=1, Hq=2, Hkv=2, Tq=9, Tk=9, D=4, Dv=4, q_offset=None, kv_offset=0, end=9)
    qkv, do = tensors(call, torch.float64)
    assert check_backend("lsh", call, Causal() & Causal(), qkv, do)


def test_lsh_honours_an_or_of_causal_masks():
    call = dict(B=1, Hq=2, Hkv=2, Tq=9, Tk=9, D=4, Dv=4, q_offset=None, kv_offset=0, end=9)
    qkv, do = tensors(call, torch.float64)
    assert check_backend("lsh", call, Causal() | Causal(), qkv, do, skip_known_wrong=False)


def test_block_sparse_with_nothing_kept_still_has_gradients():
    """The layout has no block for the call's (query, key) positions: output 0, zero gradients."""
    call = dict(B=1, Hq=1, Hkv=1, Tq=1, Tk=1, D=2, Dv=2, q_offset=0, kv_offset=1, end=2)
    qkv, do = tensors(call, torch.float64)
    mask = BlockSparse(torch.tensor([[True, False], [True, True]]), 1)
    assert check_backend("block_sparse", call, mask, qkv, do, skip_known_wrong=False)
