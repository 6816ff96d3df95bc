"""The native gated kernel (``attnkit/csrc/gated.cpp``): every chunked rule (gated delta, KDA, SSD, GLA),
forward and backward, and the recurrent step of every rule, against the float64 recurrence.

Skipped where the gated family is not built (``attnkit build``); the PyTorch path it falls back to is
tested in ``test_gated_linear.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit.backends.kernelized.gated import explain_gated, kernel, recurrent_rule

pytestmark = pytest.mark.skipif(kernel.extension_reason() is not None,
                                reason=f"the gated kernel is not built: {kernel.extension_reason()}")


def make(B, H, T, Dk, Dv, *, per_channel=False, seed=0, dtype=torch.float64):
    """Prepared inputs (q scaled, heads matched) in float64, log-decays <= 0 and beta in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=gen, dtype=dtype) * Dk ** -0.5
    k = F.normalize(torch.randn(B, H, T, Dk, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=gen, dtype=dtype)
    shape = (B, H, T, Dk) if per_channel else (B, H, T)
    g = -F.softplus(torch.randn(shape, generator=gen, dtype=dtype) - 1)
    beta = torch.rand(B, H, T, generator=gen, dtype=dtype)
    state = torch.randn(B, H, Dk, Dv, generator=gen, dtype=dtype) * 0.3
    return q, k, v, g, beta, state


def rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


RULES = ["gated_delta", "kda", "ssd", "gla"]


def with_rule(rule, B, H, T, Dk, Dv, seed):
    """Inputs for ``rule``: per-channel gates for KDA and GLA, no beta for SSD and GLA."""
    q, k, v, g, beta, state = make(B, H, T, Dk, Dv, per_channel=rule in ("kda", "gla"), seed=seed)
    return q, k, v, g, beta if rule in ("gated_delta", "kda") else None, state


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T", [1, 17, 37, 127])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_kernel_equals_the_float64_recurrence(rule, T, with_state):
    """Output, final state and every gradient (q, k, v, g, beta, initial state) within 1e-5 relative
    of the float64 recurrence, over lengths that are not multiples of the chunk, B > 1 and odd dims."""
    q, k, v, g, beta, state = with_rule(rule, 2, 3, T, 21, 19, seed=T)
    state = state if with_state else None
    inputs64 = [x for x in (q, k, v, g, beta, state) if x is not None]
    for x in inputs64:
        x.requires_grad_()
    ref, ref_state = recurrent_rule(q, k, v, g, beta, state)
    gen = torch.Generator().manual_seed(1)
    d_o, d_state = torch.randn(ref.shape, generator=gen, dtype=ref.dtype), torch.randn(ref_state.shape, generator=gen,
                                                                                   dtype=ref.dtype)
    ref_grads = torch.autograd.grad((ref * d_o).sum() + (ref_state * d_state).sum(), inputs64)

    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    q32, k32, v32, g32 = inputs32[:4]
    b32 = inputs32[4] if beta is not None else None
    s32 = inputs32[-1] if with_state else None
    o, final = kernel.chunked(q32, k32, v32, g32, b32, s32, 16)
    assert o.dtype == final.dtype == torch.float32
    assert rel(o, ref) <= 1e-5 and rel(final, ref_state) <= 1e-5
    grads = torch.autograd.grad((o * d_o.float()).sum() + (final * d_state.float()).sum(), inputs32)
    for name, got, want in zip("q k v g beta state".split(), grads, ref_grads):
        assert rel(got, want) <= 1e-5, name


@pytest.mark.parametrize("rule", RULES)
def test_chunked_kernel_default_chunk_and_full_head_dim(rule):
    """The default chunk (64; 16 for per-channel gates) over a length with a partial last chunk, D = 128."""
    q, k, v, g, beta, _ = with_rule(rule, 1, 2, 130, 128, 128, seed=3)
    ref, ref_state = recurrent_rule(q, k, v, g, beta)
    o, final = kernel.chunked(q.float(), k.float(), v.float(), g.float(), None if beta is None else beta.float(), None)
    assert rel(o, ref) <= 1e-5 and rel(final, ref_state) <= 1e-5


@pytest.mark.parametrize("rule", ["gated_delta", "kda"])
def test_chunked_kernel_repeats_bitwise(rule):
    """Deterministic: the same call twice gives the same bits, forward and backward."""
    q, k, v, g, beta, state = (x.float() for x in with_rule(rule, 2, 2, 77, 16, 12, seed=5))

    def run():
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, state)]
        o, final = kernel.chunked(*xs, 16)
        (o.sum() + final.square().sum()).backward()
        return [o, final] + [x.grad for x in xs]

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("rule", RULES)
def test_chunked_kernel_under_inference_mode_on_every_thread(rule):
    """Under torch.inference_mode() the inputs are inference tensors; the kernel's worker threads do not
    inherit the mode, and updating such a tensor in place outside it is an error. Every (batch, head) on
    a thread of its own, with the state given: the same result as under no_grad."""
    q, k, v, g, beta, state = (x.float() if x is not None else None for x in with_rule(rule, 2, 3, 70, 16, 12, seed=6))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            ref = kernel.chunked(q, k, v, g, beta, state, 16)
        with torch.inference_mode():
            args = [None if x is None else x.clone() for x in (q, k, v, g, beta, state)]  # inference tensors
            got = kernel.chunked(*args, 16)
            out, final = attnkit.gated_linear_attention(*args[:5], initial_state=args[5], return_state=True)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert torch.isfinite(out).all() and final is not None


