"""The native decode kernel over every cache format against the float64 oracle: dense fp32/bf16,
int8, paged and paged-int8 handles; odd and ragged lengths; GQA; Tq 1..16; masks; ALiBi, soft-cap
and sinks; NaN in unwritten slots; bitwise batch invariance; skipped (with the reason) when the
extension is not built."""

from __future__ import annotations

import pytest
import torch

from attnkit import Causal, KeyPadding, SlidingWindow, attention, explain
from attnkit.score_mods import ALiBi, RelativeBias, SoftCap
from attnkit.backends.decode import DecodeOptions
from attnkit.backends.decode_native import _extension, split_tokens
from attnkit.cache import quantize_int8
from attnkit.kv_handle import KVHandle

from .reference import FLOOR, keep_grid

_REASON = _extension()[1]
native = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))

FORMATS = ["dense", "int8", "paged", "paged-int8"]


def _handle(fmt: str, k, v, lengths, *, block_size=16, seed=0):
    """K/V ``(B, Hkv, S, D)`` stored as ``fmt``; slots past each row's length (and unused pages)
    hold NaN, or NaN scales for int8. Returns (what attention reads as k/v, the dense values)."""
    B, Hkv, S, D = k.shape
    if fmt == "dense":
        return (k, v), (k, v)
    quant = fmt.endswith("int8")
    parts = []
    for x in (k, v):
        if quant:
            vals, sc = quantize_int8(x)
            parts.append([vals, sc])
        else:
            parts.append([x.clone(), None])
    dense = [p[0].float() * p[1][..., None] if quant else p[0] for p in parts]
    for p in parts:  # poison the unwritten slots
        for b, L in enumerate(lengths):
            if quant:
                p[1][b, :, L:] = float("nan")
            else:
                p[0][b, :, L:] = float("nan")
    if not fmt.startswith("paged"):
        h = KVHandle("int8", parts[0][0], parts[1][0], tuple(lengths), torch.float32, True, parts[0][1], parts[1][1])
        return (h, h), dense
    nb = -(-S // block_size)
    g = torch.Generator().manual_seed(seed)
    N = B * nb + 3  # spare pages, never referenced
    table = torch.randperm(N, generator=g)[: B * nb].view(B, nb)
    pools = []
    for x in [parts[0][0], parts[1][0]] + ([parts[0][1], parts[1][1]] if quant else []):
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, nb * block_size - S))
        pool = torch.full((Hkv, N, block_size, *x.shape[3:]), float("nan")) if x.is_floating_point() else \
            torch.zeros((Hkv, N, block_size, *x.shape[3:]), dtype=x.dtype)
        pool = pool.to(x.dtype)
        pool[:, table.flatten()] = x.view(B, Hkv, nb, block_size, *x.shape[3:]).transpose(0, 1).reshape(
            Hkv, B * nb, block_size, *x.shape[3:])
        pools.append(pool)
    h = KVHandle(fmt, pools[0], pools[1], tuple(lengths), k.dtype if not quant else torch.float32, True,
                 *(pools[2:] if quant else (None, None)), block_table=table)
    return (h, h), dense


