"""PagedKVCache: pages read directly equal a contiguous cache, in any allocation order; fork is
copy-on-write; continuous-batching rows of different lengths each equal their own full forward."""

import random

import pytest
import torch

from attnkit import Causal, KeyPadding, attention
from attnkit.backends.decode import DecodeOptions, decode_attention, paged_decode_attention
from attnkit.cache import PagedKVCache, dequantize_int8, quantize_int8

from .test_cache import BACKENDS, _model

T = 23


def _paged(model, num_blocks=64, block_size=4, quantize=None):
    return model.make_cache("paged", num_blocks=num_blocks, block_size=block_size, quantize=quantize)


def _scramble(cache: PagedKVCache, seed: int) -> None:
    """Leave the free list in a random order: take every block, give them back shuffled."""
    rng = random.Random(seed)
    seqs = [cache.add_sequence() for _ in range(cache.pool.num_blocks)]
    for seq in seqs:
        cache.pool.tables[seq].append(cache.pool.take())
    rng.shuffle(seqs)
    for seq in seqs:
        cache.free(seq)


@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_rows_decode_equal_their_full_forward(backend, chunk):
    """Two sequences of different lengths in one batch (as in continuous batching), every exact
    backend (auto/decode read the pages; the others run on the gather fallback)."""
    model = _model(backend)
    x = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        full = model(x)
        cache = _paged(model)
        _scramble(cache, seed=chunk)
        a, b = cache.add_sequence(), cache.add_sequence()
        cache.select([a])
        first = [model(x[:1, :7], cache=cache)]  # a runs ahead by 7 tokens
        cache.select([a, b])
        outs = []
        for s in range(0, T - 7, chunk):
            n = min(chunk, T - 7 - s)
            step = torch.stack([x[0, 7 + s: 7 + s + n], x[1, s: s + n]])
            outs.append(model(step, cache=cache))
        out = torch.cat(outs, dim=1)
    assert cache.lengths() == [T, T - 7]
    assert torch.allclose(torch.cat(first + [out[:1]], 1), full[:1], atol=1e-5, rtol=1e-4)
    assert torch.allclose(out[1:], full[1:, : T - 7], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_allocation_order_equals_static_cache(seed):
    model = _model()
    x = torch.randint(0, 50, (3, T))
    with torch.no_grad():
        static = model.make_cache("static", max_len=T)
        ref = torch.cat([model(x[:, :4], cache=static)] + [model(x[:, i:i + 1], cache=static) for i in range(4, T)], 1)
        cache = _paged(model, block_size=3)
        _scramble(cache, seed)
        cache.select([cache.add_sequence() for _ in range(3)])
        out = torch.cat([model(x[:, :4], cache=cache)] + [model(x[:, i:i + 1], cache=cache) for i in range(4, T)], 1)
    tables = [cache.pool.tables[s] for s in cache.active]
    assert any(t != sorted(t) for t in tables)  # the blocks really are out of order
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


def test_fork_is_copy_on_write_and_both_branches_are_exact():
    model = _model()
    prefix = torch.randint(0, 50, (1, 6))  # 6 tokens: the last block (size 4) is half full and shared
    tail_a, tail_b = torch.randint(0, 50, (1, 5)), torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        full_a = model(torch.cat([prefix, tail_a], 1))
        full_b = model(torch.cat([prefix, tail_b], 1))
        cache = _paged(model)
        a = cache.add_sequence()
        cache.select([a])
        model(prefix, cache=cache)
        free_before = cache.free_block_count
        b = cache.fork(a)
        assert cache.pool.tables[a] == cache.pool.tables[b] and cache.free_block_count == free_before
        cache.select([a, b])
        steps = [model(torch.cat([tail_a[:, i:i + 1], tail_b[:, i:i + 1]]), cache=cache) for i in range(5)]
        out = torch.cat(steps, 1)
    ta, tb = cache.pool.tables[a], cache.pool.tables[b]
    assert ta[0] == tb[0] and ta[1] != tb[1]  # the full block stays shared, the written one was copied
    assert torch.allclose(out[0], full_a[0, 6:], atol=1e-5, rtol=1e-4)
    assert torch.allclose(out[1], full_b[0, 6:], atol=1e-5, rtol=1e-4)
    cache.free(a)
    assert cache.pool.refcount[ta[0]] == 1  # b still holds the shared block
    cache.free(b)
    assert cache.free_block_count == cache.pool.num_blocks


def test_reorder_forks_and_frees_like_beam_search():
    model = _model()
    x = torch.randint(0, 50, (2, 5))
    nxt = torch.randint(0, 50, (2, 1))
    with torch.no_grad():
        cache = _paged(model)
        cache.select([cache.add_sequence(), cache.add_sequence()])
        model(x, cache=cache)
        cache.reorder(torch.tensor([1, 1]))  # both beams continue row 1; row 0 is dropped
        assert len(cache.pool.tables) == 2 and cache.lengths() == [5, 5]
        out = model(nxt, cache=cache)
        ref = model(torch.cat([x[1:].expand(2, 5), nxt], 1))[:, -1:]
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


def test_crop_releases_blocks_and_decoding_continues():
    model = _model()
    x = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        cache = _paged(model)
        cache.select([cache.add_sequence()])
        model(x, cache=cache)
        cache.crop(5)
        assert cache.lengths() == [5] and len(cache.pool.tables[cache.active[0]]) == 2
        out = model(x[:, 5:8], cache=cache)
        ref = model(x[:, :8])[:, 5:]
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_paged_kernel_equals_contiguous_kernel_with_shuffled_blocks(quantize):
    """Function level: the same keys laid out in shuffled pages give the contiguous result."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, Tq, D, bs, nb = 2, 6, 2, 2, 16, 8, 5
    q = torch.randn(B, Hq, Tq, D, generator=g)
    k, v = torch.randn(B, Hkv, nb * bs, D, generator=g), torch.randn(B, Hkv, nb * bs, D, generator=g)
    lengths = [nb * bs, 19]
    keep = (torch.arange(nb * bs)[None, :] < torch.tensor(lengths)[:, None]).view(B, 1, 1, -1) & Causal().materialize(
        Tq, nb * bs, q_offset=nb * bs - Tq, kv_offset=0)
    table = torch.randperm(B * nb, generator=g).view(B, nb)
    scales = {}
    if quantize:
        (k, ks), (v, vs) = quantize_int8(k), quantize_int8(v)
        scales = dict(k_scale=ks, v_scale=vs)
    pools = []
    for x in (k, v) + tuple(scales.values()):
        pool = torch.zeros(Hkv, B * nb, bs, *x.shape[3:], dtype=x.dtype)
        pages = x.view(B, Hkv, nb, bs, *x.shape[3:]).transpose(0, 1)  # (Hkv, B, nb, bs, ...)
        pool[:, table.flatten()] = pages.reshape(Hkv, B * nb, bs, *x.shape[3:])
        pools.append(pool)
    want = decode_attention(q, k, v, keep=keep, **scales, options=DecodeOptions(segment_tokens=7))
    kw = {} if not quantize else dict(k_scale=pools[2], v_scale=pools[3])
    got = paged_decode_attention(q, pools[0], pools[1], table, keep=keep, options=DecodeOptions(segment_tokens=9),
                                 **kw)
    assert torch.allclose(got, want, atol=1e-6)
    if quantize:  # and equals plain attention over the dequantized keys
        from attnkit import attention

        ref = attention(q, dequantize_int8(k, scales["k_scale"]), dequantize_int8(v, scales["v_scale"]),
                        mask=keep, backend="naive")
        assert torch.allclose(got, ref, atol=1e-5)


def test_explain_names_the_path():
    """The dispatcher sees the cache handle: decode reads it in place, anything else reads the
    declared dense conversion, and explain() says which and why."""
    import attnkit

    cache = PagedKVCache(1, num_blocks=8, block_size=4, quantize="int8")
    cache.select([cache.add_sequence()])
    cache[0].update(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))
    h, _, _ = cache[0].update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    q = torch.randn(1, 4, 1, 8)
    e = attnkit.explain(q, h, h)
    assert e.chosen == "decode" and "read in place by decode" in e.kv
    named = attnkit.explain(q, h, h, backend="naive")
    assert named.chosen == "naive" and "converted to contiguous" in named.kv
    capped = attnkit.explain(q, h, h, score_mod=attnkit.score_mods.SoftCap(5.0))
    from attnkit.backends.decode_native import _extension

    if _extension()[0] is not None:  # the native decode kernel applies the modifier in place
        assert capped.chosen == "decode" and "read in place by decode" in capped.kv
    else:  # without it the PyTorch-op decode declines, and another backend reads the conversion
        assert capped.chosen != "decode" and "score_mod" in capped.kv and "converted" in capped.kv
    long_q = attnkit.explain(torch.randn(1, 4, 7, 8), h, h)
    assert "Tq=7" not in long_q.kv  # 7 queries: still a decode read
    assert attnkit.dispatch.select(attnkit.AttentionInputs.create(q, h, h)).name == "decode"


def test_paged_cache_errors():
    model = _model()
    with pytest.raises(ValueError, match="num_blocks"):
        model.make_cache("paged")
    with pytest.raises(ValueError, match="block_size"):
        _paged(model, block_size=0)
    with pytest.raises(ValueError, match="quantize"):
        _paged(model, quantize="int3")
    cache = _paged(model, num_blocks=2, block_size=2)
    with pytest.raises(ValueError, match="unknown sequence"):
        cache.select([7])
    a = cache.add_sequence()
    with pytest.raises(ValueError, match="once per batch"):
        cache.select([a, a])
    cache.select([a])
    with pytest.raises(ValueError, match="batch size 2 but 1 sequences"):
        model(torch.randint(0, 50, (2, 3)), cache=cache)
    with pytest.raises(RuntimeError, match="all 2 blocks"):
        with torch.no_grad():
            model(torch.randint(0, 50, (1, 5)), cache=cache)
    cache.reset()
    b, c = cache.add_sequence(), cache.add_sequence()
    cache.select([b])
    with torch.no_grad():
        model(torch.randint(0, 50, (1, 2)), cache=cache)
    cache.select([b, c])
    with pytest.raises(ValueError, match="different lengths"):
        cache.seq_len
    with pytest.raises(ValueError, match="length"):
        cache.crop(3)
    with pytest.raises(TypeError, match="whole PagedKVCache"):
        cache[0].reset()


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_non_finite_tokens_are_stored_and_keep_the_contract(quantize):
    """A NaN key is stored (not refused mid-model): the cache reports kv_finite=False; the native decode kernel
    reads it in place and keeps the NaN/Inf contract itself (without the kernel, a dense copy under the policy),
    and rows that cannot see it stay exact."""
    import attnkit

    g = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, num_blocks=16, block_size=3, quantize=quantize)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.select([a, b])
    k, v = torch.randn(2, 1, 5, 6, generator=g), torch.randn(2, 1, 5, 6, generator=g)
    k[1, 0, 2] = float("nan")  # row 1 only
    cache[0].update(k, v)
    q = torch.randn(2, 3, 1, 6, generator=g)
    kn, vn = torch.randn(2, 1, 1, 6, generator=g), torch.randn(2, 1, 1, 6, generator=g)
    h, _, _ = cache[0].update(kn, vn)
    assert not h.finite and not cache[0].finite
    e = attnkit.explain(q, h, h, mask=Causal())
    kernel = attnkit.list_backends()["decode"].decodes(attnkit.inputs.AttentionInputs.create(q, h, h, mask=Causal()))
    # the native decode kernel keeps the NaN/Inf contract itself: it reads the cache in place; else a dense copy
    assert ("read in place by decode" in e.kv) if kernel else ("converted to contiguous" in e.kv and "NaN/Inf" in e.kv)
    out = attention(q, h, h, mask=Causal())
    k_all, v_all = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
    if quantize:
        k_all, v_all = h.dense(torch.float32)
    ref = attention(q[:1], k_all[:1], v_all[:1], mask=Causal(), backend="naive")
    assert torch.allclose(out[:1], ref, atol=1e-5)
    assert torch.isnan(out[1]).all()
    cache.reset()
    assert cache[0].finite  # an emptied pool holds no NaN: every block is zeroed when taken


def test_memory_follows_the_tokens_held():
    model = _model()
    cache = _paged(model, num_blocks=10, block_size=4, quantize="int8")
    cache.select([cache.add_sequence()])
    with torch.no_grad():
        model(torch.randint(0, 50, (1, 9)), cache=cache)
    assert cache.free_block_count == 7  # ceil(9 / 4) blocks taken
    # int8 pages: D + 4 bytes per token and head (values + float32 scale) for K and for V
    Hkv, D, layers = 2, 8, 2
    assert cache.memory_bytes() == layers * 2 * Hkv * 10 * 4 * (D + 4)


def test_key_padding_mask_in_a_ragged_batch():
    """Masks beyond Causal are evaluated at each row's own positions (here: hide key 0)."""
    g = torch.Generator().manual_seed(0)
    model = _model()
    cache = _paged(model)
    a, b = cache.add_sequence(), cache.add_sequence()
    layer = cache[0]
    cache.select([a])
    k0 = torch.randn(1, 2, 3, 8, generator=g)
    layer._store(k0, k0)
    cache.select([a, b])
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g)
    mask = Causal() & KeyPadding([4, 1])  # row 0 sees keys 0..3, row 1 only key 0 (its own)
    h, _, _ = layer.update(k, v)
    out = attention(q, h, h, mask=mask)
    ref0 = decode_attention(q[:1], torch.cat([k0, k[:1]], 2), torch.cat([k0, v[:1]], 2))
    ref1 = decode_attention(q[1:], k[1:], v[1:])
    assert torch.allclose(out[:1], ref0, atol=1e-6) and torch.allclose(out[1:], ref1, atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_random_ragged_batches_match_the_reference_per_row(seed):
    """Random block sizes, lengths, query counts and masks: each row of a paged attend equals
    the naive backend over that row's own keys (fp32 pages exactly, int8 pages to their error)."""
    from attnkit import SlidingWindow, attention

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    quantize = (None, "int8")[seed % 2]
    B, Hkv, G, D = rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 3), 8
    Tq = rng.choice([1, 1, 2, 5])
    mask = rng.choice([None, Causal(), Causal() & SlidingWindow(3, 0), SlidingWindow(2, 1)])
    cache = PagedKVCache(1, num_blocks=64, block_size=rng.choice([1, 3, 4, 16]), quantize=quantize)
    _scramble(cache, seed)
    seqs = [cache.add_sequence() for _ in range(B)]
    history = []
    for seq in seqs:  # each row gets its own history first
        n = rng.randint(1, 20)
        k = torch.randn(1, Hkv, n, D, generator=g)
        v = torch.randn(1, Hkv, n, D, generator=g)
        cache.select([seq])
        cache[0]._store(k, v)
        history.append((k, v))
    cache.select(seqs)
    q = torch.randn(B, Hkv * G, Tq, D, generator=g)
    k_new, v_new = torch.randn(B, Hkv, Tq, D, generator=g), torch.randn(B, Hkv, Tq, D, generator=g)
    h, _, _ = cache[0].update(k_new, v_new)
    out = attention(q, h, h, mask=mask)
    for b, (k, v) in enumerate(history):
        k_all, v_all = torch.cat([k, k_new[b:b + 1]], 2), torch.cat([v, v_new[b:b + 1]], 2)
        if quantize:
            (kq, ks), (vq, vs) = quantize_int8(k_all), quantize_int8(v_all)
            k_all, v_all = dequantize_int8(kq, ks), dequantize_int8(vq, vs)
        ref = attention(q[b:b + 1], k_all, v_all, mask=mask, backend="naive")
        assert torch.allclose(out[b:b + 1], ref, atol=1e-5), (b, (out[b:b + 1] - ref).abs().max())


