"""Approximate backends (linear, performer, lsh): each equals its naive twin, plus the properties
that make them trustworthy (unbiased kernel, error falling with features, limits that are exact,
causality, finiteness, O(1) decoding equal to the full forward). Not closeness to softmax."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import Causal, KeyPadding, NoBackendError, RecurrentState, SlidingWindow
from attnkit.backends.kernelized import features as fm
from attnkit.backends.kernelized import ops
from attnkit.backends import lsh
from attnkit.backends.kernelized import LinearOptions
from attnkit.backends.kernelized import PerformerOptions, PerformerProjection, draw_projection, kernel_estimate
from attnkit.dispatch import select
from attnkit.inputs import AttentionInputs

APPROX = ["linear", "performer", "lsh"]


def rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def qkv(B=2, Hq=4, Hkv=2, Tq=23, Tk=23, D=8, Dv=5, dtype=torch.float64, seed=0):
    return rand(B, Hq, Tq, D, dtype=dtype, seed=seed), rand(B, Hkv, Tk, D, dtype=dtype, seed=seed + 1), rand(
        B, Hkv, Tk, Dv, dtype=dtype, seed=seed + 2
    )


def twin(q, k, v, mask, phi_q_fn, phi_k_fn, **kw):
    """The quadratic form on the materialized mask."""
    inp = AttentionInputs.create(q, k, v, mask=mask, **kw)
    kk, vv = inp.expand_kv()
    return ops.quadratic_attention(phi_q_fn(q, inp.scale), phi_k_fn(kk, inp.scale), vv, inp.materialize_mask())


def elu(x, scale):
    return fm.elu_features(x)


def favor(w):
    return lambda x, scale: torch.exp(fm.favor_logits(x, w, scale))


MASKS = [None, Causal(), KeyPadding([17, 9]), Causal() & KeyPadding([17, 9])]


# -- linear and performer: equal to the quadratic twin --------------------------------------------
@pytest.mark.parametrize("mask", MASKS, ids=repr)
@pytest.mark.parametrize("backend", ["linear", "performer"])
def test_kernelized_equals_quadratic_twin(backend, mask):
    q, k, v = qkv()
    w = draw_projection(32, 8, dtype=torch.float64)
    if backend == "linear":
        options, phi = LinearOptions(chunk=4, segment=9), elu
    else:
        options, phi = PerformerOptions(projection=w, chunk=4, segment=9), favor(w)
    out = attnkit.attention(q, k, v, mask=mask, backend=backend, options=options)
    torch.testing.assert_close(out, twin(q, k, v, mask, phi, phi), rtol=1e-10, atol=1e-10)


@settings(max_examples=25, deadline=None)
@given(
    Tq=st.integers(1, 40), Tk=st.integers(1, 40), chunk=st.integers(1, 16), segment=st.integers(1, 24),
    q_offset=st.one_of(st.none(), st.integers(0, 45)),
)
def test_linear_causal_chunked_equals_masked_quadratic(Tq, Tk, chunk, segment, q_offset):
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Tq=Tq, Tk=Tk, D=4, Dv=3)
    out = attnkit.attention(q, k, v, mask=Causal(), q_offset=q_offset, backend="linear",
                            options=LinearOptions(chunk=chunk, segment=segment))
    ref = twin(q, k, v, Causal(), elu, elu, q_offset=q_offset)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_per_key_bool_mask_and_fully_masked_rows():
    q, k, v = qkv(Tq=6, Tk=6)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 4:] = True  # nn.MultiheadAttention convention: True = ignore
    pad[1, :] = True  # batch 1: every key is padding -> output 0
    mask = attnkit.from_key_padding_mask(pad)
    for backend in ("linear", "performer"):
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = attnkit.attention(q[:1], k[:1, :, :4], v[:1, :, :4], backend=backend)
        torch.testing.assert_close(out[:1], ref)
    # Tq > Tk, causal: the first queries precede every key -> 0, with finite gradients.
    q, k, v = (x.requires_grad_() for x in qkv(Tq=9, Tk=4))
    out = attnkit.attention(q, k, v, mask=Causal(), backend="linear")
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("backend", ["linear", "performer"])
def test_kernelized_causal_gradient_never_reaches_the_future(backend):
    q, k, v = (x.requires_grad_() for x in qkv(Tq=30, Tk=30))
    options = LinearOptions(chunk=4, segment=16) if backend == "linear" else PerformerOptions(chunk=4, segment=16)
    out = attnkit.attention(q, k, v, mask=Causal(), backend=backend, options=options)
    out[:, :, 9].sum().backward()  # query 9 sits mid-chunk and mid-segment
    for x in (q, k, v):
        assert torch.equal(x.grad[:, :, 10:], torch.zeros_like(x.grad[:, :, 10:]))
    assert k.grad[:, :, :10].abs().sum() > 0


@pytest.mark.parametrize("backend", ["linear", "performer"])
def test_nan_in_padded_keys_does_not_leak(backend):
    q, k, v = qkv()
    k, v = k.clone(), v.clone()
    k[0, :, 17:] = float("nan")
    v[0, :, 17:] = float("nan")
    for mask in (KeyPadding([17, 23]), Causal() & KeyPadding([17, 23])):
        out = attnkit.attention(q, k, v, mask=mask, backend=backend)
        assert torch.isfinite(out).all()


# -- Performer: the kernel estimate -----------------------------------------------------------------
def _kernel_draws(num_features, draws, *, orthogonal, D=8, seed=0):
    """``draws`` independent estimates of ``exp(qᵀk)`` for 6 x 6 pairs: ``(draws, 6, 6)``, exact ``(6, 6)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, D, generator=g, dtype=torch.float64) * 0.2
    exact = torch.exp(x[0] @ x[1].t())
    # Blocks of D rows are drawn independently, so one tall draw is `draws` independent projections.
    w = draw_projection(draws * num_features, D, orthogonal=orthogonal, generator=g, dtype=torch.float64)
    return kernel_estimate(x[0], x[1], w.view(draws, num_features, D)), exact


