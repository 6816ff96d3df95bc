"""Gated linear attention at the edges: NaN/Inf stay with the tokens that can see them (chunked and
recurrent, packed or not, forward and backward), per-channel gates without the delta rule, log-decays
far below exp's range, empty batches and the scale's validation."""

from __future__ import annotations

import pytest
import torch

import attnkit
from tests.gated_reference import gated_reference
from tests.test_gated_linear import make, rel_err

RULES = ("gated_delta", "kda", "ssd", "gla")


def gates(rule, B=1, Hk=2, Hv=2, T=17, Dk=8, Dv=8, **kw):
    """``make``'s inputs; ``gla``: per-channel gates without ``beta``."""
    q, k, v, g, beta = make("kda" if rule == "gla" else rule, B, Hk, Hv, T, Dk, Dv, **kw)
    return q, k, v, g, None if rule == "gla" else beta


# token 30 of a sequence of 40 holds the bad value; packed: sequences [0, 12), [12, 52), [52, 60)
PACKED = torch.tensor([0, 12, 52, 60])


def _bad_call(rule, method, what, value, packed):
    """The inputs with ``value`` at token 30 of one sequence (batch row 1, value head 2, or its key
    head), and the (B, Hv, T) mask of the outputs that can see it."""
    B, T, start = (1, 60, 12) if packed else (2, 40, 0)
    q, k, v, g, beta = gates(rule, B, 2, 4, T, 8, 6, seed=1)
    at, row = start + 30, B - 1
    x = {"q": q, "k": k, "v": v, "g": g, "beta": beta}[what].clone()
    head = 1 if what in ("q", "k") else 2  # key head 1 serves value heads 2 and 3
    x[row, head, at] = value
    seen = torch.zeros(B, 4, T, dtype=torch.bool)
    heads = slice(2, 4) if what in ("q", "k") else slice(2, 3)
    seen[row, heads, at : at + 1 if what == "q" else (52 if packed else T)] = True
    args = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    kw = {"method": method, "chunk_size": 16, "cu_seqlens": PACKED if packed else None, "check_gates": False,
          "return_state": True, "initial_state": torch.randn(3 if packed else B, 4, 8, 6) * 0.3}
    return args, {**args, what: x}, kw, seen


def _what_for(rule):
    return ["q", "k", "v", "g"] + (["beta"] if rule in ("gated_delta", "kda") else [])


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("method", ["chunked", "recurrent"])
@pytest.mark.parametrize("rule", RULES)
def test_a_nonfinite_token_reaches_only_the_outputs_that_see_it(rule, method, packed):
    for what in _what_for(rule):
        for value in (float("nan"), float("inf")):
            clean, bad, kw, seen = _bad_call(rule, method, what, value, packed)
            o_ref, s_ref = attnkit.gated_linear_attention(**clean, **kw)
            o, s = attnkit.gated_linear_attention(**bad, **kw)
            assert torch.isnan(o[seen]).all(), (what, value)
            torch.testing.assert_close(o[~seen], o_ref[~seen], rtol=1e-5, atol=1e-6, msg=f"{what}={value}")
            # the state of the sequence and value heads that absorbed the token is NaN (a bad query is
            # read, never absorbed), every other state is as it was
            hit = torch.zeros(s.shape[:2], dtype=torch.bool)
            if what != "q":
                hit[1, seen.any(0).any(-1)] = True
            assert torch.isnan(s[hit]).all(), (what, value)
            torch.testing.assert_close(s[~hit], s_ref[~hit], rtol=1e-5, atol=1e-6, msg=f"{what}={value}")


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("method", ["chunked", "recurrent"])
@pytest.mark.parametrize("rule", RULES)
def test_gradients_of_the_outputs_that_do_not_see_a_nan_are_finite_and_unchanged(rule, method, packed):
    for what in ("k", "v"):
        clean, bad, kw, seen = _bad_call(rule, method, what, float("nan"), packed)
        grads = []
        for args in (clean, bad):
            leaves = {name: x.detach().clone().requires_grad_() for name, x in args.items() if x is not None}
            o, _ = attnkit.gated_linear_attention(**{**args, **leaves}, **kw)
            (o[~seen] * torch.linspace(-1, 1, int((~seen).sum()))[:, None]).sum().backward()
            grads.append({name: x.grad for name, x in leaves.items()})
        for name, ref in grads[0].items():
            assert torch.isfinite(grads[1][name]).all(), (what, name)
            torch.testing.assert_close(grads[1][name], ref, rtol=1e-4, atol=1e-5, msg=f"{what}: d{name}")