def test_grad_mode_takes_the_gather_fallback_and_stores_detached_keys():
    model = _model()
    cache = _paged(model)
    cache.select([cache.add_sequence()])
    x = torch.randint(0, 50, (1, 6))
    model(x[:, :5], cache=cache)  # grad mode: parameters require grad
    out = model(x[:, 5:], cache=cache)
    out.sum().backward()  # gradients reach the parameters through the new queries
    assert model.layers[0].self_attn.qkv_proj.weight.grad is not None
    assert not cache[0].k.requires_grad and cache[0].k.grad_fn is None
    with torch.no_grad():
        ref = model(x)[:, 5:]
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_bfloat16_model_decodes_with_paged_pages(quantize):
    """flash-attn's rule on logits against float64 (int8 adds its own, bounded error)."""
    model = _model()
    x = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        ref = model.double()(x)
        model = model.to(torch.bfloat16)
        full = model(x).double()
        cache = _paged(model, quantize=quantize)
        cache.select([cache.add_sequence(), cache.add_sequence()])
        out = torch.cat([model(x[:, :3], cache=cache)] + [model(x[:, i:i + 1], cache=cache) for i in range(3, 16)], 1)
    assert cache[0].k.dtype == (torch.int8 if quantize else torch.bfloat16)
    slack = 0.02 * ref.abs().max() if quantize else 1e-3
    assert (out.double() - ref).abs().max() <= 2 * (full - ref).abs().max() + slack
