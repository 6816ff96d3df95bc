"""Nonsense training settings are refused with one clear line naming the flag, the value and what is expected;
a run's output reads well in a log file (plain lines, no progress-bar debris) and leaves a loss curve."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("safetensors")

from attnkit.cli.main import main  # noqa: E402
from attnkit.train import TrainConfig  # noqa: E402

BAD = [
    ("lr", float("inf")), ("lr", 0.0), ("lr", -1e-3), ("lr", float("nan")),
    ("distill_temperature", 0.0), ("distill_temperature", float("inf")),
    ("distill_alpha", 2.0), ("distill_alpha", -0.1),
    ("min_lr_ratio", -1.0), ("min_lr_ratio", 1.5),
    ("weight_decay", -1.0), ("weight_decay", float("nan")),
    ("grad_clip", float("nan")), ("grad_clip", -1.0),
    ("eval_every", -1), ("save_every", -1), ("log_every", -2), ("warmup_steps", -1), ("decay_steps", -5),
    ("sample_tokens", -1), ("steps", 0), ("batch_size", 0), ("grad_accum", 0), ("seq_len", -3),
    ("eval_batches", 0), ("profile_steps", 0),
]


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_bad_training_settings_name_the_flag_and_the_value(name, value):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError) as info:
        TrainConfig(**{name: value})
    message = str(info.value)
    assert message.startswith(f"{name} ({flag}): expected ") and f"got {value!r}" in message
    assert "\n" not in message


@pytest.mark.parametrize("name, value", [("steps", 2.5), ("lr", "fast"), ("eval_every", True)])
def test_wrong_types_are_type_errors(name, value):
    with pytest.raises(TypeError, match=rf"{name} .*got {value!r} of type"):
        TrainConfig(**{name: value})


@pytest.mark.parametrize("argv, fragment", [
    (["--lr", "inf"], "lr (--lr): expected a finite learning rate > 0"),
    (["--grad-clip", "nan"], "grad_clip (--grad-clip): expected a finite max norm >= 0"),
    (["--distill-alpha", "2"], "distill_alpha (--distill-alpha): expected a weight in [0, 1]"),
])
def test_the_cli_refuses_them_before_any_work(tmp_path, capsys, argv, fragment):
    out = tmp_path / "run"
    try:
        code = main(["train", "--out", str(out), *argv])
    except ValueError as exc:  # printed as one line by the CLI entry point
        assert fragment in str(exc)
    else:
        assert code == 2 and fragment in capsys.readouterr().err
    assert not out.exists()


def test_a_run_logged_to_a_file_reads_as_plain_lines_and_draws_its_loss_curve(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("".join(f"{i}: all the world's a stage, and all the men and women merely players.\n"
                            for i in range(60)))
    out = tmp_path / "run"
    assert main(["train", "--data", str(text), "--out", str(out), "--steps", "4", "--batch-size", "4", "--seq-len",
                 "32", "--eval-every", "2", "--eval-batches", "1", "--sample-tokens", "16", "--device", "cpu",
                 "--warmup-steps", "1", "--embed-dim", "32", "--num-layers", "1", "--num-heads", "2",
                 "--log-every", "2", "--save-every", "2"]) == 0
    printed = capsys.readouterr().out  # not a terminal: tqdm's disable=None hides the bar
    assert "\r" not in printed and "it/s" not in printed
    lines = printed.splitlines()
    step_lines = [line for line in lines if line.startswith("step ") and "| loss " in line]
    assert [line.split()[1] for line in step_lines] == ["2/4", "4/4"]
    assert all(" | lr " in line and "tok/s" in line for line in step_lines)
    assert f"saved step 2 → {out / 'step-000002'}" in lines and f"saved step 4 → {out / 'step-000004'}" in lines
    sample = lines[lines.index("sample:") + 1]
    assert sample.startswith("  ") and not sample.strip().startswith(("'", '"'))  # text, not a Python repr
    png = out / "loss.png"
    assert f"loss curve → {png}" in lines
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 5000


def test_readme_model_format_example_runs(capsys):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "training.md").read_text()
    section = readme.split("## One model format", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "training.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "True"
