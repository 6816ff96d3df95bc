"""attn_implementation="attnkit": HF's own model code on attnkit backends equals eager / sdpa."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnkit  # noqa: E402
from attnkit import Causal, Dense, KeyPadding, SlidingWindow  # noqa: E402
from attnkit.masks import Padding  # noqa: E402
from attnkit.interop import HFMask, attnkit_mask, register_hf_attention  # noqa: E402
from attnkit.registry import list_backends as backends  # noqa: E402
from transformers import masking_utils  # noqa: E402

from .reference import exact_backends_taking  # noqa: E402

IMPLS = ("eager", "sdpa", "attnkit")
ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_hf_attention()


def run_all(model_cls, config, *, backend=None, **inputs):
    """Output (first tensor) of the same random model under each attn_implementation."""
    outs = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        model = model_cls(config).eval()
        model.set_attn_implementation(impl)
        with torch.no_grad(), attnkit.use_backend(backend) if backend and impl == "attnkit" else _null():
            out = model(**inputs)
        outs[impl] = out.logits if hasattr(out, "logits") else out[0]
    return outs


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def tiny_bert():
    return transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128)


def batch(T=19, right=True):
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (3, T))
    am = torch.ones(3, T, dtype=torch.long)
    if right:
        am[1, T - 4 :] = 0
        am[2, 6:] = 0
    else:
        am[1, :4] = 0
        am[2, : T - 6] = 0
    return ids, am


def assert_close_on_tokens(outs, am):
    keep = am.bool()  # padded query rows differ between HF's own implementations: compare real tokens
    for impl in ("eager", "sdpa"):
        err = (outs["attnkit"] - outs[impl])[keep].abs().max().item()
        assert err <= ATOL, f"attnkit vs {impl}: {err}"


@pytest.mark.parametrize("backend", exact_backends_taking(lambda B, T: Padding(torch.ones(B, T, dtype=torch.bool))))
def test_bert_padding_every_exact_backend(backend):
    ids, am = batch(right=True)
    outs = run_all(transformers.BertModel, tiny_bert(), backend=backend, input_ids=ids, attention_mask=am)
    assert_close_on_tokens(outs, am)


@pytest.mark.parametrize("backend", exact_backends_taking(
    lambda B, T: Causal() & Padding(torch.ones(B, T, dtype=torch.bool))))
def test_gpt2_left_padding_every_exact_backend(backend):
    ids, am = batch(right=False)
    config = transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    outs = run_all(transformers.GPT2LMHeadModel, config, backend=backend, input_ids=ids, attention_mask=am)
    assert_close_on_tokens(outs, am)


def mistral_config(window=5):
    return transformers.MistralConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, sliding_window=window,
                                      max_position_embeddings=128)


@pytest.mark.parametrize("backend", exact_backends_taking(
    lambda B, T: SlidingWindow(4, 0) & Padding(torch.ones(B, T, dtype=torch.bool))))
def test_sliding_window_gqa_model_every_exact_backend(backend):
    """Mistral (GQA, sliding window 5 over 19 tokens, left padding): the window reaches attnkit as a
    structured SlidingWindow mask, so sliding-window backends can run it."""
    ids, am = batch(right=False)
    outs = run_all(transformers.MistralForCausalLM, mistral_config(), backend=backend, input_ids=ids,
                   attention_mask=am)
    assert_close_on_tokens(outs, am)


def seeded_mistral(impl: str, window: int = 4):
    """The same random Mistral model under ``attn_implementation=impl``."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(mistral_config(window=window)).eval()
    model.set_attn_implementation(impl)
    return model


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_cache_matches_sdpa(cache):
    ids, am = batch(T=7, right=False)
    tokens = {}
    for impl in ("sdpa", "attnkit"):
        model = seeded_mistral(impl)
        kwargs = {"cache_implementation": "static"} if cache == "static" else {}
        tokens[impl] = model.generate(ids, attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                      **kwargs)
    assert torch.equal(tokens["attnkit"], tokens["sdpa"])


# -- the mask function ---------------------------------------------------------------------------


