import pytest
import torch

from attnkit.generation import generate, process_logits, stream
from attnkit.nn import EncoderDecoder, TransformerConfig

from .inputs import tiny_gpt


def _gpt(position="learned", **kw):
    return tiny_gpt(position=position, **kw)


def test_greedy_equals_argmax_of_full_forward():
    model = _gpt()
    prompt = torch.randint(1, 50, (2, 5))
    out = generate(model, prompt, 8)
    assert out.shape == (2, 13) and torch.equal(out[:, :5], prompt)
    with torch.no_grad():
        assert torch.equal(model(out[:, :-1]).argmax(-1)[:, 4:], out[:, 5:])


def test_cache_kinds_agree():
    model = _gpt(position="rope", sliding_window=4)
    prompt = torch.randint(1, 50, (2, 6))
    outs = [generate(model, prompt, 10, cache=kind) for kind in ("static", "dynamic", "sliding_window")]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# HF tokenizers pad on the right by default; both sides must give each row what it gets alone.
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("position,cache", [(p, c) for p in ("learned", "rope", "alibi", "sinusoidal")
                                            for c in ("static", "dynamic", "paged")])
def test_padded_batch_equals_each_prompt_alone(position, cache, side):
    model = _gpt(position)
    prompts = [torch.randint(1, 50, (n,)) for n in (7, 3, 5)]
    P = max(len(p) for p in prompts)
    batch = torch.zeros(3, P, dtype=torch.long)
    attention_mask = torch.zeros(3, P, dtype=torch.long)
    for i, p in enumerate(prompts):
        cols = slice(P - len(p), P) if side == "left" else slice(0, len(p))
        batch[i, cols], attention_mask[i, cols] = p, 1
    out = generate(model, batch, 6, attention_mask=attention_mask, cache=cache)
    assert torch.equal(out[:, :P], batch)  # the prompts are returned as given
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], 6)
        assert torch.equal(out[i, P:], alone[0, len(p):]), i


def test_stream_yields_the_generated_tokens():
    model = _gpt()
    prompt = torch.randint(1, 50, (2, 4))
    steps = list(stream(model, prompt, 5))
    assert len(steps) == 5 and all(s.shape == (2,) for s in steps)
    assert torch.equal(torch.stack(steps, 1), generate(model, prompt, 5)[:, 4:])


def test_stop_tokens_and_budget():
    model = _gpt()
    prompt = torch.randint(1, 50, (2, 4))
    free = generate(model, prompt, 6)
    stop = int(free[0, 5])  # row 0's second new token
    out = generate(model, prompt, 6, stop_tokens=[stop], pad_token_id=0)
    assert torch.equal(out[0, :6], free[0, :6])
    assert (out[0, 6:] == 0).all() or out.shape[1] == 6
    if not (free[1, 4:] == stop).any():
        assert out.shape[1] == 10 and torch.equal(out[1], free[1])
    both = generate(model, prompt, 6, stop_tokens=free[:, 4].tolist())
    assert both.shape == (2, 5)  # every row stopped at its first token: the stream ends early


def test_sampling_is_reproducible_and_filters_reduce_to_greedy():
    model = _gpt()
    prompt = torch.randint(1, 50, (2, 4))
    a = generate(model, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    greedy = generate(model, prompt, 8)
    assert torch.equal(generate(model, prompt, 8, temperature=0.7, top_k=1), greedy)
    assert torch.equal(generate(model, prompt, 8, temperature=0.7, top_p=1e-6), greedy)


def test_process_logits():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    top2 = process_logits(logits, top_k=2)
    assert torch.isinf(top2[0, 2:]).all() and torch.equal(top2[0, :2], logits[0, :2])
    probs = logits.softmax(-1)[0]  # ~[0.61, 0.22, 0.14, 0.03]
    nucleus = process_logits(logits, top_p=0.7)  # 0.61 < 0.7: the first two are kept
    assert torch.isfinite(nucleus[0, :2]).all() and torch.isinf(nucleus[0, 2:]).all()
    assert probs[0] < 0.7 < probs[0] + probs[1]
    seen = torch.tensor([[True, False, False, True]])
    pen = process_logits(logits, seen=seen, repetition_penalty=2.0)
    assert pen.tolist() == [[1.0, 1.0, 0.5, -2.0]]
    assert torch.allclose(process_logits(logits, temperature=0.5), logits * 2)


def test_repetition_penalty_discourages_repeats():
    model = _gpt()
    prompt = torch.randint(1, 50, (1, 4))
    penalized = generate(model, prompt, 12, repetition_penalty=100.0)[0]
    new = penalized[4:].tolist()
    assert len(set(new)) == len(new) and not set(new) & set(prompt[0].tolist())


def test_seq2seq_generation_equals_greedy_full_forward_and_handles_source_padding():
    torch.manual_seed(0)
    model = EncoderDecoder(TransformerConfig(vocab_size=30, embed_dim=32, num_layers=2, num_heads=4)).eval()
    src = torch.randint(2, 30, (2, 6))
    for cache in ("static", "dynamic"):
        out = generate(model, src, 5, decoder_start_token=1, cache=cache)
        assert out.shape == (2, 6) and (out[:, 0] == 1).all()
        with torch.no_grad():
            assert torch.equal(model(src, out[:, :-1]).argmax(-1), out[:, 1:])
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    padded = generate(model, src, 5, decoder_start_token=1, attention_mask=mask)
    alone = generate(model, src[1:, :4], 5, decoder_start_token=1)
    assert torch.equal(padded[1], alone[0])
    with pytest.raises(ValueError, match="decoder_start_token"):
        generate(model, src, 3)


def test_generate_method_and_argument_errors():
    model = _gpt()
    prompt = torch.randint(1, 50, (1, 3))
    assert torch.equal(model.generate(prompt, 4), generate(model, prompt, 4))
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_k=0), dict(top_p=1.5),
                dict(repetition_penalty=0.0), dict(cache="paging"), dict(attention_mask=torch.ones(1, 2))):
        with pytest.raises(ValueError):
            generate(model, prompt, **{"max_new_tokens": 3, **bad})
    with pytest.raises(ValueError, match="input_ids"):
        generate(model, torch.tensor([1, 2, 3]), 3)
    # one padding-mask check for generate() and the models: a float mask could be additive (0 / -inf)
    for call in (lambda m: generate(model, prompt, 3, attention_mask=m), lambda m: model(prompt, attention_mask=m)):
        with pytest.raises(TypeError, match=r"attention_mask: expected an integer or bool tensor \(B, .*Fix:"):
            call(torch.ones(1, 3))
    with pytest.raises(TypeError, match="model"):
        generate(torch.nn.Linear(2, 2), prompt, 3)
    with pytest.raises(ValueError, match="max_len"):
        generate(model, torch.randint(1, 50, (1, 60)), 10)


