"""torchrun with 2 CPU processes (gloo) gives the losses of 1 process with the same global batch."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("safetensors")

from attnkit.train import train  # noqa: E402

from .train_helpers import read_losses, tiny_gpt_config, tiny_train_config  # noqa: E402

MODEL_FLAGS = ["--embed-dim", "32", "--num-layers", "2", "--num-heads", "2", "--max-len", "64", "--position", "learned"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_ddp_matches_one_process(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200)))
    common = dict(data=str(text), steps=4, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1)
    single = train(tiny_train_config(tmp_path / "one", **common), tiny_gpt_config())
    flags = ["--data", str(text), "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--lr", "1e-2",
             "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
             "--no-progress", "--device", "cpu", "--out", str(tmp_path / "two"), *MODEL_FLAGS]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "-m", "attnkit", "train", *flags]
    # Its own session: on a timeout the whole group (torchrun and its workers) is killed, so no worker
    # left holding the output pipes can keep the test waiting.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail("two-process training did not finish in 240 s:\n" + out[-2000:] + err[-4000:])
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    assert '"world": 2' in out
    two = read_losses(tmp_path / "two")
    one = [r["loss"] for r in single["history"]]
    assert len(two) == len(one) == 4
    assert one[-1] < one[0]  # it learns, so the comparison is about training, not initialisation
    assert two == pytest.approx(one, rel=1e-5)
    # rank 0 alone wrote the checkpoint
    assert sorted(d for d in os.listdir(tmp_path / "two") if d.startswith("step-")) == ["step-000004"]


def test_context_parallels_rank_local_buffers_raise_no_future_warning(tmp_path):
    """ContextParallel keeps rank-local buffers with DDP's broadcast_buffers=False, which torch's own
    deprecation message says to keep using: attnkit says nothing about it to the user."""
    import types
    import warnings

    import torch
    import torch.distributed as dist

    from attnkit.train.distributed import DistContext
    from attnkit.train.parallel import ContextParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        fake = types.SimpleNamespace(ctx=DistContext(rank=0, world=2), _ddp_options=ContextParallel._ddp_options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = ContextParallel.wrap(fake, torch.nn.Linear(2, 2))
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        assert not [w for w in caught if "broadcast_buffers" in str(w.message)], [str(w.message) for w in caught]
    finally:
        dist.destroy_process_group()
