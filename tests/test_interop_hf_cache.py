"""attnkit's KV caches as a transformers cache: generate() with them gives sdpa's tokens, int8 holds
under 30% of the float32 cache's bytes, the decode kernel reads them in place and no step scans K/V."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit  # noqa: E402
from attnkit.interop import hf_cache, register_hf_attention  # noqa: E402


def tiny_llama(seed=0, hidden=64):
    register_hf_attention()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval()


def _generate(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("kind", ["static", "dynamic", "int8", "paged", "paged-int8"])
def test_generate_with_an_attnkit_cache_gives_sdpas_tokens(kind):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("sdpa")
    ref = _generate(model, ids)
    model.set_attn_implementation("attnkit")
    cache = hf_cache(model.config, kind, max_cache_len=27 if kind == "static" else None,
                     num_blocks=8 if kind.startswith("paged") else None, block_size=8)
    got = _generate(model, ids, past_key_values=cache)
    if kind.endswith("int8"):  # int8 storage: the same tokens on this model (its logits move by the quantization error)
        assert (got == ref).float().mean() > 0.9
    else:
        assert torch.equal(got, ref)
    assert cache.get_seq_length() == 26  # prompt + 10 new tokens, less the last (never fed back)


def test_int8_cache_holds_under_30_percent_of_float32_bytes():
    model = tiny_llama(hidden=256)  # head dim 64: 64 int8 values and a float32 scale per token and head
    model.set_attn_implementation("attnkit")
    ids = torch.randint(0, 128, (1, 64))
    sizes = {}
    for kind in ("static", "int8"):
        cache = hf_cache(model.config, kind, max_cache_len=64)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        stores = [layer.store for layer in cache.layers]
        buffers = [getattr(s, name, None) for s in stores for name in ("k", "v", "k_scale", "v_scale")]
        sizes[kind] = sum(t.numel() * t.element_size() for t in buffers if t is not None)
    assert sizes["int8"] <= 0.30 * sizes["static"]


def test_a_decode_step_reads_the_cache_without_scanning_it(monkeypatch):
    """The static cache's views are vouched finite (checked as written) and the int8 handle carries it: the
    NaN/Inf policy scans only q."""
    from attnkit.backends import nonfinite

    model = tiny_llama()
    model.set_attn_implementation("attnkit")
    scanned = []
    real = nonfinite.finite_only
    monkeypatch.setattr(nonfinite, "finite_only", lambda x: scanned.append(tuple(x.shape)) or real(x))
    for kind in ("static", "int8"):
        cache = hf_cache(model.config, kind, max_cache_len=40)
        ids = torch.randint(0, 128, (1, 20))
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            scanned.clear()
            model(ids[:, :1], past_key_values=cache, use_cache=True)
        # queries at most (the native decode kernel keeps the NaN/Inf contract itself: nothing is scanned)
        assert all(shape[2] == 1 for shape in scanned), (kind, scanned)


def test_beam_search_on_a_paged_cache_forks_blocks_and_gives_sdpas_beams():
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("sdpa")
    ref = _generate(model, ids, num_beams=3)
    model.set_attn_implementation("attnkit")
    cache = hf_cache(model.config, "paged", max_cache_len=24, max_batch_size=6, block_size=4)
    got = _generate(model, ids, num_beams=3, past_key_values=cache)
    assert torch.equal(got, ref)
    paged = cache.layers[0].paged
    assert all(layer.paged is paged for layer in cache.layers)
    assert len(paged.active) == 6  # 2 rows x 3 beams, reordered by forking, not by copying rows
    # beams that share a prefix share its blocks: fewer blocks in use than 6 private copies would take
    in_use = paged.pool.num_blocks - paged.free_block_count
    assert in_use < 6 * paged.blocks_needed(paged.lengths()[0])
    cache.reset()
    assert paged.free_block_count == paged.pool.num_blocks and not paged.active
    got = _generate(model, ids, num_beams=3, past_key_values=cache)  # a reset cache serves the next call
    assert torch.equal(got, ref)


def test_bad_arguments_are_refused():
    model = tiny_llama()
    with pytest.raises(ValueError, match="kind"):
        hf_cache(model.config, "paged4")
    with pytest.raises(ValueError, match="max_cache_len"):
        hf_cache(model.config, "static")
    with pytest.raises(ValueError, match="num_blocks"):
        hf_cache(model.config, "paged")
    with pytest.raises(ValueError, match="block_size"):
        hf_cache(model.config, "paged", num_blocks=4, block_size=0)


def test_explain_says_the_decode_kernel_reads_the_int8_cache_in_place():
    model = tiny_llama()
    model.set_attn_implementation("attnkit")
    cache = hf_cache(model.config, "int8")
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 9)), past_key_values=cache, use_cache=True)
    handle = cache.layers[0].store.handle()
    q = torch.randn(1, 4, 1, 16)
    e = attnkit.explain(q, handle, handle)
    assert "read in place by decode" in e.kv  # the native kernel, or without it the decode backend's PyTorch twin
