"""transformers' DeepSeek-V3.2 (tiny random config) on attnkit: the indexer's ``indices=`` become a TopK
mask that the ``topk`` backend gathers; logits equal eager's (which scatters them into a dense mask)
and greedy tokens are the same."""

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v32")

from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: E402

from attnkit import TopK  # noqa: E402
from attnkit.backends.topk import TopKBackend  # noqa: E402
from attnkit.interop import register_hf_attention  # noqa: E402

TOPK = 5  # of 13 prompt tokens: most queries attend a strict subset of their past


@pytest.fixture(scope="module")
def model():
    register_hf_attention()
    cfg = DeepseekV32Config(vocab_size=97, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                            q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                            n_group=1, topk_group=1, max_position_embeddings=128, pad_token_id=0, index_topk=TOPK,
                            index_head_dim=16, index_n_heads=4)
    torch.manual_seed(0)
    m = DeepseekV32ForCausalLM(cfg).eval()
    ids = torch.randint(1, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    m.set_attn_implementation("eager")
    with torch.no_grad():
        eager = (m(ids).logits, m.generate(ids, max_new_tokens=6, do_sample=False))
    m.set_attn_implementation("attnkit")
    return m, ids, eager


def test_logits_and_greedy_tokens_equal_eager_on_the_gather_backend(model, monkeypatch):
    m, ids, (logits, tokens) = model
    seen = []
    original = TopKBackend.forward.__func__

    def spy(cls, inp, options):
        seen.append((inp.Tq, inp.mask.topk().k))
        return original(cls, inp, options)

    monkeypatch.setattr(TopKBackend, "forward", classmethod(spy))
    with torch.no_grad():
        got = m(ids).logits
        assert seen == [(13, TOPK)] * 2  # every layer's prefill gathered its 5 keys per query
        generated = m.generate(ids, max_new_tokens=6, do_sample=False)
    assert (got - logits).abs().max() <= 1e-5
    assert torch.equal(generated, tokens)
    assert (1, TOPK) in seen  # decode steps too


def test_the_lists_matter(model):
    """The sparse mask changes the result: with every key listed the logits differ (so the test above
    would catch lists that were ignored)."""
    m, ids, (logits, _) = model
    indexers = [layer.self_attn.indexer for layer in m.model.layers]
    for indexer in indexers:
        indexer.index_topk = 1000
    try:
        with torch.no_grad():
            dense = m(ids).logits
    finally:
        for indexer in indexers:
            indexer.index_topk = TOPK
    assert (dense - logits).abs().max() > 1e-3


def test_the_mask_slices_like_a_tensor(model):
    """The indexer slices the mask (attention_mask[:, 0]): an HFMask gives its boolean keep."""
    from attnkit.interop.hf_attention import attnkit_mask

    hf = attnkit_mask(2, 3, 5, q_offset=2)
    assert hf[:, 0].tolist() == [[[True, True, True, False, False], [True, True, True, True, False],
                                  [True, True, True, True, True]]] * 2
    assert isinstance(TopK(torch.zeros(1, 1, 3, 1, dtype=torch.long)).topk(), TopK)


def test_lightning_indexer_equals_transformers_indexer(model):
    """attnkit's indexer on the projections of transformers' DeepseekV32Indexer picks the same keys."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as modeling

    from attnkit.nn import lightning_indexer

    m, ids, _ = model
    layer = m.model.layers[0].self_attn
    indexer = layer.indexer
    g = torch.Generator().manual_seed(2)
    B, S = 2, 13
    hidden = torch.randn(B, S, m.config.hidden_size, generator=g)
    q_resid = torch.randn(B, S, m.config.q_lora_rank, generator=g)
    position_ids = torch.arange(S).expand(B, S)
    cos, sin = m.model.rotary_emb(hidden, position_ids)
    causal = torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S)
    with torch.no_grad():
        theirs = indexer(hidden, q_resid, (cos, sin), causal, position_ids)  # (B, S, topk)
        H, D, rope = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
        q = indexer.wq_b(q_resid).view(B, S, H, D)
        k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
        q_rot, k_rot = modeling.apply_rotary_pos_emb(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., rope:]], -1).transpose(1, 2)  # (B, H, S, D)
        k = torch.cat([k_rot, k[..., rope:]], -1).transpose(1, 2)  # (B, 1, S, D)
        w = indexer.weights_proj(hidden).transpose(1, 2) * H ** -0.5  # (B, H, S)
        ours = lightning_indexer(q, k, w, indexer.index_topk)[:, 0]  # (B, S, topk), -1 where fewer keys
    for b in range(B):
        for i in range(S):
            mine = sorted(j for j in ours[b, i].tolist() if j >= 0)
            assert mine == sorted(j for j in theirs[b, i].tolist() if j <= i)  # theirs pads with future keys


@pytest.mark.parametrize("kind", ["dynamic", "static", "int8", "paged"])
def test_latent_decoding_runs_the_indexer_and_attends_its_keys_over_the_latents(model, kind, monkeypatch):
    """With a latent cache and use_latent_decoding(), V3.2's decode steps run absorbed over the latent
    rows (mla_decode) with the indexer's lists as a TopK mask, the indexer's keys kept by the cache."""
    import attnkit.interop.hf_deepseek as hf_deepseek
    from attnkit.interop import latent_cache, use_latent_decoding

    m, ids, (logits, tokens) = model
    calls = []
    real = hf_deepseek.mla_decode

    def spy(q, rows, **kw):
        calls.append((q.shape[2], kw["mask"].topk().k))
        return real(q, rows, **kw)

    monkeypatch.setattr(hf_deepseek, "mla_decode", spy)
    sizes = dict(max_batch_size=2, block_size=5) if kind == "paged" else {}
    with torch.no_grad(), use_latent_decoding():
        cache = latent_cache(m.config, kind, max_cache_len=32, **sizes)
        chunks = [m(ids[:, a:b], past_key_values=cache).logits for a, b in ((0, 9), (9, 12), (12, 13))]
        generated = m.generate(ids, max_new_tokens=6, do_sample=False,
                               past_key_values=latent_cache(m.config, kind, max_cache_len=32, **sizes))
    got = torch.cat(chunks, 1)
    assert calls and all(k == TOPK for _, k in calls)  # every decode step attended its 5 listed keys
    err = (got - logits).abs().max() / logits.abs().max()
    if kind == "int8":
        assert 0 < err < 0.03
    else:
        assert err <= 1e-5 and torch.equal(generated, tokens)
