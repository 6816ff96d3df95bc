"""generate(): continuous batching over a paged cache, right-padded masks, argument checks."""

import ast

import pytest
import torch

from attnkit.cache import PagedKVCache
from attnkit.generation import generate, stream
from attnkit.nn import GPT

from .inputs import tiny_gpt


def _gpt(position="learned", **kw):
    return tiny_gpt(num_kv_heads=2, max_len=96, position=position, **kw)


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("position", ["learned", "rope"])
def test_continuous_batching_equals_each_prompt_alone(position, quantize):
    """Greedy: more prompts than rows, mixed lengths, early stops; every sequence gets what it
    gets alone (with the same cache kind)."""
    model = _gpt(position)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 50, (n,), generator=g) for n in (3, 17, 1, 9, 30, 5, 12)]
    stop = [7]
    alone = []
    for p in prompts:
        cache = model.make_cache("paged", num_blocks=16, block_size=4, quantize=quantize)
        alone.append(generate(model, [p], 10, cache=cache, stop_tokens=stop)[0])
    served = generate(model, prompts, 10, cache="paged", quantize_cache=quantize, max_batch_size=3, block_size=4,
                      stop_tokens=stop)
    for got, want in zip(served, alone):
        assert torch.equal(got, want)
    if quantize is None:  # and the paged cache equals the static one
        for p, want in zip(prompts, alone):
            static = generate(model, p[None], 10, stop_tokens=stop)[0]
            assert torch.equal(static[: len(want)], want)


def test_sequences_join_and_leave_the_running_batch():
    """A pool too small for all prompts at once: they wait for blocks, and blocks return."""
    model = _gpt()
    prompts = [torch.randint(1, 50, (n,)) for n in (20, 4, 4, 4)]
    cache = PagedKVCache(2, num_blocks=8, block_size=4)  # 20 + 6 tokens need 7 blocks: one at a time
    out = generate(model, prompts, 6, cache=cache)
    assert [len(o) for o in out] == [26, 10, 10, 10]
    assert cache.free_block_count == 8 and not cache.pool.tables
    with pytest.raises(ValueError, match="needs 9 blocks"):
        generate(model, [torch.randint(1, 50, (30,))], 6, cache=PagedKVCache(2, num_blocks=8, block_size=4))


def test_paged_tensor_input_matches_the_static_path():
    model = _gpt("rope")
    batch = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    want = generate(model, batch, 6, attention_mask=mask)
    got = generate(model, batch, 6, attention_mask=mask, cache="paged", block_size=4)
    assert torch.equal(got, want)


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])), "rows \\[1\\] have no token"),
    (dict(cache="paged", max_batch_size=0), "max_batch_size"),
    (dict(cache="paged", quantize_cache="int4"), "quantize"),
    (dict(num_blocks=4), "num_blocks"),
    (dict(cache="sliding_window", quantize_cache="int8"), "quantize_cache"),
])
def test_bad_arguments_are_refused(bad, match):
    model = _gpt()
    prompt = torch.randint(1, 50, (2, 3))
    with pytest.raises(ValueError, match=match):
        generate(model, prompt, 3, **bad)


def test_recurrent_cache_on_a_softmax_model_says_what_to_do():
    with pytest.raises(ValueError, match="linear-attention model.*static, dynamic or paged"):
        generate(_gpt(), torch.randint(1, 50, (1, 3)), 3, cache="recurrent")


def test_list_prompts_need_a_paged_cache_and_stream_refuses_paged():
    model = _gpt()
    with pytest.raises(ValueError, match="cache='paged'"):
        generate(model, [torch.tensor([1, 2])], 3)
    with pytest.raises(ValueError, match="generate"):
        next(stream(model, torch.tensor([[1, 2]]), 3, cache="paged"))
    with pytest.raises(ValueError, match="input_ids\\[1\\]"):
        generate(model, [torch.tensor([1, 2]), torch.tensor([])], 3, cache="paged")