def run_readme_example(heading: str) -> None:
    """Execute the first python block after ``heading`` in docs/guide/decoding.md, verbatim."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "decoding.md").read_text()
    section = readme.split(heading, 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "decoding.md", "exec"), {})


def test_readme_decoding_example_runs(capsys):
    run_readme_example("## `generate()`")
    printed = capsys.readouterr().out
    assert "torch.Size([2, 13])" in printed and printed.strip().endswith("6")


def _bad_generate_calls():
    """(call, error type, text the error names): each a mistake that once gave a traceback from deep inside."""
    prompt = torch.tensor([[3, 4, 5]])
    paged = dict(cache="paged")
    return [
        (dict(input_ids=torch.tensor([[3, 50, 5]])), ValueError, r"input_ids: expected token ids in \[0, 50\).*got 50 "
                                                                 r"at \(0, 1\).*Fix"),
        (dict(input_ids=torch.tensor([[3, -1, 5]])), ValueError, r"input_ids: .*\[0, 50\).*got -1"),
        (dict(input_ids=torch.tensor([[3, 70]]), **paged), ValueError, r"input_ids: .*got 70"),
        (dict(input_ids=[torch.tensor([3]), torch.tensor([4, -2])], **paged), ValueError, r"input_ids\[1\]: .*got -2"),
        (dict(input_ids=prompt, block_size=0, **paged), ValueError, r"block_size=0: expected a positive int.*Fix"),
        (dict(input_ids=prompt, block_size=2.5, **paged), ValueError, r"block_size=2.5"),
        (dict(input_ids=prompt, num_blocks=0, **paged), ValueError, r"num_blocks=0"),
        (dict(input_ids=torch.zeros(0, 3, dtype=torch.long)), ValueError, r"input_ids: .*\(B, P\) with B, P >= 1.*"
                                                                          r"got \(0, 3\)"),
        (dict(input_ids=torch.zeros(0, 3, dtype=torch.long), **paged), ValueError, r"input_ids: .*got \(0, 3\)"),
        (dict(input_ids=prompt.bool()), TypeError, r"input_ids: expected token ids of dtype torch.int64.*bool.*Fix"),
        (dict(input_ids=prompt.to(torch.uint8)), TypeError, r"input_ids: .*torch.uint8"),
        (dict(input_ids=prompt.float(), **paged), TypeError, r"input_ids: .*torch.float32"),
        (dict(input_ids=prompt, max_new_tokens=0), ValueError, r"max_new_tokens=0: expected a positive int.*Fix"),
        (dict(input_ids=prompt, top_k=0), ValueError, r"top_k=0: .*Fix: top_k=None"),
        (dict(input_ids=prompt, pad_token_id=-1, stop_tokens=[0]), ValueError, r"pad_token_id: .*\[0, 50\).*got -1"),
        (dict(input_ids=prompt, pad_token_id=50, **paged), ValueError, r"pad_token_id: .*got 50"),
        (dict(input_ids=prompt, stop_tokens=7), TypeError, r"stop_tokens: expected a list of token ids.*got int 7"),
        (dict(input_ids=prompt, stop_tokens=[3, 99]), ValueError, r"stop_tokens\[1\]: .*got 99"),
        (dict(input_ids=prompt, generator=0, temperature=1.0), TypeError, r"generator: expected a torch.Generator"),
        (dict(input_ids=prompt, decoder_start_token=1), ValueError, r"decoder_start_token=1: .*EncoderDecoder"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_generate_calls())))
def test_generate_refuses_bad_input_naming_the_argument(case):
    kwargs, error, text = _bad_generate_calls()[case]
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(error, match=text):
        generate(_gpt(), kwargs.pop("input_ids"), **kwargs)


def test_seq2seq_start_token_must_be_in_the_vocabulary():
    model = EncoderDecoder(TransformerConfig(vocab_size=30, embed_dim=32, num_layers=1, num_heads=4)).eval()
    with pytest.raises(ValueError, match=r"decoder_start_token: .*\[0, 30\).*got 30"):
        generate(model, torch.tensor([[1, 2]]), 2, decoder_start_token=30)
