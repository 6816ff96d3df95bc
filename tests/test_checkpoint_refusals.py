"""Checkpoints and pretrained directories whose config or tensors cannot be trusted are refused with a
clear error before anything large is allocated: sizes no tensor can have, tensors a config derives
but does not store, NaN weights, a state file without the RNG state a resume needs."""

from __future__ import annotations

import json
import resource

import pytest
import torch

pytest.importorskip("safetensors")

import safetensors.torch as st  # noqa: E402

from attnkit.nn.models import ViT, ViTConfig  # noqa: E402
from attnkit.nn.pretrained import load_pretrained, save_pretrained  # noqa: E402
from attnkit.train import CheckpointError, TrainConfig, train  # noqa: E402
from attnkit.train.checkpoint import load_checkpoint, resolve_checkpoint  # noqa: E402
from attnkit.train.modeling import load_model  # noqa: E402

from .train_helpers import tiny_gpt_config, tiny_train_config  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("refusals") / "run"
    train(tiny_train_config(out, steps=2, seq_len=12, batch_size=2), tiny_gpt_config(embed_dim=12, num_heads=3))
    return out


def _copy(run, tmp_path):
    import shutil

    dest = tmp_path / "copy"
    shutil.copytree(run, dest)
    return dest, dest / resolve_checkpoint(str(dest)).rsplit("/", 1)[1]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("field,value", [("embed_dim", 3 * 2**33), ("max_len", 2**62)])
def test_a_config_with_impossible_sizes_is_a_clear_error(run, tmp_path, field, value):
    out, ckpt = _copy(run, tmp_path)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["model_config"][field] = value
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="nothing was allocated") as info:
        load_model(str(out))
    assert "Fix:" in str(info.value)


def test_a_vit_config_deriving_a_huge_position_table_is_refused_before_allocating(tmp_path):
    model = ViT(ViTConfig(embed_dim=24, num_layers=1, num_heads=4, image_size=12, patch_size=2, num_classes=5))
    directory = save_pretrained(model, tmp_path / "vit")
    config = json.loads((directory / "config.json").read_text())
    config["config"]["image_size"] = 2**13  # 2**24 patches: a 1.5 GiB sin/cos table the weights never held
    (directory / "config.json").write_text(json.dumps(config))
    before = _peak_mb()
    with pytest.raises(ValueError, match="derives .* not stored") as info:
        load_pretrained(directory)
    assert "pos_embed" in str(info.value)
    assert _peak_mb() - before < 200  # refused on the meta device


def test_a_vit_within_the_bound_still_loads(tmp_path):
    model = ViT(ViTConfig(embed_dim=16, num_layers=1, num_heads=2, image_size=8, patch_size=2, num_classes=3))
    loaded = load_pretrained(save_pretrained(model, tmp_path / "vit"))
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(loaded(x), model.eval()(x))


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_nan_or_infinite_weights_are_refused_on_load(run, tmp_path, bad):
    out, ckpt = _copy(run, tmp_path)
    weights = st.load_file(str(ckpt / "model.safetensors"))
    name = sorted(weights)[-1]
    weights[name].view(-1)[weights[name].numel() // 2] = bad
    st.save_file(weights, str(ckpt / "model.safetensors"))
    for load in (load_checkpoint, load_model, lambda p: train(TrainConfig(resume=p, steps=3, device="cpu"))):
        with pytest.raises(CheckpointError, match="NaN or infinity") as info:
            load(str(out))
        assert name in str(info.value)


def test_nan_weights_in_a_pretrained_directory_are_refused(tmp_path):
    model = ViT(ViTConfig(embed_dim=16, num_layers=1, num_heads=2, image_size=8, patch_size=4, num_classes=3))
    with torch.no_grad():
        model.head.bias[1] = float("nan")
    directory = save_pretrained(model, tmp_path / "vit")
    with pytest.raises(ValueError, match="head.bias"):
        load_pretrained(directory)


def test_a_state_file_without_the_rng_state_refuses_to_resume(run, tmp_path):
    out, ckpt = _copy(run, tmp_path)
    state = st.load_file(str(ckpt / "state.safetensors"))
    del state["rng.cpu"]
    st.save_file(state, str(ckpt / "state.safetensors"))
    with pytest.raises(CheckpointError, match="RNG state") as info:
        train(TrainConfig(resume=str(out), steps=4, device="cpu"))
    assert "exactly" in str(info.value) and "Fix:" in str(info.value)
    load_model(str(out))  # the weights themselves still load (generate, evaluation)


@pytest.mark.parametrize("rank", [0, 3])
def test_every_torchrun_rank_refuses_a_used_out_before_the_process_group_starts(tmp_path, monkeypatch, rank):
    """Rank 0 is the one that writes --out, but the others must not go on to join a process group rank 0
    never joins (gloo's timeout tracebacks): every rank refuses alike, with the same one-line error."""
    import torch.distributed as dist

    out = tmp_path / "used"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))

    def no_group(*args, **kwargs):
        raise AssertionError("the process group started before the refusal")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    with pytest.raises(ValueError, match=r"^out: .*is not empty \(notes.txt\)\. Fix: "):
        train(tiny_train_config(out), tiny_gpt_config())
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