def test_generation_does_not_import_the_models():
    """No import cycle: attnkit.generation imports the cache only; the models mix it in."""
    import attnkit.generation

    tree = ast.parse(open(attnkit.generation.__file__).read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not any(name and (name == "nn" or name.startswith("nn.") or ".nn" in name) for name in imported), imported
    assert issubclass(GPT, attnkit.generation.GenerationMixin)


@pytest.mark.parametrize("flags", [["--top-p", "1.5"], ["--top-p", "0"], ["--temperature", "nan"],
                                   ["--temperature", "-1"], ["--repetition-penalty", "inf"],
                                   ["--cache-quantize", "int4"]])
def test_cli_generate_refuses_bad_sampling_flags(flags, capsys):
    from attnkit.cli.main import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "run-dir", *flags])
    assert exit_info.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_readme_serving_example_runs(capsys):
    from .test_generation import run_readme_example

    run_readme_example("## Serving many prompts")
    printed = capsys.readouterr().out
    assert "[13, 48, 20, 11]" in printed and "[6, 6]" in printed and "read in place by decode" in printed


STYLES = {  # the attention features of model families, on the tiny GPT
    "gemma2": dict(position="rope", softcap=2.0, sliding_window=6, norm="rmsnorm"),
    "gpt-oss": dict(position="rope", sinks=True, sliding_window=6),
    "alibi": dict(position="alibi"),
}


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("style", list(STYLES))
def test_paged_and_int8_serving_of_score_mod_and_sink_models(style, quantize, monkeypatch):
    """Soft-capping, sinks and ALiBi over paged (int8) pages: served in a ragged batch, every
    sequence gets what it gets alone; without quantization it equals the static cache; with the
    native kernel built, decode steps run in it (never a dense copy of the pages)."""
    from attnkit.backends import decode as decode_backend
    from attnkit.backends.decode_native import _extension

    model = _gpt(**STYLES[style])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):  # the per-head sink logits: away from their zero init
                p.copy_(torch.linspace(-1.0, 1.0, p.numel()))
    calls = []
    real = decode_backend.native_decode
    monkeypatch.setattr(decode_backend, "native_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 50, (n,), generator=g) for n in (3, 13, 1, 8)]
    served = generate(model, prompts, 8, cache="paged", quantize_cache=quantize, max_batch_size=3, block_size=4)
    for p, got in zip(prompts, served):
        cache = model.make_cache("paged", num_blocks=16, block_size=4, quantize=quantize)
        assert torch.equal(generate(model, [p], 8, cache=cache)[0], got)
        if quantize is None:
            assert torch.equal(generate(model, p[None], 8)[0], got)
    assert bool(calls) == (_extension()[0] is not None)


def test_chunked_prefill_interleaves_with_decode_and_streams_per_sequence():
    """Long prompts prefilled a chunk at a time between decode steps give each sequence what it
    gets with whole-prompt prefill; on_token streams every token of every sequence in order."""
    model = _gpt("rope")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 50, (n,), generator=g) for n in (40, 2, 23, 7)]
    whole = generate(model, prompts, 6, cache="paged", block_size=4, prefill_chunk=None)
    seen: dict[int, list[int]] = {}
    order = []
    chunked = generate(model, prompts, 6, cache="paged", block_size=4, prefill_chunk=5,
                       on_token=lambda i, t: (seen.setdefault(i, []).append(t), order.append(i)))
    for p, a, b in zip(prompts, whole, chunked):
        assert torch.equal(a, b) and torch.equal(a[: len(p)], p)
    for i, out in enumerate(chunked):
        assert seen[i] == out[len(prompts[i]):].tolist()
    assert order.index(1) < order.index(0)  # the short prompt streams while the long one still prefills
    with pytest.raises(ValueError, match="prefill_chunk"):
        generate(model, prompts, 2, cache="paged", prefill_chunk=0)
