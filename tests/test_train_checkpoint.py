"""Checkpoints: exact resume, atomic saves (a crash mid-save keeps the previous checkpoint), no pickle."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("safetensors")

from attnkit.train import load_checkpoint, train  # noqa: E402
from attnkit.train.checkpoint import resolve_checkpoint  # noqa: E402
from attnkit.train.lstm import LSTMConfig  # noqa: E402

from .train_helpers import tiny_gpt_config, tiny_train_config  # noqa: E402


def _text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 40)
    return str(path)


def _losses(results):
    return [r["loss"] for r in results["history"]]


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    # dropout on, so the restored RNG state matters too
    full = train(tiny_train_config(tmp_path / "full"), tiny_gpt_config(dropout=0.1))
    train(tiny_train_config(tmp_path / "cut"), tiny_gpt_config(dropout=0.1), stop_at=3)
    resumed = train(tiny_train_config(tmp_path / "cut", resume=str(tmp_path / "cut")))
    assert len(_losses(resumed)) == len(_losses(full)) == 6
    assert _losses(resumed) == pytest.approx(_losses(full), rel=1e-6, abs=1e-7)
    # and the weights end up the same
    _, w_full, _ = load_checkpoint(str(tmp_path / "full"))
    _, w_res, _ = load_checkpoint(str(tmp_path / "cut"))
    for name in w_full:
        torch.testing.assert_close(w_res[name], w_full[name], rtol=1e-6, atol=1e-7)


def test_checkpoint_holds_only_safetensors_and_json_and_loads_without_pickle(tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(tiny_train_config(out, steps=2, data=_text_file(tmp_path)),
          LSTMConfig(embed_dim=8, hidden_dim=8, num_layers=1))
    ckpt = resolve_checkpoint(str(out))
    assert sorted(os.listdir(ckpt)) == ["meta.json", "model.safetensors", "state.safetensors"]

    def no_pickle(*args, **kwargs):
        raise AssertionError("torch.load (pickle) must not be used")

    monkeypatch.setattr(torch, "load", no_pickle)
    meta, weights, state = load_checkpoint(str(out))
    assert meta["step"] == 2 and "rng.cpu" in state and any(k.startswith("optim.") for k in state)


def _tiny_lstm(vocab=16):
    from attnkit.train.lstm import LSTMLanguageModel

    return LSTMLanguageModel(LSTMConfig(vocab_size=vocab, embed_dim=4, hidden_dim=4, num_layers=1))


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_debris(tmp_path, monkeypatch):
    import safetensors.torch as st

    from attnkit.train import checkpoint as ck

    model = _tiny_lstm()
    ck.save_checkpoint(str(tmp_path), 1, model, {"model_kind": "lstm", "model_config": {}})

    def half_written(tensors, path, *args, **kwargs):
        open(path, "wb").write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(st, "save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(str(tmp_path), 2, model, {"model_kind": "lstm", "model_config": {}})
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000001"]
    assert load_checkpoint(str(tmp_path))[0]["step"] == 1


def test_a_hard_crash_before_the_rename_leaves_the_previous_checkpoint_intact(tmp_path):
    """A child process saves step 1, then dies (os._exit: no cleanup runs) with step 2 fully written
    but not yet renamed into place."""
    script = textwrap.dedent("""
        import os, sys, torch
        from attnkit.train import checkpoint as ck
        from attnkit.train.lstm import LSTMConfig, LSTMLanguageModel
        model = LSTMLanguageModel(LSTMConfig(vocab_size=16, embed_dim=4, hidden_dim=4, num_layers=1))
        ck.save_checkpoint(sys.argv[1], 1, model, {"model_kind": "lstm", "model_config": {}})
        ck.os.replace = lambda *a: os._exit(3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ck.save_checkpoint(sys.argv[1], 2, model, {"model_kind": "lstm", "model_config": {}})
    """)
    out = str(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-c", script, out], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    meta, weights, _ = load_checkpoint(out)
    assert meta["step"] == 1
    assert float(weights["lm_head.bias"].abs().max()) < 1.0  # not the +1 weights of the crashed save
    # the debris of the crash is a hidden temp directory, which the next save ignores
    from attnkit.train.checkpoint import save_checkpoint

    save_checkpoint(out, 3, _tiny_lstm(), {"model_kind": "lstm", "model_config": {}})
    assert load_checkpoint(out)[0]["step"] == 3
