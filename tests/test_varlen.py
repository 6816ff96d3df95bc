"""varlen_attention: packed sequences equal each sequence run alone, on every exact backend that runs them."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding, SlidingWindow, varlen_attention
from attnkit.inputs import AttentionInputs
from attnkit.score_mods import ALiBi, CustomScoreMod, RelativeBias, SoftCap

from .reference import flash_rule_ok, max_error, reference_attention, reference_attention_lowp


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _packed(lengths_q, lengths_k, Hq=4, Hkv=2, D=9, Dv=7, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), Hq, D, generator=g).to(dtype)
    k = torch.randn(sum(lengths_k), Hkv, D, generator=g).to(dtype)
    v = torch.randn(sum(lengths_k), Hkv, Dv, generator=g).to(dtype)
    return q, k, v


def _per_sequence(fn, q, k, v, cu_q, cu_k, *, width=None, fill=0.0):
    """fn over each sequence alone in (1, H, T, D), concatenated back to the packed layout; a sequence
    without keys gives ``fill`` (its rows see nothing), one without queries nothing."""
    outs = []
    for i in range(cu_q.numel() - 1):
        a, b, c, d = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        if a == b:
            continue
        if c == d:
            outs.append(torch.full((b - a, q.shape[1], width or v.shape[-1]), fill, dtype=torch.float64))
            continue
        qi, ki, vi = (x.transpose(0, 1).unsqueeze(0) for x in (q[a:b], k[c:d], v[c:d]))
        outs.append(fn(qi, ki, vi).squeeze(0).transpose(0, 1).to(torch.float64))
    return torch.cat(outs)


SAME = ([1, 17, 37, 0, 5], None)
DIFFERENT = ([1, 3, 17, 2, 4], [5, 3, 37, 9, 0])  # Tq < Tk, Tq == Tk, and a sequence with no keys
MASKS = {"none": None, "causal": Causal(), "window": SlidingWindow(3, 1),
         "window-or-causal": Causal() | SlidingWindow(0, 2)}


def _backends():
    """The exact backends that run both forms of a varlen call (Document & band; Custom) with the LSE."""
    x = torch.zeros(1, 4, 8, 8)
    forms = [attnkit.Document(torch.zeros(8, dtype=torch.long)) & Causal(), attnkit.Custom(lambda b, h, q, k: q >= k)]
    inputs = [AttentionInputs.create(x, x, x, mask=m, q_offset=0, kv_offset=0, return_lse=True) for m in forms]
    return [name for name, impl in attnkit.list_backends().items()
            if impl.exact and impl.available() and not any(impl.not_supported_reasons(inp) for inp in inputs)]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("layout", ["same", "different"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_varlen_equals_each_sequence_alone(backend, layout, mask_name):
    lengths_q, lengths_k = SAME if layout == "same" else DIFFERENT
    lengths_k = lengths_k or lengths_q
    q, k, v = _packed(lengths_q, lengths_k)
    cu_q = _cu(lengths_q)
    cu_k = cu_q if layout == "same" else _cu(lengths_k)
    mask = MASKS[mask_name]
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), mask=mask, backend=backend,
                                return_lse=True)
    assert out.shape == (sum(lengths_q), 4, 7) and lse.shape == (4, sum(lengths_q))
    ref = _per_sequence(lambda a, b, c: reference_attention(a, b, c, mask=mask)[0], q, k, v, cu_q, cu_k)
    lowp = _per_sequence(lambda a, b, c: reference_attention_lowp(a, b, c, mask=mask)[0], q, k, v, cu_q, cu_k)
    assert flash_rule_ok(max_error(out, ref), max_error(lowp, ref), factor=2, dtype=q.dtype)
    ref_lse = _per_sequence(lambda a, b, c: reference_attention(a, b, c, mask=mask)[1][..., None], q, k, v, cu_q,
                            cu_k, width=1, fill=float("-inf"))[..., 0].T
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))  # rows with no key (empty key sequence, window) are -inf
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-5)


@pytest.mark.parametrize("layout", ["same", "different"])
def test_varlen_gradients_equal_each_sequence_alone(layout):
    lengths_q, lengths_k = SAME if layout == "same" else DIFFERENT
    lengths_k = lengths_k or lengths_q
    q, k, v = (x.double().requires_grad_() for x in _packed(lengths_q, lengths_k, seed=3))
    cu_q = _cu(lengths_q)
    cu_k = cu_q if layout == "same" else _cu(lengths_k)
    dout = torch.randn(sum(lengths_q), 4, 7, dtype=torch.float64)
    out = varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, mask=Causal())
    grads = torch.autograd.grad(out.double(), (q, k, v), dout)
    ref = _per_sequence(lambda a, b, c: reference_attention(a, b, c, mask=Causal())[0], q, k, v, cu_q, cu_k)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for g, r in zip(grads, ref_grads):
        assert torch.isfinite(g).all()
        assert (g - r).abs().max() < 1e-4


@pytest.mark.parametrize("layout", ["same", "different"])
def test_varlen_score_mods_and_sinks_restart_per_sequence(layout):
    lengths_q, lengths_k = SAME if layout == "same" else DIFFERENT
    lengths_k = lengths_k or lengths_q
    q, k, v = _packed(lengths_q, lengths_k, seed=5)
    cu_q = _cu(lengths_q)
    cu_k = cu_q if layout == "same" else _cu(lengths_k)
    alibi, sinks = ALiBi.geometric(4), torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = varlen_attention(q, k, v, cu_q, cu_k, causal=True, score_mod=alibi, sinks=sinks)
    alone = _per_sequence(lambda a, b, c: attnkit.attention(a, b, c, mask=Causal(), score_mod=alibi, sinks=sinks,
                                                            backend="naive"), q, k, v, cu_q, cu_k)
    assert (out - alone).abs().max() < 1e-5


def test_varlen_causal_is_bottom_right_per_sequence():
    # one sequence, 2 queries and 5 keys: the first query sees keys 0..3 (the docstring's drawing)
    q, k, v = _packed([2], [5], Hq=1, Hkv=1, D=4, Dv=5)
    v = torch.eye(5)[:, None, :]  # the output row is the attention weights
    out = varlen_attention(q, k, v, _cu([2]), _cu([5]), causal=True)
    assert torch.equal(out[:, 0] > 0, torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))


def test_varlen_refuses_bad_input_clearly():
    q, k, v = _packed([3, 4], [3, 4])
    cu = _cu([3, 4])
    with pytest.raises(ValueError, match="cu_seqlens_q.*from 0 to the packed length 7"):
        varlen_attention(q, k, v, torch.tensor([1, 3, 7]), cu)
    with pytest.raises(ValueError, match="cu_seqlens_k.*non-decreasing"):
        varlen_attention(q, k, v, cu, torch.tensor([0, 5, 4, 7]))
    with pytest.raises(TypeError, match="cu_seqlens_q: expected a 1-D int32/int64"):
        varlen_attention(q, k, v, cu.float(), cu)
    with pytest.raises(ValueError, match="q: expected a packed \\(total_tokens, H, D\\)"):
        varlen_attention(q[None], k, v, cu, cu)
    with pytest.raises(ValueError, match="mask: .*band masks"):
        varlen_attention(q, k, v, cu, cu, mask=KeyPadding([3]))
    with pytest.raises(ValueError, match="causal=True together with mask="):
        varlen_attention(q, k, v, cu, cu, mask=Causal(), causal=True)
    with pytest.raises(ValueError, match="2 sequences, cu_seqlens_k 1"):
        varlen_attention(q, k, v, cu, torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        varlen_attention(q, k, v, cu, cu, max_seqlen_q=-1)



EMPTY = {  # (lengths_q, lengths_k or None for one cu_seqlens): a side with no tokens at all
    "no keys": ([3, 2, 0], [0, 0, 0]),
    "no queries": ([0, 0, 0], [4, 2, 0]),
    "nothing, one cu_seqlens": ([0, 0], None),
    "nothing, two cu_seqlens": ([0, 0], [0, 0]),
}


@pytest.mark.parametrize("backend", [*_backends(), "sdpa"])
@pytest.mark.parametrize("case", list(EMPTY))
def test_varlen_with_an_empty_side_gives_fully_masked_rows(backend, case):
    """No keys anywhere: every query sees nothing (output 0, LSE -inf, zero finite gradients); no
    queries anywhere: an empty output. Both as flash-attn's layout allows, on every backend."""
    lengths_q, lengths_k = EMPTY[case]
    q, k, v = (x.requires_grad_() for x in _packed(lengths_q, lengths_k or lengths_q, seed=11))
    cu_q = _cu(lengths_q)
    cu_k = cu_q if lengths_k is None else _cu(lengths_k)
    with_lse = backend != "sdpa"  # sdpa returns no LSE
    result = varlen_attention(q, k, v, cu_q, cu_k, causal=True, backend=backend, return_lse=with_lse)
    out, lse = result if with_lse else (result, None)
    assert out.shape == (sum(lengths_q), 4, 7)
    assert torch.equal(out, torch.zeros_like(out))
    if with_lse:
        assert lse.shape == (4, sum(lengths_q)) and bool((lse == float("-inf")).all())
    grads = torch.autograd.grad(out.sum() * 2.0, (q, k, v), allow_unused=False)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and torch.equal(g, torch.zeros_like(g))