def _reference(q, k, v, lengths, mask, score_mod, sinks, dtype):
    """Per row: attention of its last ``Tq`` positions over its ``L`` keys, every op in ``dtype``."""
    B, Hq, Tq, D = q.shape
    Hkv = k.shape[1]
    outs = []
    for b, L in enumerate(lengths):
        qb = q[b:b + 1].to(dtype) * D**-0.5
        kb = k[b:b + 1, :, :L].to(dtype).repeat_interleave(Hq // Hkv, 1)
        vb = v[b:b + 1, :, :L].to(dtype).repeat_interleave(Hq // Hkv, 1)
        s = qb @ kb.transpose(-1, -2)  # (1, Hq, Tq, L)
        if score_mod is not None:
            s = score_mod.evaluate(s, (L - Tq, L), (0, L), 1, Hq)
        keep = keep_grid(mask, 1, Hq, Tq, L, q_offset=L - Tq, kv_offset=0, device=q.device)
        s = s.masked_fill(~keep, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.to(dtype).view(1, Hq, 1, 1).expand(1, Hq, Tq, 1)], -1)
            vb = torch.cat([vb, vb.new_zeros(1, Hq, 1, vb.shape[-1])], -2)
        mx = s.amax(-1, keepdim=True)
        mx = torch.where(torch.isinf(mx), 0.0, mx)
        e = torch.exp(s - mx)
        den = e.sum(-1, keepdim=True)
        outs.append((e @ vb) / torch.where(den == 0, 1.0, den))
    return torch.cat(outs)


def _check(fmt, dtype, lengths, Tq, Hq=8, Hkv=2, D=40, mask=None, score_mod=None, sinks=None, seed=0, **options):
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    q = torch.randn(B, Hq, Tq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    if fmt == "dense":
        assert len(set(lengths)) == 1
    (hk, hv), (dk, dv) = _handle(fmt, k, v, lengths, seed=seed)
    if fmt.endswith("int8"):
        q = q.float()
    out = attention(q, hk, hv, mask=mask, score_mod=score_mod, sinks=sinks, backend="decode",
                    options=DecodeOptions(implementation="native", **options))
    ref = _reference(q, dk, dv, lengths, mask, score_mod, sinks, torch.float64)
    low = _reference(q, dk, dv, lengths, mask, score_mod, sinks, q.dtype)
    err, lowp = (out.double() - ref).abs().max().item(), (low.double() - ref).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 2 * lowp + FLOOR[q.dtype], (err, lowp)
    return q, (hk, hv), out


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lengths", [(1,), (17,), (1025,), (1025, 17, 1)], ids=lambda x: "L" + "-".join(map(str, x)))
def test_every_format_matches_float64(fmt, lengths):
    if fmt == "dense" and len(lengths) > 1:
        pytest.skip("dense tensors hold one length")
    Tq = 1
    _check(fmt, torch.float32, lengths, Tq)


@native
@pytest.mark.parametrize("fmt", ["dense", "paged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bf16_dot", [True, False], ids=["dot", "convert"])
def test_low_precision_caches(fmt, dtype, bf16_dot):
    """bfloat16 runs bf16 dot products where the CPU has them (else, and with bf16_dot=False, the keys
    converted to float32): either path passes the float64 rule, odd head dims (dot-product tails) too."""
    lengths = (333,) if fmt == "dense" else (333, 40)
    _check(fmt, dtype, lengths, 3, mask=Causal(), bf16_dot=bf16_dot)
    _check(fmt, dtype, lengths, 1, D=59, mask=Causal(), bf16_dot=bf16_dot)


@native
def test_explain_names_the_dot_products_the_cpu_runs():
    from attnkit.backends.decode_native import dot_products

    q, k = torch.randn(1, 4, 1, 32, dtype=torch.bfloat16), torch.randn(1, 2, 50, 32, dtype=torch.bfloat16)
    text = str(explain(q, k, k, backend="decode"))
    assert ("bf16 dot products (AVX512_BF16)" in text) == dot_products()[0], text
    assert "converted to float32" in str(explain(q.half(), k.half(), k.half(), backend="decode"))


def _int8_handle(g, B, Hkv, T, D):
    k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    h = KVHandle("int8", kq, vq, (T,) * B, torch.float32, True, ks, vs)
    return h, kq.float() * ks[..., None], vq.float() * vs[..., None]


@native
@pytest.mark.parametrize("D", [128, 59, 64, 200])
@pytest.mark.parametrize("q_scale", [1.0, 4.0])
def test_quantized_query_error_is_within_its_bound(D, q_scale):
    """quantized_query=True rounds q per row to int8 (step max|q| / 127): each score moves by at most
    eps_j = scale * step / 2 * sum_c |k_jc|, so the output moves by at most max|v| * (exp(2 max eps) - 1)
    from attention over the dequantized cache in float64; the exact default stays at float32 rounding,
    and the quantized path is really taken (its error is well above the exact one)."""
    g = torch.Generator().manual_seed(D)
    B, Hq, Hkv, T = 2, 8, 2, 700
    h, dk, dv = _int8_handle(g, B, Hkv, T, D)
    q = torch.randn(B, Hq, 2, D, generator=g) * q_scale
    ref = attention(q.double(), dk.double(), dv.double(), mask=Causal(), backend="naive")
    exact = attention(q, h, h, mask=Causal(), backend="decode", options=DecodeOptions(implementation="native"))
    quant = attention(q, h, h, mask=Causal(), backend="decode",
                      options=DecodeOptions(implementation="native", quantized_query=True))
    step = q.double().abs().amax(-1) / 127  # (B, Hq, Tq)
    k_l1 = dk.double().abs().sum(-1).repeat_interleave(Hq // Hkv, 1)  # (B, Hq, T)
    eps = (D**-0.5 * step[..., None] / 2 * k_l1[:, :, None, :]).amax()
    bound = dv.abs().max().item() * (torch.exp(2 * eps).item() - 1)
    err_q, err_x = (quant.double() - ref).abs().max().item(), (exact.double() - ref).abs().max().item()
    assert err_x <= 1e-5 and err_q <= bound + 1e-6, (err_x, err_q, bound)
    assert err_q > 10 * err_x, (err_q, err_x)


@native
def test_quantized_query_keeps_rows_apart_and_nan_rows_nan():
    """A NaN query row is NaN (as the exact path makes it), the other rows keep their bits; a zero row,
    and one too small to quantize (all below 4e-37), give the mean of their values."""
    g = torch.Generator().manual_seed(1)
    h, dk, dv = _int8_handle(g, 1, 2, 90, 32)
    q = torch.randn(1, 6, 1, 32, generator=g)
    opts = DecodeOptions(implementation="native", quantized_query=True)
    base = attention(q, h, h, backend="decode", options=opts)
    q2 = q.clone()
    q2[0, 1] = float("nan")
    q2[0, 2] = 0.0
    q2[0, 4] = q[0, 4] * 1e-39
    out = attention(q2, h, h, backend="decode", options=opts)
    assert out[0, 1].isnan().all() and all(torch.equal(out[0, i], base[0, i]) for i in (0, 3, 5))
    torch.testing.assert_close(out[0, 2, 0], dv[0, 0].mean(0), atol=1e-5, rtol=0)
    torch.testing.assert_close(out[0, 4, 0], dv[0, 1].mean(0), atol=1e-5, rtol=0)


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("Tq", [2, 16])
@pytest.mark.parametrize("mask", [Causal(), SlidingWindow(9, 0), None], ids=["causal", "window", "none"])
def test_masks_and_queries(fmt, Tq, mask):
    lengths = (301,) if fmt == "dense" else (301, 37)
    _check(fmt, torch.float32, lengths, Tq, mask=mask)


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mods", ["alibi", "softcap", "sinks", "relative", "relative-causal", "all"])
def test_score_mods_and_sinks(fmt, mods):
    Hq = 8
    g = torch.Generator().manual_seed(1)
    # max_distance 16 < the 97 keys: the values per clamped distance cover every farther key
    rel = RelativeBias(torch.randn(Hq, 8, generator=g), max_distance=16)
    score_mod = {"alibi": ALiBi.geometric(Hq), "softcap": SoftCap(2.0), "sinks": None, "relative": rel,
                 "relative-causal": RelativeBias(torch.randn(Hq, 6, generator=g), max_distance=20,
                                                 bidirectional=False),
                 "all": ALiBi.geometric(Hq) >> SoftCap(3.0) >> rel}[mods]
    sinks = torch.randn(Hq) if mods in ("sinks", "all") else None
    lengths = (97,) if fmt == "dense" else (97, 30, 5)
    if mods.startswith("relative"):  # a bidirectional bias sees keys past the query too: no causal mask
        _check(fmt, torch.float32, lengths, 2, Hq=Hq, score_mod=score_mod)
    _check(fmt, torch.float32, lengths, 3, Hq=Hq, mask=Causal(), score_mod=score_mod, sinks=sinks)
    _check(fmt, torch.float32, lengths, 1, Hq=Hq, mask=SlidingWindow(4, 0), score_mod=score_mod, sinks=sinks)


@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,D", [((3, 3), 59), ((6, 2), 9), ((5, 1), 224)], ids=["mha-D59", "gqa-D9", "mqa-D224"])
def test_awkward_heads_and_head_dims(fmt, heads, D):
    lengths = (37,) if fmt == "dense" else (37, 127)
    _check(fmt, torch.float32, lengths, 5, Hq=heads[0], Hkv=heads[1], D=D, mask=Causal())


@native
def test_bias_and_masks_without_structure_equal_naive():
    """A bool keep tensor (any mask) and an additive bias, broadcast over batch and heads."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 3, 16, generator=g), torch.randn(2, 2, 70, 16, generator=g),
               torch.randn(2, 2, 70, 16, generator=g))
    keep = torch.rand(2, 1, 3, 70, generator=g) > 0.3
    bias = torch.randn(1, 4, 3, 70, generator=g)
    for mask in (keep, Causal() & KeyPadding(torch.tensor([50, 7]))):
        out = attention(q, k, v, mask=mask, bias=bias, backend="decode", options=DecodeOptions(implementation="native"))
        ref = attention(q, k, v, mask=mask, bias=bias, backend="naive")
        assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


@native
def test_fully_masked_rows_are_zero_and_key_padding():
    q = torch.randn(2, 4, 1, 16)
    k, v = torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
    mask = KeyPadding(torch.tensor([0, 20]))
    out, lse = attention(q, k, v, mask=mask, backend="decode", return_lse=True)
    ref = attention(q, k, v, mask=mask, backend="naive")
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()
    assert torch.allclose(out, ref, atol=1e-6)
    sinks = torch.randn(4)  # a row that sees nothing keeps only its sink: output 0, LSE = sink
    out, lse = attention(q, k, v, mask=mask, sinks=sinks, backend="decode", return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.allclose(lse[0, :, 0], sinks)


@native
@pytest.mark.parametrize("fmt", ["paged", "paged-int8", "int8", "paged-int8-qq", "paged-bf16"])
def test_batch_invariance_is_bitwise(fmt):
    """A sequence decoded alone or in a ragged batch gives the same bits (same kernel, same shapes
    per sequence: its splits follow its own kept span only)."""
    lengths = (1500, 17, 700, 1, 4100)
    g = torch.Generator().manual_seed(3)
    Hq, Hkv, D, Tq = 8, 2, 64, 1
    B, S = len(lengths), max(lengths)
    dtype = torch.bfloat16 if fmt.endswith("bf16") else torch.float32
    q = torch.randn(B, Hq, Tq, D, generator=g).to(dtype)
    k, v = torch.randn(B, Hkv, S, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    (h, _), _ = _handle(fmt.removesuffix("-qq").removesuffix("-bf16"), k, v, lengths)
    opts = DecodeOptions(implementation="native", quantized_query=fmt.endswith("-qq"))
    batch = attention(q, h, h, mask=Causal(), backend="decode", options=opts)
    for b in range(B):
        one = h.rows([b])
        alone = attention(q[b:b + 1], one, one, mask=Causal(), backend="decode", options=opts)
        assert torch.equal(alone, batch[b:b + 1]), b


def test_split_size_depends_on_the_sequence_only():
    assert split_tokens(16384, 8, threads=2) == 4096
    assert split_tokens(1, 8, threads=2) == 256
    assert split_tokens(16384, 8, threads=64) == 1024
    assert split_tokens(1000, 8, threads=64) % 256 == 0


@native
def test_auto_reads_caches_with_the_kernel_and_explain_says_so():
    q = torch.randn(2, 8, 1, 32)
    k, v = torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)
    (h, _), _ = _handle("paged-int8", k, v, (40, 40))
    text = str(explain(q, h, h, mask=Causal(), score_mod=SoftCap(5.0), sinks=torch.zeros(8)))
    assert "chosen: decode" in text and "native C++ split-K decode kernel" in text, text


def test_without_the_kernel_decode_declines_score_mods_with_the_reason(monkeypatch):
    from attnkit.backends import decode_native

    monkeypatch.setattr(decode_native, "_extension", lambda: (None, "native extension not built: test"))
    q = torch.randn(1, 4, 1, 16)
    k = torch.randn(1, 2, 30, 16)
    text = str(explain(q, k, k, mask=Causal(), score_mod=SoftCap(5.0)))
    assert "native extension not built: test" in text
    out = attention(q, k, k, mask=Causal(), backend="decode")  # the PyTorch-op twin
    assert torch.allclose(out, attention(q, k, k, mask=Causal(), backend="naive"), atol=1e-6)


def test_vmap_runs_the_twin():
    """The kernel has no vmap rule: under torch.func, decode runs its PyTorch-op twin (under
    torch.compile too: the kernel declines while tracing)."""
    q, k = torch.randn(2, 1, 4, 1, 16), torch.randn(2, 1, 2, 30, 16)
    f = lambda q, k: attention(q, k, k, mask=Causal(), backend="decode")  # noqa: E731
    torch.testing.assert_close(torch.vmap(f)(q, k), torch.stack([f(q[i], k[i]) for i in range(2)]))


def test_decode_reads_relative_biases_in_place():
    """A relative bias runs in the kernel (its values per clamped distance): a paged cache is read in
    place, and the result is the naive backend's over the dense keys."""
    q = torch.randn(1, 4, 1, 16)
    k = torch.randn(1, 2, 40, 16)
    (h, _), _ = _handle("paged", k, k, (40,))
    mod = RelativeBias(torch.randn(4, 8), max_distance=16)
    e = explain(q, h, h, mask=Causal(), score_mod=mod)
    if _REASON is None:
        assert e.chosen == "decode", e.reasons
    out = attention(q, h, h, mask=Causal(), score_mod=mod)
    ref = attention(q, k, k, mask=Causal(), score_mod=mod, backend="naive")
    assert torch.allclose(out, ref, atol=1e-5)


@native
@pytest.mark.parametrize("cap", [0.7, 5.0, 30.0])
def test_softcap_is_bitwise_the_prefill_kernels(cap):
    """Both kernels cap a score with one function (spec.h). With integer queries and keys every dot
    product is exact in any order, and with one key a row's LSE is its capped score itself (no sum whose
    order could differ between the kernels or the ISAs): so the capped scores agree bit for bit. Over
    50 keys (sums in each kernel's own order) the LSEs agree to float32 rounding."""
    from attnkit.backends import native

    if native.unavailable_reason():
        pytest.skip(native.unavailable_reason())
    g = torch.Generator().manual_seed(0)
    kw = dict(mask=Causal(), score_mod=SoftCap(cap), scale=0.25, return_lse=True)
    for keys, bitwise in ((1, True), (50, False)):
        q = torch.randint(-3, 4, (1, 16, 1, 16), generator=g).float()
        k = torch.randint(-3, 4, (1, 2, keys, 16), generator=g).float()
        v = torch.randn(1, 2, keys, 16, generator=g)
        _, lse_decode = attention(q, k, v, backend="decode", options=DecodeOptions(implementation="native"), **kw)
        _, lse_prefill = attention(q, k, v, backend="native", **kw)
        if bitwise:
            assert lse_decode.unique().numel() > 4  # the rows cap different scores
            assert torch.equal(lse_decode, lse_prefill), (lse_decode - lse_prefill).abs().max()
        else:
            assert torch.allclose(lse_decode, lse_prefill, rtol=1e-6, atol=0)


@native
def test_relative_bias_values_follow_the_table_in_place():
    """The kernel's values per clamped distance are kept per table: an in-place update of the table
    (a training step, a load) is read by the next call."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = torch.randn(1, 2, 60, 16, generator=g), torch.randn(1, 2, 60, 16, generator=g)
    mod = RelativeBias(torch.randn(4, 8, generator=g), max_distance=16, bidirectional=False)
    opts = DecodeOptions(implementation="native")
    before = attention(q, k, v, mask=Causal(), score_mod=mod, backend="decode", options=opts)
    with torch.no_grad():
        mod.table.mul_(3.0)
    after = attention(q, k, v, mask=Causal(), score_mod=mod, backend="decode", options=opts)
    ref = attention(q, k, v, mask=Causal(), score_mod=mod, backend="naive")
    assert not torch.allclose(before, after) and torch.allclose(after, ref, atol=1e-5)