@pytest.mark.parametrize("orthogonal", [True, False])
def test_performer_kernel_estimate_is_unbiased(orthogonal):
    est, exact = _kernel_draws(8, 4000, orthogonal=orthogonal)
    stderr = est.std(0) / est.shape[0] ** 0.5
    assert ((est.mean(0) - exact).abs() <= 4 * stderr + 1e-3).all()
    assert ((est.mean(0) - exact).abs() / exact).mean() < 0.03


def test_performer_error_falls_as_features_grow_and_orthogonal_beats_iid():
    mse = {}
    for m in (8, 16, 32):
        for orth in (True, False):
            est, exact = _kernel_draws(m, 10000, orthogonal=orth, seed=1)
            mse[m, orth] = float(((est - exact) ** 2).mean())
    assert mse[8, True] > mse[16, True] > mse[32, True]
    assert mse[8, False] > mse[16, False] > mse[32, False]
    # FAVOR+ Theorem 2: orthogonal features have lower MSE (about 15% here, 10000 draws each)
    assert all(mse[m, True] < mse[m, False] for m in (8, 16, 32))
    # and on attention outputs, through approximation_error
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Tq=64, Tk=64, D=16, seed=3)
    errs = [
        sum(attnkit.approximation_error(q * 0.5, k * 0.5, v, backend="performer",
                                        options=PerformerOptions(num_features=m, seed=s)) for s in range(4))
        for m in (16, 64, 256)
    ]
    assert errs[0] > errs[1] > errs[2]


