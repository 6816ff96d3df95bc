import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit.registry import list_backends as backends
from attnkit.nn import GPT, Encoder, EncoderDecoder, TransformerConfig, ViT, ViTConfig


def _cfg(**kw):
    base = dict(vocab_size=40, embed_dim=32, num_layers=2, num_heads=4, max_len=64)
    return TransformerConfig(**{**base, **kw})


def test_gpt_shapes_tied_embeddings_and_causality():
    torch.manual_seed(0)
    model = GPT(_cfg()).eval()
    assert model.lm_head.weight is model.embed.tokens.weight
    x = torch.randint(0, 40, (2, 12))
    logits = model(x)
    assert logits.shape == (2, 12, 40)
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % 40
    assert torch.allclose(model(y)[:, :8], logits[:, :8], atol=1e-6)
    untied = GPT(_cfg(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.tokens.weight


def test_gpt_hidden_states():
    model = GPT(_cfg(num_layers=3)).eval()
    logits, hidden = model(torch.randint(0, 40, (1, 5)), output_hidden_states=True)
    assert len(hidden) == 4 and all(h.shape == (1, 5, 32) for h in hidden)
    assert torch.allclose(model.lm_head(hidden[-1]), logits)


def test_bert_style_encoder_padding_and_token_types():
    cfg = _cfg(norm_first=False, embedding_norm=True, type_vocab_size=2, final_norm=False)
    model = Encoder(cfg).eval()
    assert model.embed.token_types.num_embeddings == 2 and model.embed.norm is not None
    x = torch.randint(0, 40, (2, 9))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, 6:] = 0  # right padding in row 1
    out, hidden = model(x, attention_mask=attention_mask, output_hidden_states=True)
    assert out.shape == (2, 9, 32) and len(hidden) == cfg.num_layers + 1
    alone = model(x[1:, :6])
    assert torch.allclose(out[1, :6], alone[0], atol=1e-5)
    types = torch.zeros(2, 9, dtype=torch.long)
    types[:, 4:] = 1
    assert not torch.allclose(model(x, token_type_ids=types), model(x))
    # a bool keep mask (True = attend) is combined with attention_mask
    keep = torch.ones(1, 1, 9, 9, dtype=torch.bool)
    assert torch.allclose(model(x, mask=keep, attention_mask=attention_mask), out)
    with pytest.raises(ValueError, match="attention_mask"):
        model(x, attention_mask=attention_mask[:, :5])


def test_encoder_inputs_embeds():
    model = Encoder(_cfg()).eval()
    x = torch.randint(0, 40, (1, 4))
    assert torch.allclose(model(inputs_embeds=model.embed.tokens(x)), model(x))
    with pytest.raises(ValueError):
        model(x, inputs_embeds=model.embed.tokens(x))


def test_seq2seq_shapes_and_source_padding():
    model = EncoderDecoder(_cfg()).eval()
    assert model.decoder.embed.tokens is model.encoder.embed.tokens
    src, tgt = torch.randint(0, 40, (2, 7)), torch.randint(0, 40, (2, 5))
    assert model(src, tgt).shape == (2, 5, 40)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 4:] = 0
    padded = model(src, tgt, attention_mask=mask)
    alone = model(src[:1, :4], tgt[:1])
    assert torch.allclose(padded[0], alone[0], atol=1e-5)


@pytest.mark.parametrize("position", ["sincos2d", "learned", "none"])
def test_vit_shapes(position):
    cfg = ViTConfig(embed_dim=32, num_layers=2, num_heads=4, image_size=16, patch_size=4, num_classes=7,
                    position=position)
    model = ViT(cfg)
    assert model.features(torch.randn(3, 3, 16, 16)).shape == (3, 17, 32)
    assert model(torch.randn(3, 3, 16, 16)).shape == (3, 7)
    with pytest.raises(ValueError, match="pixel_values"):
        model(torch.randn(3, 3, 15, 16))
    with pytest.raises(ValueError):
        ViTConfig(image_size=10, patch_size=4)


def test_models_run_with_a_named_backend():
    x = torch.randint(0, 40, (2, 6))
    model = GPT(_cfg()).eval()
    ref = model(x)
    probe = attnkit.AttentionInputs.create(*(torch.zeros(1, 1, 2, 4),) * 3, mask=attnkit.Causal())
    for name, impl in backends().items():
        if not impl.exact or impl.not_supported_reasons(probe):  # e.g. block_sparse needs a BlockSparse mask
            continue
        with attnkit.use_backend(name):
            assert torch.allclose(model(x), ref, atol=1e-5), name
    named = GPT(_cfg(backend="naive")).eval()
    named.load_state_dict(model.state_dict())
    assert torch.allclose(named(x), ref, atol=1e-5)


def test_learned_positions_error_names_max_len():
    with pytest.raises(ValueError, match="max_len"):
        GPT(_cfg(max_len=8))(torch.randint(0, 40, (1, 9)))


def test_training_reduces_loss_on_sequence_reversal():
    torch.manual_seed(0)
    V, L, BOS = 8, 4, 7
    model = EncoderDecoder(_cfg(vocab_size=V, num_layers=1, max_len=16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        src = torch.randint(1, 6, (32, L))
        tgt = src.flip(1)
        dec_in = torch.cat([torch.full((32, 1), BOS), tgt[:, :-1]], 1)  # teacher forcing
        loss = F.cross_entropy(model(src, dec_in).reshape(-1, V), tgt.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10


def test_gpt_training_reduces_loss():
    torch.manual_seed(0)
    model = GPT(_cfg(vocab_size=16, position="rope", gated=True, activation="silu", norm="rmsnorm", num_kv_heads=2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    seq = torch.arange(16).repeat(8, 2)[:, :20]  # counting mod 16: next token is predictable
    losses = []
    for _ in range(25):
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 16), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
