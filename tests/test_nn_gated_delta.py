"""Hybrid GPT (softmax + gated-delta layers): decoding through the state cache equals the full
forward, generation equals greedy over full forwards, `attnkit train` trains it and resumes exactly."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.nn import GPT, Encoder, TransformerConfig
from attnkit.nn.gated_delta import GatedDeltaNet

from .train_helpers import read_losses, tiny_gpt_config, tiny_train_config


def hybrid(pattern="gga", **overrides):
    torch.manual_seed(0)
    base = {"vocab_size": 50, "embed_dim": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "max_len": 64,
            "layer_pattern": pattern}
    base.update(overrides)
    return GPT(TransformerConfig(**base)).eval()


def test_layer_pattern_cycles_and_names_the_mixers():
    model = hybrid("gga")
    assert [type(layer.linear_attn or layer.self_attn).__name__ for layer in model.layers] == \
        ["GatedDeltaNet", "GatedDeltaNet", "MultiHeadAttention", "GatedDeltaNet"]
    assert GPT(TransformerConfig(vocab_size=8, embed_dim=8, num_layers=1, num_heads=2)).layers[0].linear_attn is None


@pytest.mark.parametrize("pattern", ["gga", "g"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_chunked_prefill_and_decode_equal_the_full_forward(pattern, kind):
    model = hybrid(pattern)
    x = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        cache = model.make_cache(kind, max_len=16)
        outs, start = [], 0
        for stop in (5, 9, 10, 11, 12, 13):  # two prefill chunks, then one token at a time
            outs.append(model(x[:, start:stop], cache=cache))
            start = stop
    assert cache.seq_len == 13
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_generate_equals_greedy_over_full_forwards():
    model = hybrid("gga")
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, max_new_tokens=6)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_gated_layers_take_gradients_and_refuse_what_they_cannot_compute():
    model = hybrid("ga").train()
    x = torch.randint(0, 50, (2, 9))
    model(x).logsumexp(-1).mean().backward()
    layer = model.layers[0].linear_attn
    assert isinstance(layer, GatedDeltaNet)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, :3] = 0
    with pytest.raises(ValueError, match="gated-delta layer computes causal attention"):
        model(x, attention_mask=pad)
    with pytest.raises(ValueError, match="kind: a paged cache serves softmax layers only"):
        model.make_cache("paged", num_blocks=4)
    with pytest.raises(ValueError, match="layer_pattern: expected a string of"):
        TransformerConfig(layer_pattern="gx")
    with pytest.raises(ValueError, match="Encoder layers are softmax attention only"):
        Encoder(TransformerConfig(layer_pattern="ag"))
    with pytest.raises(TypeError, match="StateCache"):
        layer(torch.randn(1, 3, 32), cache=attnkit.KVCache.dynamic(1)[0])


def test_attnkit_train_trains_a_hybrid_and_generates(tmp_path, capsys):
    from attnkit.cli.main import main

    text = tmp_path / "text.txt"
    text.write_text("".join(f"{i}: all the world's a stage, and all the men and women merely players.\n"
                            for i in range(100)))
    out = str(tmp_path / "run")
    assert main(["train", "--data", str(text), "--out", out, "--layer-pattern", "ga", "--steps", "12",
                 "--batch-size", "4", "--seq-len", "32", "--eval-every", "0", "--sample-tokens", "0", "--no-progress",
                 "--device", "cpu", "--warmup-steps", "1", "--lr", "3e-3", "--embed-dim", "32", "--num-layers", "2",
                 "--num-heads", "2"]) == 0
    losses = read_losses(out)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    capsys.readouterr()
    assert main(["generate", out, "--prompt", "all the", "--max-new-tokens", "8", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("all the")


def test_hybrid_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    pytest.importorskip("safetensors")
    from attnkit.train import load_checkpoint, train

    config = tiny_gpt_config(layer_pattern="ga")
    full = train(tiny_train_config(tmp_path / "full"), config)
    train(tiny_train_config(tmp_path / "cut"), config, stop_at=3)
    resumed = train(tiny_train_config(tmp_path / "cut", resume=str(tmp_path / "cut")))
    losses = [[r["loss"] for r in res["history"]] for res in (full, resumed)]
    assert len(losses[0]) == len(losses[1]) == 6
    assert losses[1] == pytest.approx(losses[0], rel=1e-6, abs=1e-7)
    _, w_full, _ = load_checkpoint(str(tmp_path / "full"))
    _, w_res, _ = load_checkpoint(str(tmp_path / "cut"))
    assert any(".linear_attn.A_log" in name for name in w_full)
    for name in w_full:
        torch.testing.assert_close(w_res[name], w_full[name], rtol=1e-6, atol=1e-7)


def test_nan_in_a_rows_padding_leaves_its_real_tokens_and_the_other_rows():
    """A right-padded batch whose padding embeds to NaN: the real tokens before it keep their outputs
    (the layer is causal, so the padding is what only later tokens see), the padding is NaN."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(TransformerConfig(vocab_size=8, embed_dim=32, num_layers=1, num_heads=4, num_kv_heads=2))
    x = torch.randn(2, 70, 32)
    bad = x.clone()
    bad[1, 45:] = float("nan")
    with torch.no_grad():
        want, got = layer(x), layer(bad)
    assert torch.isnan(got[1, 45:]).all()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1, :45], want[1, :45], rtol=1e-5, atol=1e-6)