def make(mask_function, attention_mask=None, B=2, Tq=6, Tk=6, q_offset=0, kv_offset=0):
    return attnkit_mask(batch_size=B, q_length=Tq, kv_length=Tk, q_offset=q_offset, kv_offset=kv_offset,
                        mask_function=mask_function, attention_mask=attention_mask)


def assert_same_as_sdpa_mask(got: HFMask, mask_function, attention_mask=None, B=2, Tq=6, Tk=6, q_offset=0,
                             kv_offset=0):
    ref = masking_utils.sdpa_mask(batch_size=B, q_length=Tq, kv_length=Tk, q_offset=q_offset, kv_offset=kv_offset,
                                  mask_function=mask_function, attention_mask=attention_mask,
                                  allow_is_causal_skip=False)
    if got.mask is None:
        assert bool(ref.all())
        return
    keep = got.mask.materialize(Tq, Tk, q_offset=got.q_offset, kv_offset=got.kv_offset)
    assert torch.equal(keep.expand(B, 1, Tq, Tk), ref)


def test_mask_recognizes_structure():
    causal = make(masking_utils.causal_mask_function)
    assert causal.mask == Causal()
    window = make(masking_utils.sliding_window_causal_mask_function(3), Tq=8, Tk=8)
    assert window.mask == SlidingWindow(2, 0)
    assert_same_as_sdpa_mask(window, masking_utils.sliding_window_causal_mask_function(3), Tq=8, Tk=8)
    assert make(masking_utils.bidirectional_mask_function).mask is None
    both = make(masking_utils.sliding_window_bidirectional_mask_function(2), Tq=8, Tk=8)
    assert both.mask == SlidingWindow(2, 2)


def test_mask_decode_step_and_static_cache_offsets():
    # one query at position 5 over a static cache of 10 slots: keys 6..9 are empty slots
    static = make(masking_utils.causal_mask_function, Tq=1, Tk=10, q_offset=5)
    assert static.mask == Causal() and static.q_offset == 5 and static.kv_offset == 0
    assert_same_as_sdpa_mask(static, masking_utils.causal_mask_function, Tq=1, Tk=10, q_offset=5)
    # a decode step over a full dynamic cache hides nothing
    assert make(masking_utils.causal_mask_function, Tq=1, Tk=10, q_offset=9).mask is None


def test_mask_padding_kinds():
    right = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]).bool()
    got = make(masking_utils.bidirectional_mask_function, right)
    assert isinstance(got.mask, KeyPadding) and got.mask.lengths.tolist() == [6, 3]
    left = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]).bool()
    got = make(masking_utils.causal_mask_function, left)
    assert Causal() in got.mask.conjuncts()
    assert any(isinstance(p, Padding) for p in got.mask.conjuncts())
    assert_same_as_sdpa_mask(got, masking_utils.causal_mask_function, left)


def test_mask_unrecognized_pattern_falls_back_to_hf_dense_mask():
    strided = lambda b, h, q, k: (k <= q) & (k % 2 == 0)  # noqa: E731
    got = make(strided, Tq=8, Tk=8)
    assert isinstance(got.mask, Dense)
    assert_same_as_sdpa_mask(got, strided, Tq=8, Tk=8)


def test_chunked_causal_pattern_is_read_as_documents():
    """Chunked attention (causal within chunks) is block-diagonal causal: Document & Causal, exact."""
    chunked = masking_utils.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))
    got = make(chunked, Tq=8, Tk=8)
    assert {type(m) for m in got.mask.leaves()} == {attnkit.Document, Causal}
    assert_same_as_sdpa_mask(got, chunked, Tq=8, Tk=8)


# -- backend choice ------------------------------------------------------------------------------


def test_config_backend_is_used_and_checked():
    ids, am = batch()
    model = transformers.BertModel(tiny_bert()).eval()
    model.set_attn_implementation("attnkit")
    model.config.attnkit_backend = "no-such-backend"
    with pytest.raises(ValueError, match="no-such-backend"):
        model(input_ids=ids, attention_mask=am)