def test_draw_projection_orthogonal_blocks():
    w = draw_projection(20, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert w.shape == (20, 8)
    block = w[:8] / w[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.t(), torch.eye(8, dtype=torch.float64))


def test_performer_projection_module_redraw():
    mod = PerformerProjection(16, 8, redraw_interval=2)
    assert "projection" in mod.state_dict()
    first = mod.options().projection.clone()
    assert torch.equal(mod.options().projection, first)
    assert not torch.equal(mod.options().projection, first)  # third call: redrawn
    mod.eval()
    frozen = mod.projection.clone()
    for _ in range(5):
        assert torch.equal(mod.options().projection, frozen)


# -- decoding with the recurrent state ---------------------------------------------------------------
@pytest.mark.parametrize("backend", ["linear", "performer"])
def test_recurrent_decode_equals_causal_forward(backend):
    q, k, v = qkv(Tq=21, Tk=21)
    w = draw_projection(32, 8, dtype=torch.float64)
    opts = (LinearOptions(chunk=4, segment=8) if backend == "linear"
            else PerformerOptions(projection=w, chunk=4, segment=8))
    full = attnkit.attention(q, k, v, mask=Causal(), backend=backend, options=opts)
    state = RecurrentState.create(backend, head_dim=8, options=opts)
    outs = [state.step(q[:, :, :13], k[:, :, :13], v[:, :, :13])]  # prefill
    for t in range(13, 21):  # one token at a time
        outs.append(state.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1]))
    assert state.seq_len == 21
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-9, atol=1e-9)
    # the same decode through attention() with offsets: one query over all keys
    last = attnkit.attention(q[:, :, -1:], k, v, mask=Causal(), backend=backend, options=opts)
    torch.testing.assert_close(last, full[:, :, -1:])


def test_recurrent_state_size_is_constant_and_scale_survives_large_keys():
    w = draw_projection(16, 8, dtype=torch.float64)
    state = RecurrentState.create("performer", head_dim=8, options=PerformerOptions(projection=w))
    shapes = set()
    for t in range(6):
        x = rand(1, 2, 1, 8, seed=t) * (1 + 10 * t)  # growing norms force rescaling
        out = state.step(x, x, x)
        assert torch.isfinite(out).all()
        shapes.add((tuple(state.kv.shape), tuple(state.z.shape)))
    assert shapes == {((1, 2, 16, 8), (1, 2, 16))}


def test_recurrent_state_bad_inputs():
    with pytest.raises(ValueError, match="cannot decode incrementally"):
        RecurrentState.create("lsh", head_dim=8)
    with pytest.raises(ValueError, match="head_dim"):
        RecurrentState.create("linear", head_dim=0)
    state = RecurrentState.create("linear", head_dim=8)
    q, k, v = qkv(Tq=3, Tk=3)
    with pytest.raises(ValueError, match="one T"):
        state.step(q, k[:, :, :2], v[:, :, :2])
    state.step(q, k, v)
    with pytest.raises(ValueError, match="one state per layer"):
        state.step(q[:1], k[:1], v[:1])
    state.reset()
    assert state.seq_len == 0 and state.step(q[:1], k[:1], v[:1]).shape == (1, 4, 3, 5)


# -- LSH -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [None, Causal()], ids=repr)
@pytest.mark.parametrize("n_hashes", [1, 3])
def test_lsh_one_bucket_equals_exact_shared_qk_attention(mask, n_hashes):
    T = 29
    q, k = lsh.shared_qk(rand(2, 3, T, 8))
    v = rand(2, 3, T, 5, seed=5)
    out = attnkit.attention(q, k, v, mask=mask, backend="lsh",
                            options=lsh.LSHOptions(n_hashes=n_hashes, n_buckets=1, bucket_size=T))
    keep = torch.ones(T, T, dtype=torch.bool) if mask is None else mask.materialize(T, T)[0, 0]
    ref = attnkit.attention(q, k, v, mask=lsh.self_exclusion(keep), backend="naive")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    # without the exclusion rule: exactly attention()
    out = attnkit.attention(q, k, v, mask=mask, backend="lsh",
                            options=lsh.LSHOptions(n_hashes=n_hashes, n_buckets=1, bucket_size=T, exclude_self=False))
    torch.testing.assert_close(out, attnkit.attention(q, k, v, mask=mask), rtol=1e-10, atol=1e-10)


