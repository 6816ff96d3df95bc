"""Resume never damages a run: stored settings, stored schedule, forward only, read-only analysis."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("safetensors")

from attnkit.cli.main import main  # noqa: E402
from attnkit.train import TrainConfig, load_checkpoint, lr_at, train  # noqa: E402

from .train_helpers import read_losses, tiny_gpt_config, tiny_train_config  # noqa: E402


def _losses(results):
    return [r["loss"] for r in results["history"]]


def _lrs(results):
    return [r["lr"] for r in results["history"]]


def _snapshot(directory) -> dict:
    """Every file under ``directory`` with its bytes (to prove nothing was written)."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, directory)] = open(path, "rb").read()
    return found


def test_resume_without_flags_uses_the_stored_config_not_the_defaults(tmp_path):
    # lr and warmup differ from the TrainConfig defaults: a resume must not fall back to those
    settings = dict(steps=6, lr=5e-4, warmup_steps=3, weight_decay=0.0, min_lr_ratio=0.5)
    full = train(tiny_train_config(tmp_path / "full", **settings), tiny_gpt_config())
    train(tiny_train_config(tmp_path / "cut", **settings), tiny_gpt_config(), stop_at=3)
    resumed = train(TrainConfig(resume=str(tmp_path / "cut"), device="cpu"))  # nothing else given
    assert _lrs(resumed) == _lrs(full)
    assert _losses(resumed) == pytest.approx(_losses(full), rel=1e-6, abs=1e-7)
    assert read_losses(tmp_path / "cut") == pytest.approx(_losses(full), rel=1e-6, abs=1e-7)


def test_extending_a_finished_run_keeps_its_schedule(tmp_path):
    """N steps, then --steps N+M: the same as one run of N+M steps whose decay ends at N."""
    straight = train(tiny_train_config(tmp_path / "straight", steps=8, decay_steps=4), tiny_gpt_config())
    train(tiny_train_config(tmp_path / "short", steps=4), tiny_gpt_config())
    extended = train(TrainConfig(resume=str(tmp_path / "short"), steps=8, device="cpu"))
    assert _lrs(extended) == _lrs(straight)
    floor = 3e-3 * 0.1
    assert _lrs(extended)[4:] == pytest.approx([floor] * 4)  # no jump back up after the end
    assert _losses(extended) == pytest.approx(_losses(straight), rel=1e-6, abs=1e-7)


def test_explicit_flags_override_the_stored_config_and_are_reported(tmp_path, capsys):
    out = str(tmp_path / "run")
    common = ["--data", "stdlib", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1",
              "--sample-tokens", "0", "--no-progress", "--device", "cpu", "--embed-dim", "32", "--num-layers", "1",
              "--num-heads", "2", "--log-every", "0"]
    assert main(["train", "--out", out, "--steps", "3", "--lr", "5e-4", "--warmup-steps", "2", *common]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", out, "--steps", "5", "--lr", "1e-3", "--log-every", "1"]) == 0
    printed = capsys.readouterr().out
    assert "steps 3 → 5" in printed and "lr 0.0005 → 0.001" in printed
    meta, _, _ = load_checkpoint(out)
    cfg = meta["train_config"]
    assert (meta["step"], cfg["lr"], cfg["warmup_steps"], cfg["batch_size"], cfg["seq_len"]) == (5, 1e-3, 2, 4, 32)
    # a model flag cannot change a resumed model
    capsys.readouterr()
    assert main(["train", "--resume", out, "--steps", "6", "--embed-dim", "64"]) == 2  # a one-line error
    err = capsys.readouterr().err
    assert "--embed-dim" in err and "keeps the model" in err and "Traceback" not in err


def test_steps_below_the_checkpoint_are_refused_and_latest_stays(tmp_path):
    out = tmp_path / "run"
    train(tiny_train_config(out, steps=4), tiny_gpt_config())
    before = _snapshot(out)
    with pytest.raises(ValueError, match=r"steps: 2 is below the checkpoint's step 4.*--steps 4"):
        train(TrainConfig(resume=str(out), steps=2, device="cpu"))
    assert _snapshot(out) == before


def test_analysing_a_finished_run_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    first = train(tiny_train_config(out, steps=3), tiny_gpt_config())
    before = _snapshot(out)
    report = train(TrainConfig(resume=str(out), quantize="int8", device="cpu"))
    assert _snapshot(out) == before
    assert report["steps"] == 3 and "quantize" in report
    assert report["eval"]["loss"] == pytest.approx(first["eval"]["loss"], rel=1e-6)
    assert "nothing in the run directory is written" in capsys.readouterr().out


def test_a_new_run_refuses_a_non_empty_out_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    train(tiny_train_config(out, steps=2), tiny_gpt_config())
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    with pytest.raises(ValueError, match=r"is not empty.*--resume .*--overwrite"):
        train(tiny_train_config(out, steps=2), tiny_gpt_config())
    assert _snapshot(out) == before
    train(tiny_train_config(out, steps=3, overwrite=True), tiny_gpt_config())
    assert len(read_losses(out)) == 3  # not 2 + 3 lines from two runs
    assert sorted(n for n in os.listdir(out) if n.startswith("step-")) == ["step-000003"]
    assert (out / "notes.txt").read_text() == "mine"  # only attnkit's own files are replaced


def test_resume_drops_metrics_lines_written_after_the_checkpoint(tmp_path):
    """A crash after step 5's metrics line but before its checkpoint: the resumed run writes step 5
    again; metrics.jsonl must hold each step once."""
    out = tmp_path / "run"
    train(tiny_train_config(out, steps=6), tiny_gpt_config(), stop_at=4)
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 9.0, "lr": 0.0, "tokens_per_s": 1.0}) + "\n")
    train(TrainConfig(resume=str(out), device="cpu"))
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_schedule_is_a_function_of_the_stored_config():
    cfg = TrainConfig(steps=10, warmup_steps=2, lr=1.0, min_lr_ratio=0.2, decay_steps=6)
    lrs = [lr_at(s, cfg) for s in range(10)]
    assert lrs[:2] == pytest.approx([0.5, 1.0]) and lrs[6:] == pytest.approx([0.2] * 4)
    assert all(a > b for a, b in zip(lrs[2:6], lrs[3:7]))  # cosine from the peak (step 2) to the floor (6)


