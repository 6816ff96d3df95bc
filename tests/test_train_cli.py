"""CLI smoke on tiny configs: train (text and task), bf16, grad accumulation, profile, generate, int8, distill."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("safetensors")

from attnkit.cli.main import main  # noqa: E402
from attnkit.train import TrainConfig, load_model, train  # noqa: E402
from attnkit.train.deploy import quantize_int8, quantize_model_int8  # noqa: E402
from attnkit.train.loop import lr_at  # noqa: E402

from .train_helpers import tiny_gpt_config, tiny_train_config  # noqa: E402

TINY = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--eval-every", "2", "--eval-batches", "1",
        "--sample-tokens", "8", "--no-progress", "--device", "cpu", "--warmup-steps", "1",
        "--embed-dim", "32", "--num-layers", "1", "--num-heads", "2"]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("".join(f"{i}: all the world's a stage, and all the men and women merely players.\n"
                            for i in range(100)))
    return str(path)


def test_train_then_generate_and_profile(tmp_path, text, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "--data", text, "--out", out, "--precision", "bf16", "--profile", "--profile-steps", "2",
                 "--backend", "naive", *TINY]) == 0
    printed = capsys.readouterr().out
    assert "eval loss" in printed and "sample:" in printed and "Self CPU" in printed
    with open(os.path.join(out, "trace.json")) as f:
        assert "traceEvents" in json.load(f)
    results = json.load(open(os.path.join(out, "results.json")))
    assert results["steps"] == 3 and results["eval"]["loss"] > 0
    model, meta = load_model(out)
    assert meta["model_config"]["backend"] == "naive" and meta["train_config"]["precision"] == "bf16"
    assert main(["generate", out, "--prompt", "all the", "--max-new-tokens", "12", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("all the")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("all the\n\nthe men and\nw\n")
    assert main(["generate", out, "--prompts-file", str(prompts), "--max-new-tokens", "5", "--temperature", "0",
                 "--cache-quantize", "int8"]) == 0
    served = sorted(capsys.readouterr().out.splitlines())
    assert [line.split("]")[0] for line in served] == ["[1", "[3", "[4"], served
    assert served[0].startswith("[1] all the") and served[1].startswith("[3] the men and")


def test_train_on_a_synthetic_task_with_grad_accumulation(tmp_path, capsys):
    out = str(tmp_path / "task")
    args = ["train", "--data", "task:copy:16", "--out", out, "--grad-accum", "2", *TINY]
    assert main(args) == 0
    assert "answer accuracy" in capsys.readouterr().out


def test_grad_accumulation_equals_the_full_batch(tmp_path, text):
    full = train(tiny_train_config(tmp_path / "a", data=text, steps=3), tiny_gpt_config())
    accum = train(tiny_train_config(tmp_path / "b", data=text, steps=3, grad_accum=2), tiny_gpt_config())
    assert [r["loss"] for r in accum["history"]] == pytest.approx([r["loss"] for r in full["history"]], rel=1e-5)


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_bad_flags_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="multiple of 3"):
        train(tiny_train_config(tmp_path, batch_size=4, grad_accum=3), tiny_gpt_config())
    with pytest.raises(ValueError, match="no such file"):
        train(tiny_train_config(tmp_path, data=str(tmp_path / "missing.txt")), tiny_gpt_config())


def test_int8_quantization_and_distillation(tmp_path, text):
    teacher_out = str(tmp_path / "teacher")
    teacher = train(tiny_train_config(teacher_out, data=text, steps=4, quantize="int8"),
                    tiny_gpt_config(num_layers=2, embed_dim=48))
    q = teacher["quantize"]
    assert q["int8_bytes"] < q["fp32_bytes"] and abs(q["loss_delta"]) < 0.1 and q["speedup"] > 0
    model, _ = load_model(teacher_out)
    qmodel = quantize_model_int8(model)
    assert any("quantized" in type(m).__module__ for m in qmodel.modules())
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(qmodel(x), model(x), atol=0.15, rtol=0.1)

    assert main(["generate", teacher_out, "--quantize", "int8", "--max-new-tokens", "4", "--prompt", "all"]) == 0
    with pytest.warns(DeprecationWarning, match="renamed quantize_model_int8"):  # the old name still works
        assert type(quantize_int8(model)) is type(qmodel)

    student = train(tiny_train_config(tmp_path / "student", data=text, steps=4, distill_from=teacher_out),
                    tiny_gpt_config(num_layers=1, embed_dim=16))
    d = student["distill"]
    assert d["student_params"] < d["teacher_params"] and d["student_bytes"] < d["teacher_bytes"]
    assert d["teacher_loss"] == pytest.approx(teacher["eval"]["loss"], rel=1e-5)
    assert d["student_loss"] > 0


def test_lstm_baseline_trains_and_samples_on_text(tmp_path, text, capsys):
    out = str(tmp_path / "lstm")
    assert main(["train", "--model", "lstm", "--data", text, "--out", out, "--lstm-hidden-dim", "16",
                 "--lstm-embed-dim", "8", "--lstm-num-layers", "1", *TINY]) == 0
    assert "sample:" in capsys.readouterr().out
    model, meta = load_model(out)
    assert meta["model_kind"] == "lstm" and model.config.hidden_dim == 16


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 20, "caf\u00e9 ".encode("latin-1") * 40],
                         ids=["nul-bytes", "not-utf8"])
def test_a_binary_data_file_is_refused_naming_data(tmp_path, content, capsys):
    path = tmp_path / "file.png"
    path.write_bytes(content)
    code = main(["train", "--data", str(path), "--out", str(tmp_path / "run"), *TINY])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--data" in err and "not a UTF-8 text file" in err and not os.path.exists(tmp_path / "run" / "latest")