def test_use_backend_scope_reaches_hf_layers(monkeypatch):
    calls = []
    naive = backends()["naive"]
    original = naive.forward.__func__

    def spy(cls, inp, options):
        calls.append(type(inp.mask).__name__)
        return original(cls, inp, options)

    monkeypatch.setattr(naive, "forward", classmethod(spy))
    ids, am = batch()
    model = transformers.BertModel(tiny_bert()).eval()
    model.set_attn_implementation("attnkit")
    with torch.no_grad(), attnkit.use_backend("naive"):
        model(input_ids=ids, attention_mask=am)
    assert calls == ["KeyPadding", "KeyPadding"]  # two layers, right padding kept structured


def test_mask_with_holes_is_not_taken_for_a_window():
    def holes(b, h, q, kv):  # causal, but every third key hidden: same bounds as Causal, not a band
        return (kv <= q) & (kv % 3 != 1)

    got = make(holes, Tq=7, Tk=7)
    assert isinstance(got.mask, Dense)
    assert_same_as_sdpa_mask(got, holes, Tq=7, Tk=7)


@pytest.mark.parametrize("window", [1, 3, 8, 40])
@pytest.mark.parametrize("Tq,Tk,q_offset,kv_offset", [(9, 9, 0, 0), (1, 12, 11, 0), (1, 12, 4, 0), (3, 6, 10, 7),
                                                     (4, 20, 2, 0)])
def test_mask_equals_sdpa_mask_for_windows_and_offsets(window, Tq, Tk, q_offset, kv_offset):
    for fn in (masking_utils.sliding_window_causal_mask_function(window), masking_utils.causal_mask_function,
               masking_utils.sliding_window_bidirectional_mask_function(window)):
        got = make(fn, B=1, Tq=Tq, Tk=Tk, q_offset=q_offset, kv_offset=kv_offset)
        assert not isinstance(got.mask, Dense), got.mask  # every one of these is a band
        assert_same_as_sdpa_mask(got, fn, B=1, Tq=Tq, Tk=Tk, q_offset=q_offset, kv_offset=kv_offset)


# -- score modifiers and sinks: Gemma-2 (soft-capping, alternating sliding windows), gpt-oss (sinks), T5 --
def gemma2_config():
    return transformers.Gemma2Config(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, sliding_window=4, attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0, max_position_embeddings=128, query_pre_attn_scalar=16,
    )


def gpt_oss_config():
    return transformers.GptOssConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=128, layer_types=["sliding_attention", "full_attention"],
    )


def _with_random_sinks(model):
    for module in model.modules():
        if hasattr(module, "sinks") and isinstance(module.sinks, torch.nn.Parameter):
            with torch.no_grad():
                module.sinks.normal_(0.0, 2.0)  # large enough to matter
    return model


def _outputs(model_cls, config, impls, **inputs):
    outs = {}
    for impl in impls:
        torch.manual_seed(0)
        model = _with_random_sinks(model_cls(config).eval())
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model(**inputs).logits
    return outs


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_and_sink_models_equal_eager_with_left_padding(family):
    model_cls, config = {
        "gemma2": (transformers.Gemma2ForCausalLM, gemma2_config),
        "gpt_oss": (transformers.GptOssForCausalLM, gpt_oss_config),
    }[family]
    ids, am = batch(T=11, right=False)
    outs = _outputs(model_cls, config(), ("eager", "attnkit"), input_ids=ids, attention_mask=am)
    keep = am.bool()
    err = (outs["attnkit"] - outs["eager"])[keep].abs().max().item()
    assert err <= ATOL, f"{family}: attnkit vs eager {err}"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_and_sink_models_generate_like_eager(family, cache):
    model_cls, config = {
        "gemma2": (transformers.Gemma2ForCausalLM, gemma2_config),
        "gpt_oss": (transformers.GptOssForCausalLM, gpt_oss_config),
    }[family]
    ids, am = batch(T=7, right=False)
    tokens = {}
    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)
        model = _with_random_sinks(model_cls(config()).eval())
        model.set_attn_implementation(impl)
        kwargs = {"cache_implementation": "static"} if cache == "static" else {}
        tokens[impl] = model.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                      **kwargs)
    assert torch.equal(tokens["attnkit"], tokens["eager"])


def test_t5_encoder_decoder_equals_eager():
    config = transformers.T5Config(vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0)
    ids, am = batch(T=9, right=True)
    outs = _outputs(transformers.T5ForConditionalGeneration, config, ("eager", "attnkit"), input_ids=ids,
                    attention_mask=am, decoder_input_ids=ids[:, :5])
    assert (outs["attnkit"] - outs["eager"]).abs().max().item() <= ATOL


