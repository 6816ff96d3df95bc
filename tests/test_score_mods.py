"""Score modifiers and attention sinks on every backend that declares them, against an independent
float64 formula (outputs, LSE and the gradients of q, k, v and every learnable tensor)."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit import BlockSparse, Causal, KeyPadding, SlidingWindow
from attnkit.backends.native import NativeOptions
from attnkit.backends.native import load_extension as _load_native
from attnkit.backends.tiled import TiledOptions
from attnkit.score_mods import ALiBi, CustomScoreMod, RelativeBias, SoftCap, as_score_mod, t5_bucket

from .inputs import tiny_gpt

B, H, HKV, T, D = 2, 4, 2, 50, 16
# Candidate masks, most general first; each backend that declares score modifiers and sinks is
# tested with the first one it accepts (so a newly registered backend is tested at once).
CANDIDATES = [
    Causal() & KeyPadding([40, 50]),
    SlidingWindow(12, 0) & KeyPadding([40, 50]),
    BlockSparse.bigbird(4, 16) & Causal(),
]
OPTIONS = {"tiled": TiledOptions(block_q=16, block_k=24), "native": NativeOptions(block_q=16, block_k=24)}
NATIVE_BUILT = _load_native()[0] is not None


def _score_mod_backends() -> dict:
    from attnkit.inputs import AttentionInputs
    from attnkit.registry import list_backends

    q, k = torch.randn(B, H, T, D, requires_grad=True), torch.randn(B, HKV, T, D)
    found = {}
    for name, impl in list_backends().items():
        if not (impl.exact and impl.supports_score_mod and impl.supports_sinks):
            continue
        for mask in CANDIDATES:
            inp = AttentionInputs.create(q, k, k, mask=mask, score_mod=SoftCap(1.0), sinks=torch.zeros(H),
                                         return_lse=True)
            if impl.can_run(inp):
                found[name] = mask
                break
    return found


MASKS = _score_mod_backends()


def _runs_custom(name: str) -> bool:
    from attnkit.registry import list_backends

    return "custom" in list_backends()[name].score_mod_kinds


CUSTOM = [name for name in MASKS if _runs_custom(name)]  # backends that call an opaque CustomScoreMod


def test_the_backends_that_apply_score_mods():
    assert {"naive", "tiled", "sliding_window", "block_sparse"} <= set(MASKS)
    assert ("native" in MASKS) == NATIVE_BUILT  # the fused kernel runs them whenever it is built


def _t5_bucket_loop(rel: int, n: int, max_distance: int, bidirectional: bool) -> int:
    """T5's bucket, written out scalar by scalar (as in the paper's reference code)."""
    bucket = 0
    if bidirectional:
        n //= 2
        bucket += n if rel > 0 else 0
        dist = abs(rel)
    else:
        dist = max(-rel, 0)
    exact = n // 2
    if dist < exact:
        return bucket + dist
    large = exact + int(math.log(dist / exact) / math.log(max_distance / exact) * (n - exact))
    return bucket + min(large, n - 1)


def _reference(q, k, v, keep, mod_name, params, sinks, scale):
    """float64 attention with the modifier written out explicitly, sinks as an extra logit."""
    q, k, v = q.double(), k.double().repeat_interleave(H // HKV, 1), v.double().repeat_interleave(H // HKV, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    qi = torch.arange(T, dtype=torch.float64).view(-1, 1)
    ki = torch.arange(T, dtype=torch.float64).view(1, -1)
    if mod_name == "softcap":
        s = 3.0 * torch.tanh(s / 3.0)
    elif mod_name == "alibi":
        s = s - params["slopes"].double().view(1, H, 1, 1) * (qi - ki).abs()
    elif mod_name == "relative":
        idx = torch.tensor([[_t5_bucket_loop(j - i, 16, 32, False) for j in range(T)] for i in range(T)])
        s = s + params["table"].double()[:, idx][None]
    elif mod_name == "chain":  # ALiBi, then soft-capping: order matters
        s = s - params["slopes"].double().view(1, H, 1, 1) * (qi - ki).abs()
        s = 2.0 * torch.tanh(s / 2.0)
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


def _mod(name, params):
    if name == "softcap":
        return SoftCap(3.0)
    if name == "alibi":
        return ALiBi(params["slopes"])
    if name == "relative":
        return RelativeBias(params["table"], max_distance=32, bidirectional=False)
    return [ALiBi(params["slopes"]), SoftCap(2.0)]  # a list applies in order


@pytest.mark.parametrize("use_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("mod_name", ["softcap", "alibi", "relative", "chain"])
@pytest.mark.parametrize("backend", list(MASKS))
def test_score_mod_matches_the_formula(backend, mod_name, use_sinks):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, T, D, generator=g).requires_grad_()
    k = torch.randn(B, HKV, T, D, generator=g).requires_grad_()
    v = torch.randn(B, HKV, T, D, generator=g).requires_grad_()
    params = {
        "slopes": torch.rand(H, generator=g).requires_grad_(),
        "table": torch.randn(H, 16, generator=g).requires_grad_(),
    }
    sinks = torch.randn(H, generator=g).requires_grad_() if use_sinks else None
    mask = MASKS[backend]
    out, lse = attnkit.attention(q, k, v, mask=mask, score_mod=_mod(mod_name, params), sinks=sinks,
                                 backend=backend, options=OPTIONS.get(backend), return_lse=True)
    keep = mask.materialize(T, T).expand(B, H, T, T)
    ref, ref_lse = _reference(q, k, v, keep, mod_name, params, sinks, D**-0.5)
    assert (out.double() - ref).abs().max() < 2e-5
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and (lse.double() - ref_lse)[finite].abs().max() < 2e-5
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    leaves = [q, k, v] + [t for t in params.values()] + ([sinks] if use_sinks else [])
    ours = torch.autograd.grad((out.double() * w).sum(), leaves, allow_unused=True)
    theirs = torch.autograd.grad((ref * w).sum(), leaves, allow_unused=True)
    for name, a, b in zip(["q", "k", "v", "slopes", "table", "sinks"], ours, theirs):
        if b is None:
            assert a is None or a.abs().max() == 0, name
            continue
        assert a is not None, f"{backend}: no gradient for {name}"
        assert (a.double() - b).abs().max() < 1e-4 * max(1.0, b.abs().max().item()), name


@pytest.mark.parametrize("mod_name", ["softcap", "chain"])
def test_attention_weights_apply_score_mods_and_leave_out_the_sinks(mod_name):
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, HKV, T, D, generator=g)
    params = {"slopes": torch.rand(H, generator=g)}
    sinks = 2 * torch.randn(H, generator=g)
    mask = Causal() & KeyPadding([33, 50])
    probs = attnkit.attention_weights(q, k, mask=mask, score_mod=_mod(mod_name, params), sinks=sinks)
    eye = torch.eye(T, dtype=torch.float64).expand(B, HKV, T, T)  # p @ I = p
    keep = mask.materialize(T, T, batch_size=B).expand(B, H, T, T)
    ref, _ = _reference(q, k, eye, keep, mod_name, params, sinks, D**-0.5)
    assert (probs.double() - ref).abs().max() < 1e-6
    assert bool((probs.sum(-1) < 1 - 1e-4).all())  # every row leaves its sink's share out


def test_sinks_take_mass_and_a_fully_masked_row_keeps_only_its_sink():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    sinks = torch.tensor([0.0, 50.0])  # head 1: the sink takes nearly everything
    nothing = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    for backend in ("naive", "tiled"):
        out, lse = attnkit.attention(q, k, v, mask=nothing, sinks=sinks, backend=backend, return_lse=True)
        assert out.abs().max() == 0 and torch.equal(lse, sinks.view(1, 2, 1).expand(1, 2, 4))
        out = attnkit.attention(q, k, v, sinks=sinks, backend=backend)
        assert out[0, 1].abs().max() < 1e-15 and out[0, 0].abs().max() > 0.01


def test_sdpa_declines_score_mods_and_sinks_and_auto_picks_a_backend_that_applies_them():
    q = torch.randn(1, 4, 8, 8)
    for kwargs in ({"score_mod": SoftCap(5.0)}, {"sinks": torch.zeros(4)}):
        reasons = attnkit.explain(q, q, q, mask=Causal(), **kwargs).reasons["sdpa"]
        assert any("score_mod" in r or "sinks" in r for r in reasons), reasons
        out = attnkit.attention(q, q, q, mask=Causal(), **kwargs)
        ref = attnkit.attention(q, q, q, mask=Causal(), backend="naive", **kwargs)
        torch.testing.assert_close(out, ref)


def test_alibi_geometric_slopes_and_absolute_positions_in_decode():
    assert torch.allclose(ALiBi.geometric(8).slopes, torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    assert ALiBi.geometric(6).slopes.numel() == 6
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8)
    mod = ALiBi.geometric(4)
    full = attnkit.attention(q, k, v, mask=Causal(), score_mod=mod, backend="naive")
    last = attnkit.attention(q[:, :, -1:], k, v, mask=Causal(), score_mod=mod, backend="tiled")  # q at position 9
    torch.testing.assert_close(last, full[:, :, -1:])


def test_t5_bucket_matches_the_scalar_definition():
    rel = torch.arange(-300, 300)
    for bidirectional in (True, False):
        ours = t5_bucket(rel, num_buckets=32, max_distance=128, bidirectional=bidirectional).tolist()
        assert ours == [_t5_bucket_loop(r, 32, 128, bidirectional) for r in rel.tolist()]


def test_drawing_and_composition():
    assert SoftCap(1.0).to_string(1, 1).strip() == "0.00"
    drawn = ALiBi(torch.tensor([1.0])).to_string(2, 3).splitlines()
    assert [float(x) for x in drawn[0].split()] == [-1.0, 0.0, -1.0]  # query at position 1
    chain = as_score_mod([ALiBi.geometric(2), SoftCap(2.0)])
    assert [type(p).__name__ for p in chain.parts()] == ["ALiBi", "SoftCap"]
    assert [type(p).__name__ for p in (SoftCap(1.0) >> chain).parts()] == ["SoftCap", "ALiBi", "SoftCap"]
    custom = as_score_mod(lambda s, b, h, qi, ki: s * 2)
    assert isinstance(custom, CustomScoreMod)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: SoftCap(0.0), "positive"),
        (lambda: SoftCap(float("nan")), "finite"),
        (lambda: ALiBi(torch.ones(2, 2)), "1-D"),
        (lambda: RelativeBias(torch.ones(4)), "(H, num_buckets)"),
        (lambda: RelativeBias(torch.ones(2, 8), max_distance=1), "max_distance"),
        (lambda: as_score_mod(3), "ScoreMod"),
        (lambda: attnkit.attention(*(torch.randn(1, 4, 3, 8),) * 3, score_mod=ALiBi.geometric(2)), "heads"),
        (lambda: attnkit.attention(*(torch.randn(1, 4, 3, 8),) * 3, sinks=torch.zeros(3)), "sinks"),
        (lambda: attnkit.attention(*(torch.randn(1, 4, 3, 8),) * 3, sinks=torch.zeros(4, dtype=torch.long)), "sinks"),
    ],
)
def test_bad_score_mods_are_refused_clearly(make, fragment):
    with pytest.raises((ValueError, TypeError), match=None) as info:
        make()
    assert fragment in str(info.value)


# -- models -------------------------------------------------------------------------------------
def _gpt(backend, **kw):
    model = tiny_gpt(vocab_size=40, num_kv_heads=2, backend=backend, **kw)
    for name, p in model.named_parameters():  # learned biases/sinks start at zero: make them matter
        if "relative_bias" in name or name.endswith("sinks"):
            torch.nn.init.normal_(p, std=1.0)
    return model


@pytest.mark.parametrize("backend", ["naive", "tiled"])
@pytest.mark.parametrize("features", [
    {"position": "alibi", "softcap": 5.0},
    {"position": "t5", "sinks": True},
    {"position": "rope", "softcap": 3.0, "sinks": True},
], ids=["alibi-softcap", "t5-sinks", "rope-softcap-sinks"])
def test_models_with_score_mods_decode_like_the_full_forward(backend, features):
    model = _gpt(backend, **features)
    x = torch.randint(0, 40, (2, 23))
    with torch.no_grad():
        full = model(x)
        cache = model.make_cache("dynamic")
        steps = torch.cat([model(x[:, s : s + 4], cache=cache) for s in range(0, 23, 4)], dim=1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-4)
    reference = _gpt("naive", **features)
    with torch.no_grad():
        torch.testing.assert_close(reference(x), full, atol=1e-5, rtol=1e-4)


def test_learned_sinks_and_relative_tables_receive_gradients():
    model = _gpt("tiled", position="t5", sinks=True).train()
    x = torch.randint(0, 40, (2, 17))
    model(x).logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "relative_bias" in n or n.endswith("sinks")}
    assert len(grads) == 4 and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_alibi_model_passes_no_dense_bias(monkeypatch):
    """ALiBi is a score modifier of absolute positions: no (Tq, Tk) tensor reaches attention()."""
    import attnkit.nn.attention as module

    seen = []
    real = module.attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("bias"))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "attention", spy)
    model = _gpt("auto", position="alibi")
    with torch.no_grad():
        model(torch.randint(0, 40, (1, 9)))
    assert seen and all(b is None for b in seen)


@pytest.mark.parametrize("backend", list(MASKS))
def test_rows_whose_window_reaches_no_key_have_the_sink_as_lse(backend):
    """Queries far after the keys (a large q_offset) see nothing through a window: like any fully
    masked row they output 0 and their LSE is the sink, through which the sink gets its gradient
    (an LSE merge of such a row with another chunk must count the sink's mass)."""
    g = torch.Generator().manual_seed(6)
    Tq, Tk, Hq = 21, 13, 6
    q, k, v = (torch.randn(1, Hq, Tq, 8, generator=g), torch.randn(1, 3, Tk, 8, generator=g),
               torch.randn(1, 3, Tk, 8, generator=g))
    sinks = torch.randn(Hq, generator=g, dtype=torch.float64).float().requires_grad_()
    mask = SlidingWindow(3, 0) if backend != "block_sparse" else BlockSparse.bigbird(8, 4) & SlidingWindow(3, 0)
    kw = dict(mask=mask, sinks=sinks, q_offset=9, kv_offset=0, return_lse=True)
    out, lse = attnkit.attention(q, k, v, backend=backend, options=OPTIONS.get(backend), **kw)
    ref, ref_lse = attnkit.attention(q.double(), k.double(), v.double(), backend="naive",
                                     **{**kw, "sinks": sinks.double()})
    blind = torch.arange(Tq) + 9 - 3 > Tk - 1  # the window starts after the last key
    n = int(blind.sum())
    assert 0 < n < Tq and torch.equal(out[:, :, blind], torch.zeros_like(out[:, :, blind]))
    assert torch.equal(lse[:, :, blind], sinks.detach().view(1, Hq, 1).expand(1, Hq, n))
    assert (lse.double() - ref_lse).abs().max() < 1e-5 and (out.double() - ref).abs().max() < 1e-5
    (grad,) = torch.autograd.grad(lse[:, :, blind].sum(), sinks)
    assert torch.equal(grad, torch.full((Hq,), float(n)))


@pytest.mark.parametrize("backend", list(MASKS))
def test_an_infinite_sink_takes_all_the_mass(backend):
    """sinks = +inf: that head's rows give 0 and LSE +inf (the sink's limit), never NaN; the
    other heads are unchanged."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 37, 8, generator=g) for _ in range(3))
    mask = MASKS[backend]
    sinks = torch.tensor([0.3, float("inf"), -1.0, float("inf")])
    out, lse = attnkit.attention(q, k, v, mask=mask, sinks=sinks, backend=backend, options=OPTIONS.get(backend),
                                 return_lse=True)
    ref, ref_lse = attnkit.attention(q, k, v, mask=mask, sinks=torch.tensor([0.3, 0.0, -1.0, 0.0]), backend="naive",
                                     return_lse=True)
    inf = torch.tensor([False, True, False, True])
    assert torch.equal(out[:, inf], torch.zeros_like(out[:, inf])) and (lse[:, inf] == float("inf")).all()
    assert (out[:, ~inf] - ref[:, ~inf]).abs().max() < 1e-5 and (lse[:, ~inf] - ref_lse[:, ~inf]).abs().max() < 1e-5


@pytest.mark.parametrize("backend", CUSTOM)
def test_a_modifier_nan_only_where_the_mask_hides_the_pair_changes_nothing(backend):
    """A modifier that is NaN exactly on the hidden pairs (it is never seen there): output, LSE and
    every gradient equal the unmodified call's, including the query and key padding a backend adds
    around a call whose offsets are not multiples of its blocks."""
    mask = BlockSparse.bigbird(12, 4, seed=2) & Causal() if backend == "block_sparse" else MASKS[backend]
    nan_where_hidden = CustomScoreMod(lambda s, b, h, q, k: torch.where(mask.mask_mod(b, h, q, k), s, float("nan")))
    g = torch.Generator().manual_seed(8)
    for Tq, Tk, q_offset in ((29, 45, None), (13, 45, 6)):
        q = torch.randn(2, 4, Tq, 8, generator=g).requires_grad_()
        k, v = (torch.randn(2, 2, Tk, 8, generator=g).requires_grad_() for _ in range(2))
        kw = dict(mask=mask, q_offset=q_offset, backend=backend, options=OPTIONS.get(backend), return_lse=True)
        out, lse = attnkit.attention(q, k, v, score_mod=nan_where_hidden, **kw)
        ref, ref_lse = attnkit.attention(q, k, v, **kw)
        assert torch.isfinite(out).all() and (out - ref).abs().max() < 1e-5
        seen = torch.isfinite(ref_lse)
        assert torch.equal(seen, torch.isfinite(lse)) and (lse - ref_lse)[seen].abs().max() < 1e-5
        w = torch.randn(out.shape, generator=g)
        for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)),
                        torch.autograd.grad((ref * w).sum(), (q, k, v))):
            assert torch.isfinite(a).all() and (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("num_buckets,bidirectional", [(10, False), (24, True), (7, False)])
def test_relative_bias_max_distance_within_the_exact_buckets_is_refused(num_buckets, bidirectional):
    """max_distance <= the exact-bucket count makes T5's log scale degenerate (log(1) = 0, or a
    negative ratio): refused clearly; one past it gives buckets inside the table for every distance."""
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    table = torch.randn(3, num_buckets)
    for bad in (2, exact - 1, exact):
        if bad < 2:
            continue
        with pytest.raises(ValueError, match=rf"max_distance={bad}\b.*greater than {exact}"):
            RelativeBias(table, max_distance=bad, bidirectional=bidirectional)
        with pytest.raises(ValueError, match="max_distance"):
            t5_bucket(torch.arange(-50, 50), num_buckets=num_buckets, max_distance=bad, bidirectional=bidirectional)
    mod = RelativeBias(table, max_distance=exact + 1, bidirectional=bidirectional)
    buckets = mod.buckets(torch.zeros(1, dtype=torch.long), torch.arange(-300, 300))
    assert buckets.min() >= 0 and buckets.max() < num_buckets
    scores = mod.evaluate(torch.zeros(1, 3, 9, 600), (0, 9), (-300, 300), 1, 3)
    assert torch.isfinite(scores).all()


@pytest.mark.parametrize("backend", CUSTOM)
@pytest.mark.parametrize("wrong", ["extra_dim", "reduced", "sliced"])
def test_a_modifier_returning_the_wrong_shape_is_refused_on_every_backend(backend, wrong):
    """One new score per score: a modifier that adds, reduces or drops entries gets a clear
    ValueError naming both shapes (never a deep RuntimeError, nor a silently broadcast output)."""
    fn = {
        "extra_dim": lambda s, b, h, q, k: s[None] * 2,
        "reduced": lambda s, b, h, q, k: s.sum(-1, keepdim=True),
        "sliced": lambda s, b, h, q, k: s[..., :1] + 0 * k[..., :1],
    }[wrong]
    q = torch.randn(2, 4, 19, 8)
    k = torch.randn(2, 2, 19, 8)
    with pytest.raises(ValueError, match=r"score_mod: .* returned shape .* for scores of shape"):
        attnkit.attention(q, k, k, mask=MASKS[backend], score_mod=fn, backend=backend, options=OPTIONS.get(backend))


def _bias_backends() -> list[str]:
    from attnkit.registry import list_backends

    return [name for name in MASKS if list_backends()[name].supports_bias]


@pytest.mark.parametrize("spelling", ["attn_mask", "bias"])
@pytest.mark.parametrize("backend", _bias_backends())
def test_an_additive_mask_masks_after_the_score_mod(backend, spelling):
    """-inf (or the dtype's lowest value) in a float attn_mask / bias is a mask applied after the
    modifier; the finite part is a bias applied before it: softmax(mask(cap(s + finite)))."""
    Tq, Tk, cap = 19, 27, 0.7
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H, Tq, D, generator=g).requires_grad_()
    k, v = (torch.randn(B, HKV, Tk, D, generator=g) for _ in range(2))
    keep = torch.rand(B, 1, Tq, Tk, generator=g) > 0.4
    keep[0, 0, 3] = False  # one fully masked row: 0, as for mask=
    finite = torch.randn(B, 1, Tq, Tk, generator=g)
    additive = finite.masked_fill(~keep, float("-inf"))
    additive[1, 0, :, :2] = torch.finfo(torch.float32).min  # transformers' fill for "masked"
    keep[1, 0, :, :2] = False
    kwargs = {spelling: additive}
    out = attnkit.attention(q, k, v, score_mod=SoftCap(cap), backend=backend, options=OPTIONS.get(backend), **kwargs)
    kk, vv = (t.double().repeat_interleave(H // HKV, 1) for t in (k, v))
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), kk) * D**-0.5 + finite.double()
    s = (cap * torch.tanh(s / cap)).masked_fill(~keep, float("-inf"))
    ref = torch.softmax(s, -1).nan_to_num(0.0) @ vv
    assert (out.double() - ref).abs().max() < 2e-5
    assert out[0, :, 3].abs().max() == 0
    grad, = torch.autograd.grad(out.sum(), q)
    ref_grad, = torch.autograd.grad(ref.sum(), q)
    assert (grad.double() - ref_grad).abs().max() < 1e-4
    poisoned = additive.clone()
    poisoned[0, 0, 5, keep[0, 0, 5].nonzero()[0, 0]] = float("nan")  # NaN where row 5 may look
    out = attnkit.attention(q.detach(), k, v, score_mod=SoftCap(cap), backend=backend, options=OPTIONS.get(backend),
                            **{spelling: poisoned})
    assert torch.isnan(out[0, :, 5]).all() and not torch.isnan(out[0, :, 6]).any()


def test_score_mods_export_their_structure_as_data():
    """A chain's terms in the order they apply, each with its parameters as the same tensor objects
    (gradients reach them), the relative bucket rule evaluable, sinks beside them."""
    from attnkit.score_mods import score_mod_spec

    slopes, table, sinks = torch.rand(4), torch.randn(4, 16), torch.zeros(4)
    fn = CustomScoreMod(lambda s, b, h, q, k: s * 2, name="double")
    mod = as_score_mod([SoftCap(5.0), ALiBi(slopes), RelativeBias(table, max_distance=32, bidirectional=False), fn])
    spec = score_mod_spec(mod, sinks)
    assert [t.kind for t in spec.terms] == ["softcap", "alibi", "relative_bias", "custom"]
    assert spec.terms[0].cap == 5.0 and spec.terms[1].slopes is slopes and spec.terms[2].table is table
    assert spec.terms[3].mod is fn and spec.sinks is sinks and not spec.additive
    assert spec.parameters()[:2] == (slopes, table)
    rel = torch.arange(-40, 5)
    assert torch.equal(spec.terms[2].buckets(rel), t5_bucket(rel, num_buckets=16, max_distance=32, bidirectional=False))
    assert score_mod_spec(None).terms == () and score_mod_spec(ALiBi(slopes) >> ALiBi(slopes)).additive


def test_a_backend_declares_the_score_mod_kinds_it_runs():
    from attnkit.inputs import AttentionInputs
    from attnkit.registry import Backend

    class OnlyCaps(Backend):
        name = "only_caps_for_this_test"
        supports_score_mod = True
        score_mod_kinds = frozenset({"softcap"})

    q = torch.randn(1, 4, 5, 8)
    assert OnlyCaps.can_run(AttentionInputs.create(q, q, q, score_mod=SoftCap(2.0)))
    inp = AttentionInputs.create(q, q, q, score_mod=SoftCap(2.0) >> ALiBi.geometric(4))
    assert not OnlyCaps.can_run(inp)
    assert any("not alibi" in r for r in OnlyCaps.not_supported_reasons(inp))


@pytest.mark.skipif(not NATIVE_BUILT, reason="native extension not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_runs_the_modifiers_at_awkward_shapes_and_offsets(dtype):
    """Soft-cap between two additive terms, sinks and a learnable bias, with Tq != Tk both ways,
    a call offset, GQA and tiles that cut rows and columns: outputs, LSE and every gradient equal
    the naive backend's (the modifiers there are the plain tensor formulas)."""
    g = torch.Generator().manual_seed(5)
    for Tq, Tk, q_offset, mask in ((37, 45, None, Causal()), (45, 17, 3, SlidingWindow(9, 2)),
                                   (1, 29, None, Causal() & KeyPadding([20, 29]))):
        q = torch.randn(2, 6, Tq, 9, generator=g, dtype=dtype).requires_grad_()
        k, v = (torch.randn(2, 3, Tk, 9, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
        slopes = torch.rand(6, generator=g, dtype=dtype).requires_grad_()
        table = torch.randn(6, 8, generator=g, dtype=dtype).requires_grad_()
        sinks = torch.randn(6, generator=g, dtype=dtype).requires_grad_()
        bias = torch.randn(1, 6, 1, Tk, generator=g, dtype=dtype).requires_grad_()
        mod = [ALiBi(slopes), SoftCap(1.5), RelativeBias(table, max_distance=16, bidirectional=True)]
        leaves = (q, k, v, slopes, table, sinks, bias)
        kw = dict(mask=mask, q_offset=q_offset, score_mod=mod, sinks=sinks, bias=bias, return_lse=True)
        out, lse = attnkit.attention(q, k, v, backend="native", options=NativeOptions(8, 16), **kw)
        ref, ref_lse = attnkit.attention(q, k, v, backend="naive", **kw)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        assert (out - ref).abs().max() < tol and (lse - ref_lse).abs().max() < tol
        w = torch.randn(out.shape, generator=g, dtype=dtype)
        ours = torch.autograd.grad((out * w).sum() + lse.sum(), leaves)
        theirs = torch.autograd.grad((ref * w).sum() + ref_lse.sum(), leaves)
        for name, a, b in zip(["q", "k", "v", "slopes", "table", "sinks", "bias"], ours, theirs):
            assert (a - b).abs().max() < 20 * tol * max(1.0, b.abs().max().item()), name


@pytest.mark.skipif(not NATIVE_BUILT, reason="native extension not built")
def test_native_declares_the_modifiers_it_runs():
    q = torch.randn(1, 4, 8, 16)
    named = str(attnkit.explain(q, q, q, score_mod=ALiBi.geometric(4) >> SoftCap(5.0), sinks=torch.zeros(4),
                                backend="native"))
    assert "chosen: native" in named and "score modifiers ALiBi(heads=4) >> SoftCap(cap=5.0) in the kernel" in named
    custom = str(attnkit.explain(q, q, q, score_mod=CustomScoreMod(lambda s, b, h, qi, ki: s * 2)))
    assert "native: not used: runs the score modifiers alibi, relative_bias, softcap, not custom" in custom