def test_varlen_messages_name_the_packed_dimensions():
    q, k, v = _packed([3, 4], [3, 4])
    cu = _cu([3, 4])
    with pytest.raises(ValueError, match=r"v: expected shape \(total_k, Hkv, Dv\) with total_k=7, Hkv=2.*got \(6, 2"):
        varlen_attention(q, k, v[:6], cu, cu)
    with pytest.raises(ValueError, match=r"D \(q.shape\[2\]\): expected a head dim of at least 1, got 0"):
        varlen_attention(q[..., :0], k[..., :0], v, cu, cu)
    with pytest.raises(ValueError, match=r"Dv \(v.shape\[2\]\): expected a head dim of at least 1, got 0"):
        varlen_attention(q, k, v[..., :0], cu, cu)


def _score_mod_backends():
    """The backends of :func:`_backends` that run a built-in score modifier, forward and backward, on a
    packed stream."""
    x = torch.zeros(1, 4, 32, 8, requires_grad=True)
    inp = AttentionInputs.create(x, x, x, mask=attnkit.Document(torch.zeros(32, dtype=torch.long)) & Causal(),
                                 q_offset=0, kv_offset=0, return_lse=True, score_mod=ALiBi.geometric(4))
    return [b for b in _backends() if not any(attnkit.list_backends()[b].not_supported_reasons(inp))]


