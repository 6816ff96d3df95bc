"""A `train` process stopped at random moments: SIGKILL (anywhere, including inside a save), and
SIGINT / SIGTERM (handled between optimizer steps). Every stop is resumable with `--resume RUN`, the
advice printed can be followed, and the finished run's losses equal an uninterrupted run's bitwise.

The trainers are forked from the test process and run the command line's own ``main`` (no
interpreter start-up, so dozens of kills stay fast); one test runs the real ``python -m attnkit``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("safetensors")

from attnkit.train import TrainConfig, train  # noqa: E402
from attnkit.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402

from .train_helpers import tiny_gpt_config, tiny_train_config  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forks the trainer")

TEXT = "Now is the winter of our discontent made glorious summer by this sun of York.\n" * 30


def _argv(text, out, steps):
    return ["train", "--data", text, "--out", out, "--steps", str(steps), "--batch-size", "2", "--seq-len", "12",
            "--embed-dim", "8", "--num-layers", "1", "--num-heads", "2", "--warmup-steps", "2", "--save-every", "1",
            "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress", "--device", "cpu",
            "--log-every", "1", "--seed", "3"]


def _resume_argv(out):
    return ["train", "--resume", out, "--no-progress", "--device", "cpu", "--log-every", "1"]


def _slow_disk():
    """Directory syncs take 5 ms, as on a busy disk: the moments between a save's steps (rename,
    ``latest``, rotation) become wide enough for random kills to land in them."""
    from attnkit.io import files
    from attnkit.train import checkpoint

    real = files.fsync_dir

    def slow(path):
        time.sleep(0.005)
        real(path)

    files.fsync_dir = checkpoint.fsync_dir = slow


def _fork_cli(argv, log_path, slow_disk=False):
    """Fork a child that runs ``attnkit <argv>`` with stdout and stderr to ``log_path``; its pid."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            import torch

            torch.set_num_threads(1)  # the parent's thread pool does not survive a fork
            if slow_disk:
                _slow_disk()
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
            sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
            from attnkit.cli.main import main

            code = main(argv)
        finally:
            sys.stdout.flush()
            os._exit(code if isinstance(code, int) else 1)
    return pid


