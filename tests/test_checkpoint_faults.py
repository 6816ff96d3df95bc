"""Faults: SIGKILL inside checkpoint saves, and a diverging run. The good checkpoints always survive."""

from __future__ import annotations

import math
import os
import random
import signal
import sys
import time

import pytest
import torch

pytest.importorskip("safetensors")

from attnkit.train import (  # noqa: E402
    CheckpointError, TrainConfig, TrainingDiverged, load_checkpoint, save_checkpoint, train,
)
from attnkit.train import loop as train_loop  # noqa: E402

from .train_helpers import read_losses, tiny_gpt_config, tiny_train_config  # noqa: E402

STEPS = 10


def _child(out: str, write_fd: int) -> None:
    """Train (or resume) with a checkpoint every step, announcing each save on ``write_fd``; each
    safetensors write sleeps a little, so a kill shortly after an announcement lands inside a save."""
    import safetensors.torch as st

    from attnkit.train import checkpoint

    torch.set_num_threads(1)
    real_save_file, real_save_checkpoint = st.save_file, checkpoint.save_checkpoint

    def slow_save_file(*args, **kwargs):
        time.sleep(0.01)
        return real_save_file(*args, **kwargs)

    def announced(*args, **kwargs):
        os.write(write_fd, b"s")
        return real_save_checkpoint(*args, **kwargs)

    st.save_file = slow_save_file
    train_loop.save_checkpoint = announced
    if os.path.exists(os.path.join(out, "latest")):
        train(TrainConfig(resume=out, device="cpu"))
    else:
        train(tiny_train_config(out, steps=STEPS, save_every=1), tiny_gpt_config())


def _kill_during_a_save(out: str, rng: random.Random) -> None:
    """Fork a trainer (no interpreter start-up: the test stays fast) and SIGKILL it inside its second save."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_fd)
            sys.stdout = sys.stderr = open(os.devnull, "w")
            _child(out, write_fd)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        saves = 0
        while saves < 2:  # the first save of this child is complete by then (or in progress: killed inside it)
            chunk = os.read(read_fd, 1)
            if not chunk:
                break
            saves += 1
        time.sleep(rng.uniform(0.0, 0.015))
        os.kill(pid, signal.SIGKILL)
    finally:
        os.waitpid(pid, 0)
        os.close(read_fd)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks the trainer")
def test_sigkill_inside_saves_leaves_a_loadable_latest_exact_resume_and_no_debris(tmp_path):
    rng = random.Random(1234)
    straight = train(tiny_train_config(tmp_path / "straight", steps=STEPS, save_every=1), tiny_gpt_config())
    out = str(tmp_path / "killed")
    steps_seen, killed_mid_save = [], 0
    for _ in range(3):
        _kill_during_a_save(out, rng)
        killed_mid_save += any(".tmp-" in n for n in os.listdir(out))  # a save's temporary directory was left
        meta, weights, state = load_checkpoint(out)  # latest always names a complete checkpoint
        assert all(bool(torch.isfinite(t).all()) for t in weights.values())
        steps_seen.append(meta["step"])
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] < STEPS
    assert killed_mid_save >= 1  # the kills did land inside saves
    resumed = train(TrainConfig(resume=out, device="cpu"))
    want = [r["loss"] for r in straight["history"]]
    assert [r["loss"] for r in resumed["history"]] == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert read_losses(out) == pytest.approx(want, rel=1e-6, abs=1e-7)  # each step once
    debris = [n for n in os.listdir(out) if n.startswith(".")]
    assert debris == [], debris
    assert sorted(n for n in os.listdir(out) if n.startswith("step-")) == ["step-000009", "step-000010"]


def test_a_diverging_run_stops_without_saving_and_keeps_the_good_checkpoints(tmp_path, monkeypatch):
    real_loss_sum, calls = train_loop.loss_sum, []

    def nan_from_step_4(logits, targets):
        calls.append(1)
        loss = real_loss_sum(logits, targets)
        return loss * float("nan") if len(calls) >= 4 else loss

    monkeypatch.setattr(train_loop, "loss_sum", nan_from_step_4)
    out = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"diverged at step 4: loss nan.*stopped without saving.*--resume"):
        train(tiny_train_config(out, steps=8, save_every=1), tiny_gpt_config())
    assert sorted(n for n in os.listdir(out) if n.startswith("step-")) == ["step-000002", "step-000003"]
    meta, weights, _ = load_checkpoint(str(out))
    assert meta["step"] == 3 and all(math.isfinite(r["loss"]) for r in meta["history"])
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_non_finite_weights_are_never_saved_or_rotated(tmp_path):
    from attnkit.train.lstm import LSTMConfig, LSTMLanguageModel

    model = LSTMLanguageModel(LSTMConfig(vocab_size=16, embed_dim=4, hidden_dim=4, num_layers=1))
    meta = {"model_kind": "lstm", "model_config": {}}
    save_checkpoint(str(tmp_path), 1, model, meta, keep=1)
    with torch.no_grad():
        model.lm_head.bias[0] = float("inf")
    with pytest.raises(CheckpointError, match=r"refusing to save step 2.*lm_head.bias.*previous checkpoints are kept"):
        save_checkpoint(str(tmp_path), 2, model, meta, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000001"]
    assert load_checkpoint(str(tmp_path))[0]["step"] == 1