def _mods():
    table = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    return {"softcap": SoftCap(1.5), "alibi": ALiBi.geometric(4),
            "relative bias": RelativeBias(table, max_distance=16, bidirectional=True),
            "alibi >> softcap": ALiBi.geometric(4) >> SoftCap(2.0)}


@pytest.mark.parametrize("backend", _score_mod_backends())
@pytest.mark.parametrize("layout", ["same", "different"])
@pytest.mark.parametrize("mod_name", list(_mods()))
def test_varlen_built_in_score_mods_run_on_every_backend_per_sequence(backend, layout, mod_name):
    """Soft-caps, ALiBi and relative biases reach the backend as themselves (native runs them in its
    kernel), in each sequence's own positions; forward, LSE and gradients equal each sequence alone."""
    lengths_q, lengths_k = SAME if layout == "same" else DIFFERENT
    lengths_k = lengths_k or lengths_q
    q, k, v = (x.double().requires_grad_() for x in _packed(lengths_q, lengths_k, seed=13))
    cu_q = _cu(lengths_q)
    cu_k = cu_q if layout == "same" else _cu(lengths_k)
    mod = _mods()[mod_name]
    mask = SlidingWindow(6, 0)
    out, lse = varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, mask=mask, score_mod=mod,
                                backend=backend, return_lse=True)

    def alone(a, b, c):
        return attnkit.attention(a, b, c, mask=mask, score_mod=mod, backend="naive", return_lse=True)

    ref = _per_sequence(lambda a, b, c: alone(a, b, c)[0], q, k, v, cu_q, cu_k)
    ref_lse = _per_sequence(lambda a, b, c: alone(a, b, c)[1][..., None], q, k, v, cu_q, cu_k, width=1,
                            fill=float("-inf"))[..., 0].T
    assert (out.double() - ref).abs().max() < 1e-5
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-5)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out.double(), (q, k, v), dout)
    for g, r in zip(grads, torch.autograd.grad(ref, (q, k, v), dout)):
        assert (g - r).abs().max() < 1e-4


def test_varlen_custom_score_mod_still_sees_each_sequence_positions():
    lengths_q, lengths_k = DIFFERENT
    q, k, v = _packed(lengths_q, lengths_k, seed=17)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    mod = CustomScoreMod(lambda s, b, h, qi, ki: s - 0.3 * (qi - ki).abs() + 0.01 * qi, name="distance and position")
    out = varlen_attention(q, k, v, cu_q, cu_k, causal=True, score_mod=mod)
    ref = _per_sequence(lambda a, b, c: attnkit.attention(a.double(), b.double(), c.double(), mask=Causal(),
                                                          score_mod=mod, backend="naive"), q, k, v, cu_q, cu_k)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("layout", ["same", "different"])
def test_varlen_without_lse_on_the_default_choice(backend, layout):
    lengths_q, lengths_k = SAME if layout == "same" else DIFFERENT
    lengths_k = lengths_k or lengths_q
    q, k, v = _packed(lengths_q, lengths_k, seed=7)
    cu_q = _cu(lengths_q)
    cu_k = cu_q if layout == "same" else _cu(lengths_k)
    out = varlen_attention(q, k, v, cu_q, cu_k, mask=SlidingWindow(4, 0), backend=backend)
    ref = _per_sequence(lambda a, b, c: reference_attention(a, b, c, mask=SlidingWindow(4, 0))[0], q, k, v, cu_q, cu_k)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.slow
def test_varlen_compiles_once_over_changing_lengths():
    """Under torch.compile(dynamic=True) new lengths and offsets reuse the graph (at most one recompile)."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounter()

    def step(q, k, v, cu):
        return varlen_attention(q, k, v, cu, cu, causal=True, backend="naive")

    compiled = torch.compile(step, backend=counter, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        lengths = torch.randint(20, 60, (3,), generator=g).tolist()
        q, k, v = _packed(lengths, lengths, seed=len(lengths))
        cu = _cu(lengths)
        out = compiled(q, k, v, cu)
        assert (out - step(q, k, v, cu)).abs().max() < 1e-5
    assert counter.frame_count <= 2, counter.frame_count