def test_resume_restores_the_weights_exactly(tmp_path):
    full = tmp_path / "full"
    train(tiny_train_config(full, steps=4), tiny_gpt_config(dropout=0.1))
    cut = tmp_path / "cut"
    train(tiny_train_config(cut, steps=4), tiny_gpt_config(dropout=0.1), stop_at=2)
    train(TrainConfig(resume=str(cut), device="cpu"))
    (_, a, _), (_, b, _) = load_checkpoint(str(full)), load_checkpoint(str(cut))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7)


def test_resuming_into_another_out_leaves_the_original_run_untouched(tmp_path):
    source = tmp_path / "source"
    train(tiny_train_config(source, steps=4), tiny_gpt_config(), stop_at=2)
    before = _snapshot(source)
    branch = tmp_path / "branch"
    resumed = train(TrainConfig(resume=str(source), out=str(branch), device="cpu"))
    assert _snapshot(source) == before
    assert [r["step"] for r in resumed["history"]] == [1, 2, 3, 4]
    assert load_checkpoint(str(branch))[0]["step"] == 4 and len(read_losses(branch)) == 4
    (branch / "x").write_text("")  # a non-empty --out is refused for a resume into it as for a new run
    with pytest.raises(ValueError, match="is not empty"):
        train(TrainConfig(resume=str(source), out=str(tmp_path / "branch"), steps=4, device="cpu"))


def test_where_and_how_a_run_is_resumed_is_not_taken_from_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    train(tiny_train_config(out, steps=3, quantize="int8"), tiny_gpt_config(), stop_at=2)
    meta, path = load_checkpoint(str(out))[0], out / "step-000002" / "meta.json"
    meta["train_config"]["device"] = "cuda:7"  # trained elsewhere
    path.write_text(json.dumps(meta))
    resumed = train(TrainConfig(resume=str(out), device="cpu"))
    assert "quantize" not in resumed and resumed["steps"] == 3  # the stored report request is not repeated
    assert load_checkpoint(str(out))[0]["train_config"]["device"] == "cpu"


def test_continuing_an_older_checkpoint_inside_its_run_is_refused(tmp_path):
    out = tmp_path / "run"
    train(tiny_train_config(out, steps=4, save_every=2), tiny_gpt_config())
    before = _snapshot(out)
    with pytest.raises(ValueError, match=r"step 2 but its run directory .* holds the newer step-000004.*--out"):
        train(TrainConfig(resume=str(out / "step-000002"), steps=6, device="cpu"))
    assert _snapshot(out) == before
    branch = train(TrainConfig(resume=str(out / "step-000002"), out=str(tmp_path / "branch"), steps=4, device="cpu"))
    assert branch["steps"] == 4