@pytest.mark.parametrize("rule", ["gated_delta", "kda", "ssd"])
def test_finite_inputs_run_the_rule_as_given(rule):
    """The NaN/Inf policy costs finite inputs nothing but the scan: the chunked rule's own result."""
    from attnkit.backends.kernelized.gated import chunk_gated_delta_rule, chunk_kda, chunk_ssd

    q, k, v, g, beta = gates(rule, 2, 2, 2, 37, 8, 5, seed=2)
    o = attnkit.gated_linear_attention(q, k, v, g, beta, chunk_size=16, scale=1.0, native=False)
    if rule == "ssd":
        want, _ = chunk_ssd(q, k, v, g, chunk_size=16)
    else:
        want, _ = (chunk_kda if rule == "kda" else chunk_gated_delta_rule)(q, k, v, g, beta, chunk_size=16)
    assert torch.equal(o, want)


@pytest.mark.parametrize("method", ["chunked", "recurrent"])
def test_per_channel_gates_without_beta_run_gated_linear_attention(method):
    """``g (B, Hv, T, Dk)`` with ``beta=None``: ``S_t = Diag(exp(g_t)) S_{t-1} + k_t v_tᵀ``, packed or not,
    values and gradients against the float64 recurrence."""
    q, k, v, g, _ = gates("gla", 1, 1, 2, 45, 8, 6, seed=3)
    s0 = torch.randn(1, 2, 8, 6) * 0.5
    leaves = [x.requires_grad_() for x in (q, k, v, g, s0)]
    o, s = attnkit.gated_linear_attention(q, k, v, g, None, initial_state=s0, return_state=True, method=method,
                                          chunk_size=16)
    o_ref, s_ref = gated_reference(q, k, v, g, None, initial_state=s0)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    (o.square().sum() + s.sum()).backward()
    xs = [x.detach().double().requires_grad_() for x in leaves]
    o64, s64 = attnkit.gated_linear_attention(*xs[:4], None, initial_state=xs[4], return_state=True,
                                              method="recurrent")
    (o64.square().sum() + s64.sum()).backward()
    for a, b in zip(leaves, xs):
        assert rel_err(a.grad, b.grad) <= 1e-4
    cu = torch.tensor([0, 20, 45])
    packed = attnkit.gated_linear_attention(q, k, v, g, None, cu_seqlens=cu, method=method, chunk_size=16)
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        ref, _ = gated_reference(*(x[:, :, a:b] for x in (q, k, v, g)))
        assert rel_err(packed[:, :, a:b], ref) <= 1e-5
    assert "rule: gla (per-channel gates, no delta)" in attnkit.explain_gated(q, k, v, g)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("at, low", [(0, -1e16), (3, -1e16), (15, -1e16), (5, float("-inf"))])