def test_gated_linear_attention_runs_the_kernel_by_default():
    """Float32 runs the kernel for every rule (explain says so), equal to the PyTorch path; bf16
    inputs are computed in float32; float64 and native=False run the PyTorch path with the reason."""
    q, k, v, g, beta, _ = (x.float() for x in make(2, 2, 37, 16, 16, seed=6))
    assert "kernel: native gated kernel (the chunked kernel" in explain_gated(q, k, v, g, beta)
    calls = []
    real = kernel.chunked
    kernel.chunked = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        o = attnkit.gated_linear_attention(q, k, v, g, beta)
        o_ssd = attnkit.gated_linear_attention(q, k, v, g, None)
        kda_gates = g[..., None] * torch.linspace(0.5, 1.5, 16)  # (B, H, T, Dk)
        o_kda = attnkit.gated_linear_attention(q, k, v, kda_gates, beta)
        o_bf16 = attnkit.gated_linear_attention(*(x.bfloat16() for x in (q, k, v, g, beta)))
    finally:
        kernel.chunked = real
    assert len(calls) == 4
    assert torch.allclose(o_kda, attnkit.gated_linear_attention(q, k, v, kda_gates, beta, native=False), atol=1e-5)
    assert "kernel: native gated kernel" in explain_gated(q, k, v, kda_gates, beta)
    assert torch.allclose(o, attnkit.gated_linear_attention(q, k, v, g, beta, native=False), atol=1e-5)
    assert torch.allclose(o_ssd, attnkit.gated_linear_attention(q, k, v, g, None, native=False), atol=1e-5)
    want = attnkit.gated_linear_attention(*(x.bfloat16() for x in (q, k, v, g, beta)), native=False)
    assert o_bf16.dtype == torch.bfloat16 and torch.allclose(o_bf16.float(), want.float(), atol=2e-2)
    declined = explain_gated(q.double(), k, v, g, beta)
    assert "declines: float32 compute only, the compute dtype here is float64" in declined
    assert "native=False" in explain_gated(q, k, v, g, beta, native=False)
    with pytest.raises(ValueError, match="native=True.*float64"):
        attnkit.gated_linear_attention(q.double(), k, v, g, beta, native=True)
    with pytest.raises(TypeError, match="native: expected"):
        attnkit.gated_linear_attention(q, k, v, g, beta, native="yes")


@pytest.mark.parametrize("rule", ["gated_delta", "kda", "ssd", "gla"])
def test_step_equals_the_recurrence_and_updates_the_state_in_place(rule):
    q, k, v, g, beta, state = make(2, 3, 3, 21, 19, per_channel=rule in ("kda", "gla"), seed=7)
    beta = beta if rule in ("gated_delta", "kda") else None
    ref, ref_state = recurrent_rule(q, k, v, g, beta, state)
    S = state.float().clone()
    storage = S.data_ptr()
    o = kernel.step(q.float(), k.float(), v.float(), g.float(), None if beta is None else beta.float(), S)
    assert S.data_ptr() == storage
    assert rel(o, ref) <= 1e-5 and rel(S, ref_state) <= 1e-5