def _wait(pid, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the trainer did not finish")


def _losses(out):
    meta, _, _ = load_checkpoint(out)
    return [r["loss"] for r in meta["history"]]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return str(path)


def _reference(tmp_path, text, steps):
    ref = str(tmp_path / "ref")
    assert _wait(_fork_cli(_argv(text, ref, steps), str(tmp_path / "ref.log"))) == 0
    return _losses(ref)


def _next_argv(text, out, steps):
    """What a user runs after a stop: ``--resume RUN``, or, when the run stopped before its first
    save, what the refusal says (start again with ``--overwrite``)."""
    if not os.path.isdir(out):
        return _argv(text, out, steps)
    try:
        load_checkpoint(out)
    except ValueError as exc:
        assert "--overwrite" in str(exc), exc
        return [*_argv(text, out, steps), "--overwrite"]
    return _resume_argv(out)


def _pid_alive(name: str) -> bool:
    from attnkit.io.files import _TEMP, _alive

    match = _TEMP.match(name)
    return match is not None and _alive(int(match.group(1)))


@pytest.mark.slow
def test_sigkill_at_random_moments_always_resumes_with_resume_run_and_equals_the_straight_run(tmp_path, text):
    steps, rng = 80, random.Random(20)
    want = _reference(tmp_path, text, steps)
    runs = 0
    out, log = str(tmp_path / f"run{runs}"), str(tmp_path / "run.log")
    argv, kills = _argv(text, out, steps), 0
    while kills < 24:
        pid = _fork_cli(argv, log, slow_disk=True)
        time.sleep(rng.uniform(0.1, 0.45))  # start-up takes ~0.2 s, a step with its save ~0.05 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:  # it ended by itself before the kill: never a refused resume
            assert os.waitstatus_to_exitcode(status) == 0, open(log).read()
            if len(_losses(out)) == steps:  # a fast machine finished the run: check it, start another
                assert _losses(out) == want
                runs += 1
                out = str(tmp_path / f"run{runs}")
                argv = _argv(text, out, steps)
                continue
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            kills += 1
            assert "error:" not in open(log).read(), open(log).read()  # not refusing when the kill came
        argv = _next_argv(text, out, steps)
    assert kills >= 20
    assert _wait(_fork_cli(_next_argv(text, out, steps), log)) == 0, open(log).read()
    assert _losses(out) == want  # bitwise: each step's loss is the straight run's
    # no debris, except a killed writer's temporary whose pid a live process has taken since
    # (the cleaner cannot tell it from a save in progress, and rightly keeps it)
    assert [n for n in os.listdir(out) if n.startswith(".") and not _pid_alive(n)] == []


def test_a_kill_between_the_step_rename_and_latest_resumes_the_newer_step(tmp_path):
    """The window the kills above aim at, made deterministic: a complete step directory newer than
    ``latest`` (or with no ``latest`` at all) is what ``--resume RUN`` continues."""
    out = tmp_path / "run"
    first = train(tiny_train_config(out, steps=3, seq_len=16, save_every=1), tiny_gpt_config(embed_dim=16))
    (out / "latest").write_text("step-000002\n")  # as if killed before latest moved on
    meta, _, _ = load_checkpoint(str(out))
    assert meta["step"] == 3
    os.remove(out / "latest")  # as if killed before the first latest was written
    meta, _, _ = load_checkpoint(str(out))
    assert meta["step"] == 3
    resumed = train(TrainConfig(resume=str(out), steps=5, device="cpu"))
    assert [r["loss"] for r in resumed["history"]][:3] == [r["loss"] for r in first["history"]]
    assert (out / "latest").read_text().strip() == "step-000005"


def test_resuming_a_finished_run_clears_a_killed_writers_temporary(tmp_path):
    """The window the random kills above found: a kill after the run's last save, while the loss curve
    was being written, leaves its temporary; resuming the finished run writes nothing else, yet clears it
    (a writer still running is never touched)."""
    out = tmp_path / "run"
    train(tiny_train_config(out, steps=2, seq_len=16), tiny_gpt_config(embed_dim=16))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid no process holds now
    stale, live = out / f".loss.png.tmp-{dead.pid}-x1", out / f".loss.png.tmp-{os.getppid()}-x2"
    stale.write_bytes(b"half a png"), live.write_bytes(b"a save in progress")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir() if p not in (stale, live))
    train(TrainConfig(resume=str(out), steps=2, device="cpu"))
    assert not stale.exists() and live.exists()
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir() if p != live) == before


def test_a_rotated_out_checkpoint_is_never_left_half_deleted(tmp_path, monkeypatch):
    import shutil

    out = tmp_path / "run"
    train(tiny_train_config(out, steps=2, seq_len=16, save_every=1), tiny_gpt_config(embed_dim=16))
    meta, weights, _ = load_checkpoint(str(out))
    seen = []

    def rmtree(path, *a, **k):  # what the rotation deletes is no longer a step-* directory
        seen.append(os.path.basename(path))
        raise KeyboardInterrupt  # killed inside the deletion

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    from attnkit.train.modeling import build_model

    model = build_model(meta["model_kind"], meta["model_config"])
    model.load_state_dict(weights, strict=False)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(out), 7, model, {k: v for k, v in meta.items() if k != "history"} | {"history": []})
    assert seen and not seen[0].startswith("step-")
    steps = sorted(n for n in os.listdir(out) if n.startswith("step-"))
    assert steps == ["step-000002", "step-000007"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [5])