def test_lsh_limit_is_exact_attention_with_gqa_and_ragged_chunks():
    q, k, v = qkv(B=2, Hq=4, Hkv=2, Tq=37, Tk=37)  # 37 tokens: the last chunk is padded
    opts = lsh.LSHOptions(n_hashes=2, n_buckets=1, bucket_size=40, exclude_self=False)
    torch.testing.assert_close(attnkit.attention(q, k, v, mask=Causal(), backend="lsh", options=opts),
                               attnkit.attention(q, k, v, mask=Causal(), backend="naive"), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", [None, Causal()], ids=repr)
def test_lsh_rounds_combine_to_attention_over_the_union(mask):
    T, R = 31, 4
    q, k = lsh.shared_qk(rand(1, 2, T, 8, seed=7))
    v = rand(1, 2, T, 5, seed=8)
    opts = lsh.LSHOptions(n_hashes=R, n_buckets=4, bucket_size=R * T)  # one chunk: pairs = same bucket in any round
    out = attnkit.attention(q, k, v, mask=mask, backend="lsh", options=opts)
    b = lsh.hash_buckets(k, opts)  # (B, H, R, T)
    keep = (b[..., :, None] == b[..., None, :]).any(2)
    if mask is not None:
        keep &= mask.materialize(T, T)
    ref = attnkit.attention(q, k, v, mask=lsh.self_exclusion(keep), backend="naive")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert not keep.all()  # the hashing did drop pairs


def test_lsh_causal_never_attends_to_the_future():
    T = 64
    x = rand(1, 2, T, 8).requires_grad_()
    v = rand(1, 2, T, 4, seed=1).requires_grad_()
    q, k = lsh.shared_qk(x)
    opts = lsh.LSHOptions(n_hashes=3, bucket_size=8)
    out = attnkit.attention(q, k, v, mask=Causal(), backend="lsh", options=opts)
    out[:, :, 40].sum().backward()
    assert torch.equal(x.grad[:, :, 41:], torch.zeros_like(x.grad[:, :, 41:]))
    assert torch.equal(v.grad[:, :, 41:], torch.zeros_like(v.grad[:, :, 41:]))
    assert v.grad[:, :, :41].abs().sum() > 0
    # changing the future changes nothing before it
    v2 = v.detach().clone()
    v2[:, :, 50:] += 100
    out2 = attnkit.attention(q.detach(), k.detach(), v2, mask=Causal(), backend="lsh", options=opts)
    torch.testing.assert_close(out2[:, :, :50], out.detach()[:, :, :50])


def test_lsh_lone_position_attends_itself():
    T = 16
    q, k = lsh.shared_qk(rand(1, 1, T, 4))
    v = rand(1, 1, T, 3, seed=2)
    out = attnkit.attention(q, k, v, mask=Causal(), backend="lsh", options=lsh.LSHOptions(n_hashes=2, bucket_size=4))
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0])  # position 0 sees only itself


def test_lsh_bad_inputs():
    q, k, v = qkv(Tq=5, Tk=8)
    with pytest.raises(NoBackendError, match="cannot decode incrementally"):
        attnkit.attention(q, k, v, backend="lsh")
    q, k, v = qkv(Tq=8, Tk=8)
    with pytest.raises(NoBackendError, match="SlidingWindow"):
        attnkit.attention(q, k, v, mask=SlidingWindow(2, 0), backend="lsh")
    with pytest.raises(ValueError, match="n_buckets=3"):
        lsh.LSHOptions(n_buckets=3)
    with pytest.raises(ValueError, match="bucket_size=0"):
        lsh.LSHOptions(bucket_size=0)
    with pytest.raises(ValueError, match="rotations"):
        attnkit.attention(q, k, v, backend="lsh", options=lsh.LSHOptions(n_buckets=4, rotations=torch.randn(3, 4, 2)))


# -- all three ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [None, Causal()], ids=repr)
@pytest.mark.parametrize("backend", APPROX)
def test_finite_for_large_norm_inputs(backend, mask):
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Tq=40, Tk=40, D=16, dtype=torch.float32)
    q, k = (x.mul(100.0).requires_grad_() for x in (q, k))
    v.requires_grad_()
    options = {"lsh": lsh.LSHOptions(bucket_size=8),
               "performer": PerformerOptions(num_features=32, chunk=8)}.get(backend)
    out = attnkit.attention(q, k, v, mask=mask, backend=backend, options=options)
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("backend", APPROX)
def test_backward_gradcheck(backend):
    q, k, v = (x.requires_grad_() for x in qkv(B=1, Hq=2, Hkv=1, Tq=7, Tk=7, D=3, Dv=2))
    options = {
        "linear": LinearOptions(chunk=2, segment=5),
        "performer": PerformerOptions(num_features=4, chunk=2, segment=5),
        "lsh": lsh.LSHOptions(n_hashes=2, bucket_size=4),
    }[backend]
    for mask in (None, Causal()):
        assert torch.autograd.gradcheck(
            lambda q, k, v: attnkit.attention(q, k, v, mask=mask, backend=backend, options=options), (q, k, v),
            fast_mode=True,
        )


