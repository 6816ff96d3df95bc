"""Every exact backend under torch.compile, torch.func and autocast, on the inputs models produce
(non-contiguous, expanded), and on masks that keep nothing or reach far beyond the keys."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import BlockSparse, Causal, KeyPadding, SlidingWindow
from attnkit.backends import sliding_window as sw
from attnkit.backends.tiled import TiledOptions

from .reference import reference_attention as _reference
from .inputs import qkv


def reference_attention(*args, **kwargs):
    return _reference(*args, **kwargs)[0]

pytestmark = pytest.mark.filterwarnings("ignore")

# One mask per backend that it runs (structured backends need their structure).
MASKS = {
    "naive": Causal() & KeyPadding([50, 64]),
    "sdpa": Causal(),
    "tiled": Causal() & KeyPadding([50, 64]),
    "sliding_window": SlidingWindow(40, 0),
    "block_sparse": BlockSparse.bigbird(4, 16) & Causal(),
}
SMALL_TILES = {
    "tiled": TiledOptions(block_q=16, block_k=24),
    "sliding_window": sw.SlidingWindowOptions(chunk=16),  # the band spans several query chunks
}


def _inputs(B=2, H=2, T=64, D=16, seed=0, grad=True):
    return list(qkv(B, H, H, T, T, D, seed=seed, requires_grad=grad))


def _call(name):
    mask, options = MASKS[name], SMALL_TILES.get(name)
    return lambda q, k, v: attnkit.attention(q, k, v, mask=mask, backend=name, options=options)


def _grads(fn, tensors):
    for t in tensors:
        t.grad = None
    fn(*tensors).pow(2).sum().backward()
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("name", list(MASKS))
def test_compiled_gradients_equal_eager(name):
    """aot_eager traces the same graph inductor would compile; gradients must not change
    (overlapping strided views once gave wrong dK/dV when a graph break split them)."""
    torch._dynamo.reset()
    tensors = _inputs()
    eager = _grads(_call(name), tensors)
    compiled = _grads(torch.compile(_call(name), backend="aot_eager"), tensors)
    for e, c, what in zip(eager, compiled, "qkv"):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5, msg=f"{name}: d{what} compiled != eager")


@pytest.mark.parametrize("name", list(MASKS))
def test_backend_path_has_no_graph_break(name):
    q, k, v = _inputs(grad=False)
    attnkit.attention(q, k, v, mask=MASKS[name], backend=name)  # registry loaded outside the trace
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_call(name))(q, k, v)
    assert explanation.graph_break_count == 0, [str(r.reason)[:200] for r in explanation.break_reasons]


@pytest.mark.parametrize("name", list(MASKS))
def test_func_grad_and_vmap(name):
    q, k, v = _inputs(grad=False)
    fn = _call(name)
    gq = torch.func.grad(lambda q_: fn(q_, k, v).pow(2).sum())(q)
    qq = q.clone().requires_grad_()
    fn(qq, k, v).pow(2).sum().backward()
    torch.testing.assert_close(gq, qq.grad, rtol=1e-5, atol=1e-6)
    stacked = [torch.stack([x, x.flip(2)]) for x in (q, k, v)]  # a mapped dim of 2 in front
    mapped = torch.vmap(fn)(*stacked)
    looped = torch.stack([fn(*(x[i] for x in stacked)) for i in range(2)])
    torch.testing.assert_close(mapped, looped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(MASKS))
def test_autocast_output_dtype_is_the_same_for_every_backend(name):
    q, k, v = _inputs(grad=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _call(name)(q, k, v)
    assert out.dtype == torch.bfloat16
    ref = reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask=MASKS[name])
    assert (out.double() - ref).abs().max() < 0.05


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("layout", ["transposed", "expanded"])
def test_non_contiguous_and_expanded_inputs(name, layout):
    B, H, T, D = 2, 2, 64, 16
    if layout == "transposed":  # what MultiHeadAttention's (B, T, H, D) -> (B, H, T, D) produces
        q, k, v = (torch.randn(B, T, H, D).transpose(1, 2) for _ in range(3))
    else:  # one key/value head broadcast to every head without a copy
        q = torch.randn(B, H, T, D)
        k, v = (torch.randn(B, 1, T, D).expand(B, H, T, D) for _ in range(2))
    out = _call(name)(q, k, v)
    ref = reference_attention(q, k, v, mask=MASKS[name])
    assert (out.double() - ref).abs().max() < 1e-5


def test_block_sparse_all_blocks_off_still_backpropagates():
    q, k, v = _inputs(B=1, T=64)
    layout = BlockSparse(torch.zeros(2, 2, dtype=torch.bool), 32)
    out = attnkit.attention(q, k, v, mask=layout, backend="block_sparse")
    assert out.grad_fn is not None and out.abs().max() == 0
    out.sum().backward()
    assert all(t.grad is not None and t.grad.abs().max() == 0 for t in (q, k, v))


def test_sliding_window_wider_than_the_keys_uses_one_chunk(monkeypatch):
    """SlidingWindow(131072, 0) at n=2048 once allocated O(Tq * 131072) scores (1.6 GiB at B=H=1)."""
    seen = []
    real = sw._banded

    def spy(inp, band_mask, left, right, chunk, glob, *call):
        out = real(inp, band_mask, left, right, chunk, glob, *call)
        seen.append(chunk + left + right >= inp.Tk)
        return out

    monkeypatch.setattr(sw, "_banded", spy)
    x = torch.randn(1, 1, 512, 16)
    out = attnkit.attention(x, x, x, mask=SlidingWindow(131072, 0), backend="sliding_window")
    assert seen == [True]
    assert (out.double() - reference_attention(x, x, x, mask=Causal())).abs().max() < 1e-5


def test_sliding_window_far_offsets_compute_nothing(monkeypatch):
    """Queries a million positions after the keys keep nothing: zeros without a band over the gap."""
    monkeypatch.setattr(sw, "_banded", lambda *a: pytest.fail("the band must not run: no query reaches a key"))
    q, k, v = _inputs(B=1, T=64)
    out, lse = attnkit.attention(
        q, k, v, mask=SlidingWindow(256, 0), q_offset=1_000_000, backend="sliding_window", return_lse=True
    )
    assert out.abs().max() == 0 and torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().max() == 0


def test_sliding_window_partly_reachable_rows_match_the_reference():
    q, k, v = _inputs(B=1, T=64, grad=False)
    mask = SlidingWindow(8, 0)
    out = attnkit.attention(q, k, v, mask=mask, q_offset=60, kv_offset=0, backend="sliding_window")
    ref = reference_attention(q, k, v, mask=mask, q_offset=60, kv_offset=0)
    assert (out.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["tiled", "sliding_window", "block_sparse"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_non_finite_key_poisons_only_the_rows_that_attend_it(name, where):
    """NaN in a key that only later queries see must leave earlier rows exact (no 0 * NaN)."""
    q, k, v = _inputs(B=2, T=64, grad=False)
    poisoned = {"k": k.clone(), "v": v.clone()}
    poisoned[where][0, 0, 40] = float("nan")
    k2, v2 = poisoned["k"], poisoned["v"]
    out = attnkit.attention(q, k2, v2, mask=MASKS[name], backend=name, options=SMALL_TILES.get(name))
    keep = attnkit.as_mask(MASKS[name]).materialize(64, 64)
    sees = keep.expand(2, 2, 64, 64)[0, 0, :, 40]  # rows of batch 0, head 0 that attend key 40
    assert torch.isnan(out[0, 0][sees]).all(), "a row that attends a NaN key must be NaN"
    clean = attnkit.attention(q, k, v, mask=MASKS[name], backend=name, options=SMALL_TILES.get(name))
    torch.testing.assert_close(out[0, 0][~sees], clean[0, 0][~sees])
    torch.testing.assert_close(out[0, 1], clean[0, 1])  # the other head never saw it
    torch.testing.assert_close(out[1], clean[1])  # nor the other batch row
