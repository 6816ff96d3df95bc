"""A GPT2LMHeadModel's weights in attnkit's GPT: same logits, same greedy tokens, with and without caches."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit  # noqa: E402
from attnkit.interop import gpt2_from_hf  # noqa: E402
from attnkit import Causal  # noqa: E402
from attnkit.masks import Padding  # noqa: E402

from .reference import exact_backends_taking  # noqa: E402

ATOL = 1e-5


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # GPT-2's 0.02 init gives near-uniform logits: widen them so greedy ties cannot occur
        hf.transformer.wte.weight.mul_(20)
    return hf, gpt2_from_hf(hf)


def prompt(left_padding: bool):
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (3, 12))
    am = torch.ones_like(ids)
    if left_padding:
        am[1, :3] = 0
        am[2, :7] = 0
    return ids, am


def test_tied_and_transposed(pair):
    hf, ours = pair
    assert ours.lm_head.weight is ours.embed.tokens.weight
    assert torch.equal(ours.layers[0].self_attn.qkv_proj.weight, hf.transformer.h[0].attn.c_attn.weight.t())


@pytest.mark.parametrize("backend", exact_backends_taking(
    lambda B, T: Causal() & Padding(torch.ones(B, T, dtype=torch.bool))))
@pytest.mark.parametrize("left_padding", [False, True])
def test_logits_match_hf(pair, backend, left_padding):
    hf, ours = pair
    ids, am = prompt(left_padding)
    with torch.no_grad():
        position_ids = (am.cumsum(-1) - 1).clamp(min=0)  # attnkit's convention for left padding
        want = hf(ids, attention_mask=am, position_ids=position_ids).logits
        with attnkit.use_backend(backend):
            got = ours(ids, attention_mask=am)
    keep = am.bool()  # padded positions are not tokens; HF's eager/sdpa disagree there too
    assert (got - want)[keep].abs().max().item() <= ATOL


def greedy_without_cache(model, ids, steps):
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("cache", ["none", "dynamic", "static"])
def test_greedy_generation_identical(pair, cache):
    hf, ours = pair
    ids, _ = prompt(False)
    steps = 12
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None)
        want_no_cache = hf.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None,
                                    use_cache=False)
    assert torch.equal(want, want_no_cache)
    if cache == "none":
        got = greedy_without_cache(ours, ids, steps)
    else:
        got = ours.generate(ids, steps, temperature=0.0, cache=cache)
    assert torch.equal(got, want)


def test_unsupported_gpt2_variant_is_refused():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        gpt2_from_hf(transformers.GPT2LMHeadModel(config))


def test_mismatched_model_is_refused(pair):
    from attnkit.interop import gpt2_config_from_hf, load_gpt2_state_dict
    from attnkit.nn.models import GPT

    hf, _ = pair
    one_layer = GPT(gpt2_config_from_hf(hf.config, num_layers=1))
    with pytest.raises(ValueError, match=r"unexpected \['layers\.1\."):
        load_gpt2_state_dict(one_layer, hf.state_dict())


def test_greedy_generation_left_padded_batch(pair):
    hf, ours = pair
    ids, am = prompt(True)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
    got = ours.generate(ids, 8, temperature=0.0, cache="static", attention_mask=am)
    assert torch.equal(got, want)
