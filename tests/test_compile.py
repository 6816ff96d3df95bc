"""torch.compile on the native kernel: its operators trace (fake kernels, autograd through torch.library),
an attnkit GPT compiles with fullgraph=True and equals eager, and packed sequences compile without
graph breaks or recompiles as lengths change. ``aot_eager`` keeps the tests fast: it traces exactly what
inductor would (Dynamo and AOTAutograd), without generating code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit.backends import native
from attnkit.inputs import AttentionInputs
from attnkit.masks import Causal, SlidingWindow
from attnkit.nn.layers import TransformerConfig
from attnkit.nn.models import GPT

needs_build = pytest.mark.skipif(native.load_extension()[0] is None, reason=f"{native.load_extension()[1]}")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@needs_build
def test_gpt_compiles_fullgraph_on_native_and_equals_eager():
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=64, max_len=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            backend="native", sliding_window=9)
    model = GPT(cfg)
    x = torch.randint(0, 64, (2, 17))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    out = compiled(x)
    out.square().mean().backward()
    got = _grads(model)
    model.zero_grad()
    ref = model(x)
    ref.square().mean().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, _grads(model)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@needs_build
def test_native_operators_pass_opcheck():
    from attnkit.backends import native_ops
    from attnkit.score_mods import ALiBi, SoftCap

    torch.manual_seed(0)
    q = torch.randn(1, 4, 17, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 17, 8, requires_grad=True) for _ in range(2))
    inp = AttentionInputs.create(q, k, v, mask=Causal() & SlidingWindow(5, 0))
    plan = native.plan_for(inp, native.NativeOptions(8, 8))
    common = dict(q_offset=plan.q_offset, kv_offset=plan.kv_offset, **plan.mask, num_heads=4, Tq=17, Tk=17,
                  distance_vectors=True)
    no_mods = native_ops.kernel_spec(8**-0.5, **common)
    bias = torch.randn(1, 4, 1, 17).expand(1, 4, 17, 17)
    mods = native_ops.kernel_spec(8**-0.5, **common, bias=bias, score_mod=ALiBi(torch.rand(4)) >> SoftCap(2.0),
                                  sinks=torch.randn(4))
    assert mods.ints[native_ops.NUM_INTS_CHAIN_START:] == [native_ops.ADD, 0, 0, native_ops.CAP, 0, 0]
    tiles = (plan.block_q, plan.block_k)
    flags = torch.zeros(1, 2, 17, dtype=torch.uint8)
    flags[0, 1, 3] = 1

    def args(spec, bad):
        return (q, k, v, spec.tensors, spec.ints, spec.floats, *tiles, bad)

    for bad in (torch.empty(0, dtype=torch.uint8), flags):
        torch.library.opcheck(torch.ops.attnkit_native.forward.default, args(no_mods, bad))
    for spec in (no_mods, mods):
        out, lse, _ = torch.ops.attnkit_native.forward(*args(spec, flags))
        dout = torch.randn_like(out)
        detached = [x.detach() for x in (q, k, v)]
        for need in ((False, False), (True, True)):
            torch.library.opcheck(torch.ops.attnkit_native.backward.default,
                                  (*detached, dout, lse.detach(), (dout * out).sum(-1).detach(), spec.tensors,
                                   spec.ints, spec.floats, *tiles, *need))
    torch.library.opcheck(torch.ops.attnkit_native.forward.default, args(mods, flags))


@needs_build
def test_compiled_native_keeps_the_nonfinite_contract():
    # Traced, the kernel flags keys without a host read: a NaN key only later queries see, and a NaN
    # query, change exactly the rows they change eagerly.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    k[0, 1, 6] = float("nan")
    q[0, 0, 2] = float("inf")

    def f(q, k, v):
        return attnkit.attention(q, k, v, mask=Causal(), backend="native")

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    ref = f(q, k, v)
    assert torch.equal(got.isnan(), ref.isnan()) and got.isnan().any() and not got[0, 1, :6].isnan().any()
    torch.testing.assert_close(got.nan_to_num(7.0), ref.nan_to_num(7.0))


def _packed(lengths, H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return [torch.randn(total, H, D, generator=g).requires_grad_() for _ in range(3)], cu


@pytest.mark.slow
@needs_build
def test_varlen_compiles_fullgraph_on_native_without_recompiles():
    from torch._dynamo.utils import counters

    def f(q, k, v, cu, longest):
        return attnkit.varlen_attention(q, k, v, cu, cu, longest, longest, causal=True, backend="native")

    counters.clear()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    # totals and counts change; 255 and 256 leave a 1-wide and no ragged tile, 71 is one tile (no guard on any)
    for seed, lengths in enumerate(([50, 100, 17], [60, 1, 194], [30, 41], [100, 28, 120, 8], [130, 70])):
        (q, k, v), cu = _packed(lengths, seed=seed)
        out = compiled(q, k, v, cu, max(lengths))
        got = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref_out = f(q, k, v, cu, max(lengths))
        ref = torch.autograd.grad(ref_out.square().sum(), (q, k, v))
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for every length: no recompile


@needs_build
def test_compiled_native_runs_learnable_score_mods_and_sinks():
    """ALiBi with learnable slopes, a soft-cap and sinks through torch.compile(fullgraph=True): output and
    every gradient (slopes through the distance vectors, sinks through the LSE) equal eager."""
    from attnkit.score_mods import ALiBi, SoftCap

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 19, 8, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, 23, 8, generator=g).requires_grad_() for _ in range(2))
    slopes, sinks = torch.rand(4, generator=g).requires_grad_(), torch.randn(4, generator=g).requires_grad_()
    leaves = (q, k, v, slopes, sinks)

    def f(q, k, v, slopes, sinks):
        return attnkit.attention(q, k, v, mask=Causal(), score_mod=[ALiBi(slopes), SoftCap(3.0)], sinks=sinks,
                                 backend="native", options=native.NativeOptions(8, 8))

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    got_grads = torch.autograd.grad(got.square().sum(), leaves)
    ref = f(*leaves)
    ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _padded_or_packed(kind: str):
    """(model class, input_ids, keyword arguments) of a padded or packed batch."""
    g = torch.Generator().manual_seed(3)
    if kind == "padded":  # right padded: rows of 17 and 9 tokens
        attention_mask = torch.ones(2, 17, dtype=torch.long)
        attention_mask[1, 9:] = 0
        return GPT, torch.randint(0, 64, (2, 17), generator=g), {"attention_mask": attention_mask}
    if kind == "packed":  # three sequences in one row, each at its own positions
        return GPT, torch.randint(0, 64, (1, 30), generator=g), {"cu_seqlens": torch.tensor([0, 7, 19, 30])}
    if kind == "restarting positions":  # packed by the caller: positions restart, padding after the second
        positions = torch.cat([torch.arange(7), torch.arange(10)])[None].expand(2, -1)
        attention_mask = torch.ones(2, 17, dtype=torch.long)
        attention_mask[0, 14:] = 0
        return GPT, torch.randint(0, 64, (2, 17), generator=g), {"positions": positions,
                                                                  "attention_mask": attention_mask}
    # document ids: an encoder whose tokens attend within their document, and padding
    from attnkit.masks import Document
    from attnkit.nn.models import Encoder

    ids = torch.tensor([[0] * 6 + [1] * 11, [0] * 12 + [1] * 5])
    attention_mask = torch.ones(2, 17, dtype=torch.long)
    attention_mask[1, 15:] = 0
    return Encoder, torch.randint(0, 64, (2, 17), generator=g), {"mask": Document(ids),
                                                                  "attention_mask": attention_mask}


@needs_build  # without it, auto runs these masks on tiled, whose tile loop reads its tile grid on the host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["padded", "packed", "restarting positions", "document ids"])
def test_padded_and_packed_models_compile_without_graph_breaks(kind, dtype):
    # the mask path reads nothing on the host while traced (a density, a lengths check, an all-valid test)
    torch.manual_seed(0)
    cls, x, kwargs = _padded_or_packed(kind)
    cfg = TransformerConfig(vocab_size=64, max_len=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2)
    model = cls(cfg).to(dtype)
    explained = torch._dynamo.explain(model)(x, **kwargs)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    got = torch.compile(model, fullgraph=True, backend="aot_eager")(x, **kwargs)
    ref = model(x, **kwargs)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("backend", ["auto", pytest.param("native", marks=needs_build)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_precision_attention_compiles_and_equals_eager(dtype, backend):
    # forward and gradients under fullgraph, without a graph break, as eager within the dtype's rounding
    from attnkit.masks import KeyPadding

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 53, 16, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 53, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
    mask = (SlidingWindow(9, 0) & Causal()) & KeyPadding([50, 31])

    def f(q, k, v):
        return attnkit.attention(q, k, v, mask=mask, backend=backend)

    assert torch._dynamo.explain(f)(q, k, v).graph_break_count == 0
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    got_grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    ref = f(q, k, v)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 5e-3, "atol": 5e-3}
    torch.testing.assert_close(got, ref, **tol)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)


@needs_build
@pytest.mark.parametrize("mask", [Causal(), SlidingWindow(5, 3), SlidingWindow(7, 0) & Causal(),
                                  SlidingWindow(None, 4), SlidingWindow(3, 0) | SlidingWindow(0, 2)],
                         ids=["Causal", "SlidingWindow", "SlidingWindow&Causal", "SlidingWindow(None,4)", "Or"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_varlen_band_masks_compile_under_auto_without_graph_breaks(mask, dtype):
    (q, k, v), cu = _packed([30, 1, 75, 44], seed=5)
    q, k, v = (x.detach().to(dtype) for x in (q, k, v))

    def f(q, k, v, cu):
        return attnkit.varlen_attention(q, k, v, cu, cu, mask=mask)

    assert torch._dynamo.explain(f)(q, k, v, cu).graph_break_count == 0
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, cu)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, f(q, k, v, cu), **tol)
