"""Hugging Face packed training on attnkit: DataCollatorWithFlattening batches run as packed sequences."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnkit import Causal, Document  # noqa: E402
from attnkit.interop import attnkit_mask, register_hf_attention  # noqa: E402
from transformers import DataCollatorWithFlattening, masking_utils  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_hf_attention()


def _configs():
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)),
            "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**common))}


def _sequences(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in lengths]


def _padded_loss(model, seqs):
    T = max(map(len, seqs))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    am = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        am[i, : len(s)] = 1
    labels = ids.masked_fill(am == 0, -100)
    return model(input_ids=ids, attention_mask=am, labels=labels).loss


def _packed_loss(model, seqs):
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s} for s in seqs])
    assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
    # use_cache=False, as in training: with a cache transformers does not look for packed sequences
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                 use_cache=False).loss


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_batch_loss_equals_the_padded_batch(family, monkeypatch):
    from attnkit.interop import hf_attention

    seen = []
    forward = hf_attention.attnkit_attention_forward

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append(attention_mask.mask)
        return forward(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(hf_attention, "attnkit_attention_forward", spy)
    register_hf_attention()
    model_cls, config = _configs()[family]
    torch.manual_seed(0)
    model = model_cls(config)
    model.set_attn_implementation("attnkit")
    seqs = _sequences([11, 3, 17, 6])
    padded, packed = _padded_loss(model, seqs), _packed_loss(model, seqs)
    assert abs(padded.item() - packed.item()) < 1e-5
    assert Document in {type(m) for m in seen[-1].leaves()}  # the packed batch ran as packed sequences
    grads = {}
    for name, loss in (("padded", padded), ("packed", packed)):
        model.zero_grad()
        loss.backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["padded"], grads["packed"]):
        assert (a - b).abs().max() < 1e-5


def test_packed_pattern_becomes_a_document_mask():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    packed = masking_utils.packed_sequence_compatibility_function(masking_utils.causal_mask_function, position_ids,
                                                                   ids)
    got = attnkit_mask(batch_size=1, q_length=9, kv_length=9, mask_function=packed)
    assert Document in {type(m) for m in got.mask.leaves()}
    expected = (ids[0][:, None] == ids[0][None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    assert torch.equal(got.mask.materialize(9, 9, q_offset=0)[0, 0], expected)
    assert repr(got.mask).startswith("And(") and got.mask.band().right == 0  # Document & Causal: tiles skip


def test_a_block_pattern_that_is_not_packing_stays_exact():
    """Blocks that are neither causal nor full per sequence are kept as HF's dense mask."""
    keep = torch.tensor([[1, 1, 0, 0], [0, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    got = attnkit_mask(batch_size=1, q_length=4, kv_length=4, mask_function=lambda b, h, q, k: keep[q, k])
    assert torch.equal(got.mask.materialize(4, 4, q_offset=0).reshape(4, 4), keep)
    assert Causal() not in got.mask.leaves()


@pytest.fixture(autouse=True)
def _restore_registration():
    yield
    register_hf_attention()  # a test may register a spy; later tests get the real forward back