@pytest.mark.parametrize("rule", ["gated_delta", "kda", "ssd", "gla"])
def test_cached_decoding_equals_a_full_forward(rule):
    """Prefill (chunked) then one-token steps (the kernel's step) through GatedLinearState equal one
    call over the whole sequence, outputs and state."""
    q, k, v, g, beta, _ = (x.float() for x in make(2, 4, 40, 16, 12, per_channel=rule in ("kda", "gla"), seed=8))
    beta = beta if rule in ("gated_delta", "kda") else None
    full, full_state = attnkit.gated_linear_attention(q, k, v, g, beta, return_state=True)
    cache = attnkit.GatedLinearState()
    assert "the recurrent step" in explain_gated(q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1],
                                                 None if beta is None else beta[:, :, :1])
    calls = []
    real = kernel.step
    kernel.step = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        with torch.no_grad():
            parts = [cache.step(q[:, :, :37], k[:, :, :37], v[:, :, :37], g=g[:, :, :37],
                                beta=None if beta is None else beta[:, :, :37])]
            for t in range(37, 40):
                parts.append(cache.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], g=g[:, :, t:t + 1],
                                        beta=None if beta is None else beta[:, :, t:t + 1]))
    finally:
        kernel.step = real
    assert len(calls) == 3
    assert (torch.cat(parts, dim=2) - full).abs().max() <= 1e-5 * full.abs().max()
    assert (cache.state - full_state).abs().max() <= 1e-5 * full_state.abs().max()


def test_step_under_autograd_runs_the_differentiable_recurrence():
    q, k, v, g, beta, _ = (x.float().requires_grad_() for x in make(1, 2, 1, 8, 8, seed=9))
    assert "the recurrent step has no backward" in explain_gated(q, k, v, g, beta)
    o = attnkit.gated_linear_attention(q, k, v, g, beta)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("native", [None, False])
def test_state_in_place_overwrites_the_given_state(native):
    """``state_in_place=True`` writes the final state into ``initial_state`` (the same storage), equal to
    the returned state of a plain call, on the kernel's step and on the PyTorch paths."""
    q, k, v, g, beta, state = (x.float() for x in make(2, 3, 5, 8, 6, seed=10))
    for T in (1, 5):
        want_o, want_state = attnkit.gated_linear_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], g[:, :, :T],
                                                            beta[:, :, :T], initial_state=state, return_state=True,
                                                            native=native)
        S = state.clone()
        o, final = attnkit.gated_linear_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], g[:, :, :T], beta[:, :, :T],
                                                  initial_state=S, return_state=True, state_in_place=True,
                                                  native=native)
        assert final is S and torch.allclose(S, want_state, atol=1e-6) and torch.allclose(o, want_o, atol=1e-6)
    with pytest.raises(ValueError, match="state_in_place=True"):
        attnkit.gated_linear_attention(q, k, v, g, beta, state_in_place=True)


def test_the_kernel_compiles_with_fullgraph():
    """The ops carry fake kernels: ``torch.compile(fullgraph=True)`` traces the chunked kernel, forward
    and backward, and the step, with the eager results."""
    q, k, v, g, beta, state = (x.float() for x in make(1, 2, 37, 16, 8, seed=11))
    chunked = torch.compile(lambda *x: kernel.chunked(*x, None, 16), fullgraph=True)
    xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, final = chunked(*xs)
    o.sum().backward()
    want = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o_eager, final_eager = kernel.chunked(*want, None, 16)
    o_eager.sum().backward()
    assert torch.allclose(o, o_eager, atol=1e-6) and torch.allclose(final, final_eager, atol=1e-6)
    assert all(torch.allclose(a.grad, b.grad, atol=1e-5) for a, b in zip(xs, want))
    step = torch.compile(kernel.step, fullgraph=True)
    S1, S2 = state.clone(), state.clone()
    one = [x[:, :, :1] for x in (q, k, v, g, beta)]
    assert torch.allclose(step(*one, S1), kernel.step(*one, S2), atol=1e-6) and torch.allclose(S1, S2, atol=1e-6)


@pytest.mark.parametrize("rule", ["gated_delta", "gla"])
def test_chunked_kernel_over_several_segments(rule):
    """A sequence longer than one segment of chunks (the kernel works through about 1 MiB of q, k, v
    at a time: 42 chunks of 16 at D = 128, so 1500 tokens make 3 segments, the last partial), with an
    initial state: output, final state and gradients equal the float64 recurrence."""
    q, k, v, g, beta, state = with_rule(rule, 1, 1, 1500, 128, 128, seed=12)
    inputs64 = [x.requires_grad_() for x in (q, k, v, g, beta, state) if x is not None]
    ref, ref_state = recurrent_rule(q, k, v, g, beta, state)
    ref_grads = torch.autograd.grad(ref.sum() + ref_state.square().sum(), inputs64)
    inputs32 = [x.detach().float().requires_grad_() for x in inputs64]
    o, final = kernel.chunked(*inputs32[:4], inputs32[4] if beta is not None else None, inputs32[-1], 16)
    assert rel(o, ref) <= 1e-5 and rel(final, ref_state) <= 1e-5
    grads = torch.autograd.grad(o.sum() + final.square().sum(), inputs32)
    assert all(rel(a, b) <= 1e-5 for a, b in zip(grads, ref_grads))