def test_output_attentions_returns_the_weights():
    ids, am = batch(T=7, right=False)
    weights = {}
    for impl in ("eager", "attnkit"):
        with torch.no_grad():
            weights[impl] = seeded_mistral(impl)(ids, attention_mask=am, output_attentions=True).attentions
    assert len(weights["attnkit"]) == mistral_config().num_hidden_layers
    for ours, eager in zip(weights["attnkit"], weights["eager"]):
        rows = am.bool()[:, None, :, None].expand_as(ours)  # eager's rows of padding queries are arbitrary
        torch.testing.assert_close(ours[rows], eager[rows], atol=ATOL, rtol=0)


def test_sliding_window_decode_steps_run_on_the_named_sliding_window_backend():
    """A decode step over more keys than the window is SlidingWindow(w - 1, 0), not (w - 1, None)."""
    window = masking_utils.sliding_window_causal_mask_function(4)
    step = make(window, B=1, Tq=1, Tk=9, q_offset=8)
    assert step.mask == SlidingWindow(3, 0)
    assert_same_as_sdpa_mask(step, window, B=1, Tq=1, Tk=9, q_offset=8)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    kw = dict(mask=step.mask, q_offset=step.q_offset, kv_offset=step.kv_offset)
    torch.testing.assert_close(attnkit.attention(q, k, v, backend="sliding_window", **kw),
                               attnkit.attention(q, k, v, backend="naive", **kw))


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_output_attentions_weights_include_softcap_and_sinks(family):
    """The weights HF returns with output_attentions=True are eager's: soft-capped logits (Gemma-2),
    and the sink's share left out of every row (gpt-oss: rows sum to less than 1)."""
    model_cls, config = {
        "gemma2": (transformers.Gemma2ForCausalLM, gemma2_config),
        "gpt_oss": (transformers.GptOssForCausalLM, gpt_oss_config),
    }[family]
    ids, am = batch(T=9, right=False)
    config = config()
    if family == "gemma2":
        config.attn_logit_softcapping = 0.05  # small enough that the cap changes this tiny model's weights
    weights = {}
    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)
        model = _with_random_sinks(model_cls(config).eval())
        model.set_attn_implementation(impl)
        with torch.no_grad():
            weights[impl] = model(ids, attention_mask=am, output_attentions=True).attentions
    assert len(weights["attnkit"]) == 2
    for ours, eager in zip(weights["attnkit"], weights["eager"]):
        rows = am.bool()[:, None, :, None].expand_as(ours)  # eager's rows of padding queries are arbitrary
        torch.testing.assert_close(ours[rows], eager[rows], atol=ATOL, rtol=0)
        sums = ours.sum(-1)[am.bool()[:, None, :].expand(-1, ours.shape[1], -1)]
        if family == "gpt_oss":
            assert bool((sums < 1 - 1e-6).all()) and float(sums.min()) < 0.9  # the sinks keep part of each row's mass
        else:
            torch.testing.assert_close(sums, torch.ones_like(sums))


@pytest.mark.parametrize("fill,finite", [("min", False), ("-inf", True)], ids=["finfo-min", "-inf-and-finite-part"])
def test_gemma2_with_a_4d_float_mask_soft_caps_before_masking_like_eager(fill, finite):
    """A 4-D float mask handed to Gemma-2: eager soft-caps the scores, then adds the mask, so a masked
    key gets weight 0 (not the weight of a score of -cap) and a finite part lands after the cap."""
    config = gemma2_config()
    config.attn_logit_softcapping = 0.5  # small: the cap shapes this tiny model's scores
    B, T = 3, 12
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 100, (B, T), generator=g)
    keep = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    if not finite:
        keep[1, :, :, :4] = False  # left padding: the first 4 queries of row 1 see nothing
    keep[2, :, 6:, 2:5] = False  # holes
    value = torch.finfo(torch.float32).min if fill == "min" else float("-inf")
    bias = -2 * torch.rand(B, 1, T, T, generator=g) if finite else torch.zeros(B, 1, T, T)
    mask4d = bias.masked_fill(~keep, value)
    outs = _outputs(transformers.Gemma2ForCausalLM, config, ("eager", "attnkit"), input_ids=ids, attention_mask=mask4d)
    rows = keep.any(-1)[:, 0]  # query rows that see a key (eager's fully masked rows are arbitrary)
    assert rows.sum() < B * T or finite
    err = (outs["attnkit"] - outs["eager"])[rows].abs().max().item()
    assert err <= ATOL, f"attnkit vs eager: {err}"


