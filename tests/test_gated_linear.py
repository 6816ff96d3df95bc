"""Gated linear attention (gated delta rule, KDA, SSD): chunked and recurrent against the float64
recurrence; gradients, low precision, extreme decays, state in/out, decoding, packed sequences."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.cache import StateCache
from tests.gated_reference import gated_reference

RULES = ("gated_delta", "kda", "ssd")


def make(rule, B=1, Hk=2, Hv=2, T=17, Dk=8, Dv=8, *, dtype=torch.float32, seed=0, low=-1.0, high=0.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hk, T, Dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, Hk, T, Dk, generator=gen), dim=-1)
    v = torch.randn(B, Hv, T, Dv, generator=gen)
    shape = (B, Hv, T, Dk) if rule == "kda" else (B, Hv, T)
    g = low + (high - low) * torch.rand(shape, generator=gen)
    beta = None if rule == "ssd" else torch.rand(B, Hv, T, generator=gen)
    return [x if x is None else x.to(dtype) for x in (q, k, v, g, beta)]


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("method", ["chunked", "recurrent"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 5, 3), (2, 1, 3, 97, 21, 11), (1, 2, 4, 40, 16, 9)],
                         ids=lambda s: "B{}-Hk{}-Hv{}-T{}-Dk{}-Dv{}".format(*s))
def test_matches_float64_recurrence(rule, method, shape):
    B, Hk, Hv, T, Dk, Dv = shape
    q, k, v, g, beta = make(rule, B, Hk, Hv, T, Dk, Dv, seed=T)
    s0 = torch.randn(B, Hv, Dk, Dv) * 0.5
    o, s = attnkit.gated_linear_attention(q, k, v, g, beta, initial_state=s0, return_state=True, method=method,
                                          chunk_size=16, qk_l2norm=rule != "ssd")
    o_ref, s_ref = gated_reference(q, k, v, g, beta, initial_state=s0, qk_l2norm=rule != "ssd")
    assert o.shape == (B, Hv, T, Dv) and o.dtype == torch.float32 and s.shape == (B, Hv, Dk, Dv)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5


@pytest.mark.parametrize("rule", RULES)
def test_gradients_match_float64(rule):
    q, k, v, g, beta = make(rule, 1, 1, 2, 29, 6, 5, seed=3)
    s0 = torch.randn(1, 2, 6, 5)
    leaves = [x for x in (q, k, v, g, beta, s0) if x is not None]
    grads = {}
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
        xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
        qq, kk, vv, gg, *rest = xs
        bb, ss = (rest[0], rest[1]) if beta is not None else (None, rest[0])
        o, s = attnkit.gated_linear_attention(qq, kk, vv, gg, bb, initial_state=ss, return_state=True,
                                              method="chunked" if name == "fp32" else "recurrent", chunk_size=8)
        (o * torch.linspace(-1, 1, o.shape[-1], dtype=dtype)).sum().backward(retain_graph=True)
        s.sum().backward()
        grads[name] = [x.grad for x in xs]
    for a, b in zip(grads["fp32"], grads["fp64"]):
        assert torch.isfinite(a).all()
        assert rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("rule", RULES)
def test_bfloat16_within_twice_a_bfloat16_recurrence(rule):
    q, k, v, g, beta = make(rule, 1, 2, 2, 70, 16, 16, seed=5, dtype=torch.bfloat16)
    o = attnkit.gated_linear_attention(q, k, v, g, beta)
    assert o.dtype == torch.bfloat16
    ref, _ = gated_reference(q, k, v, g, beta)
    lowp, _ = gated_reference(q, k, v, g, beta, dtype=torch.bfloat16)
    assert (o.double() - ref).abs().max() <= 2 * (lowp.to(torch.bfloat16).double() - ref).abs().max() + 1e-3


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("gates", [(-1e-7, 0.0), (-3e3, -1e2), "mixed"])
def test_extreme_decays_stay_exact_and_finite(rule, gates):
    q, k, v, g, beta = make(rule, 1, 1, 1, 50, 8, 4, seed=9)
    if gates == "mixed":  # near-0 decays next to near-1 decays, inside one chunk
        g = torch.where(torch.rand(g.shape, generator=torch.Generator().manual_seed(1)) < 0.2, -2e3, -1e-6)
    else:
        g = gates[0] + (gates[1] - gates[0]) * torch.rand(g.shape)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    o = attnkit.gated_linear_attention(q, k, v, g, beta, chunk_size=32)
    ref, _ = gated_reference(q, k, v, g, beta)
    assert rel_err(o, ref) <= 1e-5
    o.square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("rule", RULES)
def test_prefill_in_pieces_and_decode_equal_one_call(rule):
    q, k, v, g, beta = make(rule, 2, 1, 3, 23, 8, 6, seed=11)
    full = attnkit.gated_linear_attention(q, k, v, g, beta, qk_l2norm=True)
    cache = StateCache(lambda: attnkit.GatedLinearState(qk_l2norm=True))
    outs, start = [], 0
    for stop in (9, 10, 11, 12, 23):  # a chunked prefill, then one-token decode steps
        part = slice(start, stop)
        outs.append(cache.step(q[:, :, part], k[:, :, part], v[:, :, part], g=g[:, :, part],
                               beta=None if beta is None else beta[:, :, part]))
        start = stop
    assert cache.seq_len == 23
    assert rel_err(torch.cat(outs, dim=2), full.double()) <= 1e-5
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.state.state[0], cache.state.state[1])


def test_kv_cache_of_gated_states_decodes_each_layer():
    cache = attnkit.KVCache.gated(2, qk_l2norm=True)
    q, k, v, g, beta = make("gated_delta", 1, 1, 2, 6, 4, 4, seed=21)
    full = attnkit.gated_linear_attention(q, k, v, g, beta, qk_l2norm=True)
    for t in range(6):
        for layer in cache:
            out = layer.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], g=g[:, :, t : t + 1],
                             beta=beta[:, :, t : t + 1])
        assert rel_err(out, full[:, :, t : t + 1].double()) <= 1e-5
    assert cache.seq_len == 6 and cache[0].state is not cache[1].state
    cache.reset()
    assert cache.seq_len == 0 and cache[0].state.state is None


@pytest.mark.parametrize("rule", RULES)
def test_packed_sequences_restart_the_state(rule):
    lengths = [5, 0, 30, 1]
    q, k, v, g, beta = make(rule, 1, 2, 4, sum(lengths), 8, 7, seed=13)
    cu = torch.tensor([0, 5, 5, 35, 36])
    s0 = torch.randn(len(lengths), 4, 8, 7)
    o, s = attnkit.gated_linear_attention(q, k, v, g, beta, cu_seqlens=cu, initial_state=s0, return_state=True)
    assert s.shape == (4, 4, 8, 7)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        part = slice(a, b)
        o_ref, s_ref = gated_reference(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part],
                                       None if beta is None else beta[:, :, part], initial_state=s0[i : i + 1])
        if b > a:
            assert rel_err(o[:, :, part], o_ref) <= 1e-5
        assert rel_err(s[i : i + 1], s_ref) <= 1e-5


def test_rule_follows_the_gates_and_explain_says_so():
    for rule in RULES:
        q, k, v, g, beta = make(rule, 1, 1, 2, 3, 4, 4)
        text = attnkit.explain_gated(q, k, v, g, beta)
        assert f"rule: {rule}" in text and "shared by 2 value heads" in text


@pytest.mark.parametrize("change, match", [
    (lambda a: {**a, "g": a["g"].abs() + 0.1}, r"g: expected finite log-decays <= 0"),
    (lambda a: {**a, "g": a["g"].masked_fill(torch.ones_like(a["g"], dtype=torch.bool), float("-inf"))},
     r"g: expected finite"),
    (lambda a: {**a, "beta": a["beta"] + 1.5}, r"beta: expected values in \[0, 1\]"),
    (lambda a: {**a, "beta": a["beta"][..., :-1]}, r"beta: expected None"),
    (lambda a: {**a, "g": a["g"][:, :1]}, r"g: expected \(B, Hv, T\)"),
    (lambda a: {**a, "k": a["k"][..., :-1]}, r"q, k, v: expected q and k"),
    (lambda a: {**a, "v": a["v"][:, :3]}, r"v: 3 value heads for 2 key heads"),
    (lambda a: {**a, "initial_state": torch.zeros(1, 4, 8, 9)}, r"initial_state: expected"),
    (lambda a: {**a, "cu_seqlens": torch.tensor([0, 9, 5])}, r"cu_seqlens: expected non-decreasing"),
    (lambda a: {**a, "method": "fast"}, r"method: expected one of"),
])
def test_bad_input_names_the_argument(change, match):
    q, k, v, g, beta = make("gated_delta", 1, 2, 4, 9, 8, 8)
    args = change({"q": q, "k": k, "v": v, "g": g, "beta": beta})
    with pytest.raises(ValueError, match=match):
        attnkit.gated_linear_attention(**args)


@pytest.mark.parametrize("C", [1, 5, 16, 48])
@pytest.mark.parametrize("case", ["random", "identical_keys"])
def test_unit_lower_inverse_equals_the_inverse(C, case):
    from attnkit.backends.kernelized.gated.gated_delta import unit_lower_inverse

    gen = torch.Generator().manual_seed(C)
    if case == "random":
        a = torch.randn(3, C, C, generator=gen, dtype=torch.float64)
    else:  # β = 1 and one key repeated: the worst-conditioned chunk a normalized key sequence makes
        a = torch.ones(3, C, C, dtype=torch.float64)
    want = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + a.tril(-1))
    got = unit_lower_inverse(a.float())
    assert got.shape == (3, C, C)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("rule", RULES)
def test_recomputed_segments_give_the_same_values_and_gradients(rule):
    q, k, v, g, beta = make(rule, 1, 1, 2, 45, 8, 6, seed=17)
    s0 = torch.randn(1, 2, 8, 6)
    results = []
    for segment in (None, 16):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, g, s0)]
        o, s = attnkit.gated_linear_attention(*xs[:4], beta, initial_state=xs[4], return_state=True,
                                              chunk_size=8, recompute_segment=segment)
        (o.square().sum() + s.sum()).backward()
        results.append([o, s] + [x.grad for x in xs])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk, segment", [(4, 2), (16, 3)])
def test_chunked_gated_delta_backward_passes_gradcheck(chunk, segment):
    """The hand-written backward against finite differences, float64: partial last chunk, several
    segments, initial state in and final state out."""
    from attnkit.backends.kernelized.gated import chunk_gated_delta_rule

    q, k, v, g, beta = (x.double() for x in make("gated_delta", 1, 2, 2, 11, 3, 2, seed=chunk + segment))
    s0 = torch.randn(1, 2, 3, 2, dtype=torch.float64)
    xs = [x.requires_grad_() for x in (q, k, v, g, beta, s0)]

    def fn(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=chunk, segment=segment)

    assert torch.autograd.gradcheck(fn, xs)


@pytest.mark.parametrize("rule", ["gated_delta", "kda"])
def test_gradients_at_extreme_decays_match_float64(rule):
    q, k, v, g, beta = make(rule, 1, 1, 1, 40, 8, 4, seed=23)
    g = torch.where(torch.rand(g.shape, generator=torch.Generator().manual_seed(2)) < 0.3, -2e3, -1e-6)
    grads = []
    for dtype, method in ((torch.float32, "chunked"), (torch.float64, "recurrent")):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, g, beta)]
        o = attnkit.gated_linear_attention(*xs, method=method, chunk_size=16)
        (o * torch.linspace(-1, 1, o.shape[-1], dtype=dtype)).sum().backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-4


def test_bfloat16_gradients_within_three_times_a_bfloat16_recurrence():
    from attnkit.backends.kernelized.gated import recurrent_rule

    q, k, v, g, beta = make("gated_delta", 1, 1, 2, 40, 16, 16, seed=29)
    w = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(3))
    grads = {}
    for name, dtype, method in (("ref", torch.float64, "recurrent"), ("lowp", torch.bfloat16, "recurrent"),
                                ("ours", torch.bfloat16, "chunked")):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, g, beta)]
        if name == "lowp":  # the naive twin run in bfloat16 throughout: the low-precision yardstick
            o = recurrent_rule(xs[0] * 16**-0.5, *xs[1:])[0]
        else:
            o = attnkit.gated_linear_attention(*xs, method=method)
        (o * w.to(o.dtype)).sum().backward()
        grads[name] = [x.grad.double() for x in xs]
    for ours, lowp, ref in zip(grads["ours"], grads["lowp"], grads["ref"]):
        assert (ours - ref).abs().max() <= 3 * (lowp - ref).abs().max() + 1e-3


@pytest.mark.parametrize("grad", [False, True])
def test_chunked_gated_delta_in_segments_matches_float64(grad):
    """Several segments of chunks, inference (one segment kept) and training (every chunk kept)."""
    from attnkit.backends.kernelized.gated import chunk_gated_delta_rule

    q, k, v, g, beta = make("gated_delta", 2, 3, 3, 37, 8, 5, seed=31)
    s0 = torch.randn(2, 3, 8, 5)
    with torch.set_grad_enabled(grad):
        o, s = chunk_gated_delta_rule(q.requires_grad_(grad) * 8**-0.5, k, v, g, beta, initial_state=s0,
                                      chunk_size=4, segment=3)
    o_ref, s_ref = gated_reference(q, k, v, g, beta, initial_state=s0)
    assert o.requires_grad == grad
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
