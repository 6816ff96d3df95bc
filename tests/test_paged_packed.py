"""Packed prefill into a paged cache in one call (``PagedLayerCache.update_packed``), then decoding per sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit.cache import PagedKVCache
from attnkit.masks import Causal

HQ, HKV, D = 4, 2, 8


def _sequences(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV)] for n in lengths]


def _full(q, k, v):
    """Causal attention over one whole sequence ``(T, H, D)``: the reference for every row."""
    out = attnkit.attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), mask=Causal(), backend="naive")
    return out[0].transpose(0, 1)  # (T, Hq, D)


def _cu(lengths):
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0))


@pytest.mark.parametrize("held", [(0, 0, 0), (3, 0, 6)], ids=["empty", "after-a-prefix"])
def test_packed_prefill_then_decode_equals_full_attention(held):
    prompts, steps = [5, 1, 12], 3
    seqs_data = _sequences([h + p + steps for h, p in zip(held, prompts)])
    cache = PagedKVCache(1, num_blocks=32, block_size=4)
    layer = cache[0]
    seqs = [cache.add_sequence() for _ in prompts]
    for seq, h, (q, k, v) in zip(seqs, held, seqs_data):  # a prefix held before the packed call
        if h:
            cache.select([seq])
            layer.update(k[None, :h].transpose(1, 2), v[None, :h].transpose(1, 2))
    cache.select(seqs)
    cu = _cu(prompts)
    q, k, v = (torch.cat([s[i][h:h + p] for s, h, p in zip(seqs_data, held, prompts)]) for i in range(3))
    k_all, v_all, cu_k = layer.update_packed(k, v, cu)
    assert cache.lengths() == [h + p for h, p in zip(held, prompts)]
    out = attnkit.varlen_attention(q, k_all, v_all, cu, cu_k, causal=True)
    for i, (s, h, p) in enumerate(zip(seqs_data, held, prompts)):
        ref = _full(*(x[:h + p] for x in s))[h:]  # the prompt's rows, as prefilled alone
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref)
    for t in range(steps):  # decoding continues per sequence, rows of different lengths
        pos = [h + p + t for h, p in zip(held, prompts)]
        # (B, H, 1, D)
        qt, kt, vt = (torch.stack([s[i][n] for s, n in zip(seqs_data, pos)])[:, :, None] for i in range(3))
        hk, hv, _ = layer.update(kt, vt)
        got = attnkit.attention(qt, hk, hv, mask=Causal())
        for row, (s, n) in enumerate(zip(seqs_data, pos)):
            torch.testing.assert_close(got[row, :, 0], _full(*(x[:n + 1] for x in s))[n])


def test_packed_prefill_refuses_a_mismatched_batch():
    cache = PagedKVCache(1, num_blocks=8, block_size=4)
    seqs = [cache.add_sequence() for _ in range(2)]
    cache.select(seqs)
    k = torch.randn(7, HKV, D)
    with pytest.raises(ValueError, match="2 are selected"):
        cache[0].update_packed(k, k, _cu([3, 2, 2]))
    with pytest.raises(ValueError, match="packed length 7"):
        cache[0].update_packed(k, k, _cu([3, 3]))
    with pytest.raises(ValueError, match=">= 1 new token"):
        cache[0].update_packed(k, k, _cu([7, 0]))
    assert cache.lengths() == [0, 0]  # nothing was written


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_gpt_packed_prefill_into_pages_then_decode_equals_each_prompt_alone(position):
    from attnkit.nn.layers import TransformerConfig
    from attnkit.nn.models import GPT

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, max_len=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            position=position)
    model = GPT(cfg).eval()
    prompts = [torch.randint(0, 50, (n,)) for n in (5, 1, 12)]
    steps = torch.randint(0, 50, (3, len(prompts)))  # one decoded token per sequence per step
    cache = model.make_cache("paged", num_blocks=32, block_size=4)
    seqs = [cache.add_sequence() for _ in prompts]
    cache.select(seqs)
    cu = _cu([len(p) for p in prompts])
    with torch.no_grad():
        logits = model(torch.cat(prompts)[None], cache=cache, cu_seqlens=cu)[0]  # (total, vocab)
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[cu[i]:cu[i + 1]], model(p[None])[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(model(torch.cat(prompts)[None], cu_seqlens=cu)[0][cu[i]:cu[i + 1]],
                                       model(p[None])[0], rtol=1e-4, atol=1e-5)  # packed, no cache
        for t in range(steps.shape[0]):
            step = model(steps[t][:, None], cache=cache)[:, -1]  # (B, vocab), rows of different lengths
            for i, p in enumerate(prompts):
                full = model(torch.cat([p, steps[: t + 1, i]])[None])[0, -1]
                torch.testing.assert_close(step[i], full, rtol=1e-4, atol=1e-5)