def test_mask_structure_is_read_from_how_transformers_built_it_not_evaluated():
    """At 300,000 tokens the (Tq, Tk) grid would be 90 GB: recognizing the function itself is the only way
    through (causal, sliding window, bidirectional window, and packed documents from position ids)."""
    n = 300_000
    assert make(masking_utils.causal_mask_function, B=1, Tq=n, Tk=n).mask == Causal()
    assert make(masking_utils.sliding_window_causal_mask_function(4), B=1, Tq=n, Tk=n).mask == SlidingWindow(3, 0)
    assert make(masking_utils.sliding_window_bidirectional_mask_function(4), B=1, Tq=n, Tk=n).mask == \
        SlidingWindow(4, 4)
    positions = torch.cat([torch.arange(n // 2), torch.arange(n - n // 2)])[None]
    ids = masking_utils.find_packed_sequence_indices(positions)
    packed = masking_utils.packed_sequence_compatibility_function(masking_utils.causal_mask_function, positions, ids)
    got = make(packed, B=1, Tq=n, Tk=n)
    assert {type(m) for m in got.mask.leaves()} == {attnkit.Document, Causal}
    small = torch.cat([torch.arange(3), torch.arange(4)])[None]
    small_packed = masking_utils.packed_sequence_compatibility_function(
        masking_utils.causal_mask_function, small, masking_utils.find_packed_sequence_indices(small))
    assert_same_as_sdpa_mask(make(small_packed, B=1, Tq=7, Tk=7), small_packed, B=1, Tq=7, Tk=7)


def test_packed_position_ids_under_a_plain_causal_mask_are_named_once(monkeypatch):
    """With a cache, transformers does not detect packing: attnkit says so, once, naming the fix; without a
    cache the documents are read (no warning)."""
    import warnings

    from attnkit.interop import hf_attention

    monkeypatch.setattr(hf_attention, "_WARNED_PACKED", [False])
    monkeypatch.setattr(hf_attention, "_CHECKED_POSITIONS", [None])
    register_hf_attention()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("attnkit")
    ids = torch.randint(0, 64, (1, 12))
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(ids, position_ids=pos, use_cache=False)
        assert not [w for w in caught if "position_ids restart" in str(w.message)]
        model(ids, position_ids=pos, use_cache=True)
        model(ids, position_ids=pos, use_cache=True)
    named = [w for w in caught if "position_ids restart" in str(w.message)]
    assert len(named) == 1 and "use_cache=False" in str(named[0].message)


@pytest.mark.skipif(attnkit.backends.native.load_extension()[0] is None,  # auto then runs tiled: its tile loop
                    reason="native extension not built")            # reads its tile grid on the host
@pytest.mark.parametrize("batch", ["plain", "padded", "packed"])
def test_an_hf_model_on_attnkit_compiles_fullgraph_under_auto_and_equals_eager(batch):
    register_hf_attention()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("attnkit")
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids}
    if batch == "padded":
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[1, 13:] = 0
        kwargs["attention_mask"] = mask
    elif batch == "packed":
        kwargs = {"input_ids": ids[:1], "position_ids": torch.cat([torch.arange(8), torch.arange(12)])[None]}

    def logits(**kw):
        return model(**kw, use_cache=False).logits

    torch._dynamo.reset()
    compiled = torch.compile(logits, fullgraph=True, backend="aot_eager")  # a graph break raises
    with torch.no_grad():
        got, ref = compiled(**kwargs), logits(**kwargs)
    torch._dynamo.reset()
    keep = kwargs["attention_mask"].bool() if batch == "padded" else torch.ones(got.shape[:2], dtype=torch.bool)
    torch.testing.assert_close(got[keep], ref[keep], rtol=1e-5, atol=1e-5)