def test_sigint_and_sigterm_at_random_moments_save_the_last_step_and_resume_bitwise(tmp_path, text, seed):
    steps, rng = 90, random.Random(seed)
    want = _reference(tmp_path, text, steps)
    out, log = str(tmp_path / "run"), ""
    argv, sent = _argv(text, out, steps), 0
    while sent < 10:
        signum = (signal.SIGINT, signal.SIGTERM)[sent % 2]
        log = str(tmp_path / f"run-{sent}.log")  # one per launch: the wait below reads this child's lines only
        pid = _fork_cli(argv, log)
        deadline = time.monotonic() + 30
        while not os.path.exists(log) or ("model gpt" not in open(log).read() and
                                          "resumed from" not in open(log).read()):
            assert time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0], open(log).read()
            time.sleep(0.002)  # its handlers are installed once it says what it trains
        time.sleep(rng.uniform(0.0, 0.08))
        os.kill(pid, signum)
        code = _wait(pid)
        err = open(log).read()
        assert "Traceback" not in err, err
        if code == 0:  # it had finished its last step: a finished run
            assert len(_losses(out)) == steps
            break
        assert code == 128 + signum, (code, err)
        last = err.strip().splitlines()[-1]
        assert last.startswith(signal.Signals(signum).name + ": stopped"), err
        sent += 1
        if "nothing was saved" in last:
            assert not os.path.exists(out)  # a failed start leaves nothing behind
            argv = _argv(text, out, steps)
            continue
        assert f"--resume {out}" in last
        meta, _, _ = load_checkpoint(out)
        done = int(last.split("after step ")[1].split(",")[0])
        assert meta["step"] == done  # the saved checkpoint is the last finished step, complete
        argv = _resume_argv(out)
    assert sent >= 8
    if len(_losses(out)) < steps:
        assert _wait(_fork_cli(_resume_argv(out), log)) == 0, open(log).read()
    assert _losses(out) == want  # bitwise


@pytest.mark.slow
def test_sigterm_to_the_real_command_exits_143_with_one_line_and_resumes(tmp_path, text):
    out = str(tmp_path / "run")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "attnkit", *_argv(text, out, 400)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:  # stop it once a few steps are saved
        lines.append(line)
        if line.startswith("saved step 3 "):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=60)
    lines += rest.splitlines(keepends=True)
    assert proc.returncode == 143, "".join(lines)
    assert "Traceback" not in "".join(lines)
    assert lines[-1].startswith("SIGTERM: stopped after step "), lines[-1]
    meta, _, _ = load_checkpoint(out)
    assert meta["step"] == int(lines[-1].split("after step ")[1].split(",")[0]) >= 3
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(x)["step"] for x in f][: meta["step"]] == list(range(1, meta["step"] + 1))


def test_a_failed_start_leaves_nothing_behind(tmp_path, monkeypatch):
    from attnkit.train import loop

    def broken(*args, **kwargs):
        raise ValueError("model: refused for the test")

    monkeypatch.setattr(loop, "build_model", broken)
    fresh, empty = tmp_path / "fresh" / "run", tmp_path / "empty"
    empty.mkdir()
    for out in (fresh, empty):
        with pytest.raises(ValueError, match="refused for the test"):
            train(tiny_train_config(out, steps=2), tiny_gpt_config())
    assert not fresh.exists()  # created by the run: removed
    assert list(empty.iterdir()) == []  # the user's own directory stays, empty as it was


def test_a_run_dir_without_a_checkpoint_is_never_answered_with_resume(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')  # a run killed before its first save
    with pytest.raises(ValueError) as new_run:
        train(tiny_train_config(out, steps=2), tiny_gpt_config())
    assert "--resume" not in str(new_run.value) and "--overwrite" in str(new_run.value)
    with pytest.raises(ValueError) as resumed:
        train(TrainConfig(resume=str(out), device="cpu"))
    assert "--overwrite" in str(resumed.value)
    train(tiny_train_config(out, steps=2, overwrite=True), tiny_gpt_config())  # the advice works
    assert load_checkpoint(str(out))[0]["step"] == 2


def test_a_child_killed_while_printing_leaves_the_parents_log_working():
    """Training prints through tqdm; tqdm's own output lock is shared with forked children (a
    semaphore), so a child killed while printing would leave the parent's next line waiting forever.
    attnkit's bar class keeps a lock of its own process."""
    import io
    import threading

    from attnkit._compat import progress_bar_class

    bar = progress_bar_class()
    if bar is None:
        pytest.skip("tqdm is not installed")
    bar.write("before", file=io.StringIO())
    pid = os.fork()
    if pid == 0:  # the child takes the lock and dies holding it
        bar.get_lock().acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    done = threading.Event()
    threading.Thread(target=lambda: (bar.write("after", file=io.StringIO()), done.set()), daemon=True).start()
    assert done.wait(20), "the parent's log waits on a lock its killed child held"