def test_a_log_decay_far_below_exps_range_keeps_the_later_gates_exact(rule, at, low):
    """g = -1e16 (a valid log-decay: the state is forgotten; -inf too, unchecked) early in a chunk: the
    decays between the later tokens of the chunk stay exact, in the values and the gradients."""
    q, k, v, g, beta = gates(rule, 1, 1, 2, 40, 8, 4, seed=at)
    g = g.clone()
    g[:, :, at] = low
    leaves = [x.requires_grad_() for x in (q, k, v, g) + (() if beta is None else (beta,))]
    o = attnkit.gated_linear_attention(*leaves[:4], beta, chunk_size=16, check_gates=False)
    ref, _ = gated_reference(q, k, v, g, beta)
    assert rel_err(o, ref) <= 1e-5
    w = torch.linspace(-1, 1, o.shape[-1])
    (o * w).sum().backward()
    xs = [x.detach().double().requires_grad_() for x in leaves]
    o64 = attnkit.gated_linear_attention(*xs[:4], xs[4] if beta is not None else None, method="recurrent",
                                         check_gates=False)
    (o64 * w.double()).sum().backward()
    for a, b in zip(leaves, xs):
        assert torch.isfinite(a.grad).all() and rel_err(a.grad, b.grad) <= 1e-4


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("method", ["chunked", "recurrent"])
def test_an_empty_batch_gives_empty_outputs_and_states(rule, method):
    q, k, v, g, beta = gates(rule, 0, 1, 2, 20, 8, 6)
    xs = [x.requires_grad_() for x in (q, k, v)]
    o, s = attnkit.gated_linear_attention(*xs, g, beta, method=method, return_state=True)
    assert o.shape == (0, 2, 20, 6) and s.shape == (0, 2, 8, 6)
    o.sum().backward()
    assert all(x.grad.shape == x.shape for x in xs)
    o, s = attnkit.gated_linear_attention(q, k, v, g, beta, method=method, return_state=True,
                                          initial_state=torch.zeros(0, 2, 8, 6))
    assert o.shape == (0, 2, 20, 6) and s.shape == (0, 2, 8, 6)


@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                          (float("-inf"), ValueError), ("0.5", TypeError), (True, TypeError)])
def test_a_scale_attention_refuses_is_refused(scale, error):
    q, k, v, g, beta = gates("gated_delta")
    with pytest.raises(error, match=r"scale"):
        attnkit.gated_linear_attention(q, k, v, g, beta, scale=scale)
    with pytest.raises(error, match=r"scale"):
        attnkit.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [0.0, -0.5, 2])
def test_a_zero_negative_or_int_scale_means_what_it_says(scale):
    q, k, v, g, beta = gates("gated_delta")
    o = attnkit.gated_linear_attention(q, k, v, g, beta, scale=scale)
    assert rel_err(o, gated_reference(q, k, v, g, beta, scale=scale)[0]) <= 1e-5


@pytest.mark.parametrize("shape, match", [((1, 0, 2, 5, 8, 8), r"v: 2 value heads for 0 key heads"),
                                          ((1, 1, 1, 5, 0, 8), r"head dims"), ((1, 1, 1, 5, 8, 0), r"head dims")])
def test_no_key_heads_or_empty_head_dims_are_refused(shape, match):
    B, Hk, Hv, T, Dk, Dv = shape
    q, k, v = torch.randn(B, Hk, T, Dk), torch.randn(B, Hk, T, Dk), torch.randn(B, Hv, T, Dv)
    with pytest.raises(ValueError, match=match):
        attnkit.gated_linear_attention(q, k, v, -torch.rand(B, Hv, T), torch.rand(B, Hv, T))


@pytest.mark.parametrize("per_channel", [False, True])
def test_a_b_t_h_d_layout_is_named_as_the_layout_not_the_gate(per_channel):
    B, T, H, D = 2, 7, 3, 8  # q, k, v in (B, T, H, D), as many models keep them; g in the documented (B, H, T)
    q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
    g = -torch.rand(B, H, T, *((D,) if per_channel else ()))
    with pytest.raises(ValueError) as info:
        attnkit.gated_linear_attention(q, k, v, g)
    text = str(info.value)
    assert text.startswith("q, k, v:") and "(B, T, H, D)" in text and "transpose(1, 2)" in text, text


def test_a_transposed_gate_with_the_right_layout_is_named_as_the_gate():
    B, H, T, D = 2, 3, 7, 8
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    with pytest.raises(ValueError, match=r"^g: .*g.transpose\(1, 2\)"):
        attnkit.gated_linear_attention(q, k, v, -torch.rand(B, T, H))