@pytest.mark.parametrize("backend", APPROX)
def test_low_precision_runs_and_keeps_dtype(backend):
    q, k, v = qkv(Tq=16, Tk=16, Hkv=4, dtype=torch.bfloat16)
    out = attnkit.attention(q, k, v, mask=Causal(), backend=backend)
    ref = attnkit.attention(q.double(), k.double(), v.double(), mask=Causal(), backend=backend)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=0.05, atol=0.05)


def test_auto_never_picks_approximate_backends_and_explain_says_why():
    q, k, v = qkv(dtype=torch.float32)
    for mask in (None, Causal()):
        inp = AttentionInputs.create(q, k, v, mask=mask)
        assert select(inp).exact
        expl = attnkit.explain(q, k, v, mask=mask)
        for name in APPROX:
            assert "approximate: runs only when named" in expl.reasons[name]
            assert not attnkit.get_backend(name).exact
    with attnkit.use_backend("linear"):  # named through the scope: allowed
        assert select(AttentionInputs.create(q, k, v)).name == "linear"


@pytest.mark.parametrize("backend", ["linear", "performer"])
def test_kernelized_bad_inputs(backend):
    q, k, v = qkv(Tq=8, Tk=8)
    with pytest.raises(NoBackendError, match="SlidingWindow"):
        attnkit.attention(q, k, v, mask=SlidingWindow(2, 0), backend=backend)
    with pytest.raises(NoBackendError, match="same for every query"):
        attnkit.attention(q, k, v, mask=torch.rand(8, 8) > 0.5, backend=backend)
    with pytest.raises(TypeError, match="options"):
        attnkit.attention(q, k, v, backend=backend, options=lsh.LSHOptions())
    with pytest.raises(ValueError, match="chunk=0"):
        (LinearOptions if backend == "linear" else PerformerOptions)(chunk=0)
    with pytest.raises(NoBackendError, match="dropout"):
        attnkit.attention(q, k, v, backend=backend, dropout_p=0.1)


def test_performer_bad_projection():
    q, k, v = qkv(Tq=8, Tk=8)
    with pytest.raises(ValueError, match="head_dim 5"):
        attnkit.attention(q, k, v, backend="performer", options=PerformerOptions(projection=torch.randn(16, 5)))
    with pytest.raises(ValueError, match="num_features, head_dim"):
        PerformerOptions(projection=torch.randn(16))
    with pytest.raises(ValueError, match="num_features=0"):
        draw_projection(0, 8)


def test_approximation_error():
    T = 24
    q, k = lsh.shared_qk(rand(1, 2, T, 8))
    v = rand(1, 2, T, 4, seed=3)
    exact_limit = lsh.LSHOptions(n_buckets=1, bucket_size=T, exclude_self=False)
    assert attnkit.approximation_error(q, k, v, backend="lsh", options=exact_limit) < 1e-12
    keep = lsh.self_exclusion(torch.ones(T, T, dtype=torch.bool))
    assert attnkit.approximation_error(q, k, v, backend="lsh", options=lsh.LSHOptions(n_buckets=1, bucket_size=T),
                                       reference_mask=keep, reference="sdpa") < 1e-12
    rows = attnkit.approximation_error(q, k, v, backend="linear", per_row=True)
    assert rows.shape == (1, 2, T) and (rows > 0).all()
    with pytest.raises(TypeError, match="backend"):
        attnkit.approximation_error(q, k, v, backend=None)
    with pytest.raises(ValueError, match="exact backend"):
        attnkit.approximation_error(q, k, v, backend="linear", reference="performer")
