"""transformers' DeepSeek-V3 (tiny random config) on attnkit: attn_implementation="attnkit" equals
eager (logits, greedy tokens), and with a latent cache and use_latent_decoding() the decode steps run
absorbed over the latents (mla_decode) and still equal eager."""

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v3")

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

import attnkit.interop.hf_deepseek as hf_deepseek  # noqa: E402
from attnkit.interop import latent_cache, register_hf_attention, use_latent_decoding  # noqa: E402


@pytest.fixture(scope="module")
def model():
    register_hf_attention()
    cfg = DeepseekV3Config(vocab_size=97, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                           q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                           topk_group=1, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(cfg).eval()
    ids = torch.randint(1, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    m.set_attn_implementation("eager")
    with torch.no_grad():
        eager = (m(ids).logits, m.generate(ids, max_new_tokens=6, do_sample=False))
    m.set_attn_implementation("attnkit")
    return m, ids, eager


def test_attnkit_implementation_equals_eager(model):
    m, ids, (logits, tokens) = model
    with torch.no_grad():
        got = m(ids).logits
        generated = m.generate(ids, max_new_tokens=6, do_sample=False)
    assert (got - logits).abs().max() <= 1e-5 * logits.abs().max()
    assert torch.equal(generated, tokens)


@pytest.mark.parametrize("kind", ["dynamic", "static", "int8", "paged", "paged-int8"])
def test_latent_decoding_runs_absorbed_over_the_latents_and_equals_eager(model, kind, monkeypatch):
    m, ids, (logits, tokens) = model
    calls = []
    real = hf_deepseek.mla_decode

    def spy(q, rows, **kw):
        calls.append((q.shape[2], rows.shape[-1]))
        return real(q, rows, **kw)

    monkeypatch.setattr(hf_deepseek, "mla_decode", spy)
    sizes = dict(max_batch_size=2, block_size=5) if kind.startswith("paged") else {}
    with torch.no_grad(), use_latent_decoding():
        cache = latent_cache(m.config, kind, max_cache_len=32, **sizes)
        chunks = [m(ids[:, a:b], past_key_values=cache).logits for a, b in ((0, 9), (9, 12), (12, 13))]
        generated = m.generate(ids, max_new_tokens=6, do_sample=False,
                               past_key_values=latent_cache(m.config, kind, max_cache_len=32, **sizes))
    got = torch.cat(chunks, 1)
    width = m.config.kv_lora_rank + m.config.qk_rope_head_dim
    assert calls and all(w == width for _, w in calls)  # absorbed over the 40-number rows
    assert cache.get_seq_length() == 13
    err = (got - logits).abs().max() / logits.abs().max()
    if kind.endswith("int8"):
        assert 0 < err < 0.03
    else:
        assert err <= 1e-5 and torch.equal(generated, tokens)
    assert m.model.layers[0].self_attn.forward.__func__ is type(m.model.layers[0].self_attn).forward  # restored


def test_a_latent_cache_serves_transformers_own_layer(model):
    m, ids, (_, tokens) = model
    with torch.no_grad():
        generated = m.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=latent_cache(m.config))
    assert torch.equal(generated, tokens)


def test_bad_arguments_name_themselves(model):
    with pytest.raises(ValueError, match="kind"):
        latent_cache(model[0].config, "ring")
    with pytest.raises(ValueError, match="max_cache_len"):
        latent_cache(model[0].config, "static")
