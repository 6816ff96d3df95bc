"""Directories from elsewhere: run directories, checkpoints, save_pretrained directories, measured dispatch tables.

Each refusal is a ValueError naming the file and the fix (never a raw KeyError, JSONDecodeError or
SafetensorError), happens before memory is spent on what the files claim, and no write follows a
symbolic link planted in an output directory."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings

import pytest
import torch

pytest.importorskip("safetensors")

from attnkit import attention, hardware  # noqa: E402
from attnkit.dispatch import table  # noqa: E402
from attnkit.interop import load_pretrained  # noqa: E402
from attnkit.masks import Causal  # noqa: E402
from attnkit.nn.layers import TransformerConfig  # noqa: E402
from attnkit.nn.models import GPT, Encoder  # noqa: E402
from attnkit.train import CheckpointError, TrainConfig, load_checkpoint, load_model, train  # noqa: E402
from attnkit.io import checkpoints as layout  # noqa: E402
from attnkit.io.files import append_line  # noqa: E402

from .train_helpers import tiny_gpt_config, tiny_train_config  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 2-step run (a pristine copy is made for each test that tampers with it)."""
    out = tmp_path_factory.mktemp("pristine") / "run"
    train(tiny_train_config(out, steps=2, save_every=1), tiny_gpt_config(num_layers=1))
    return out


@pytest.fixture
def run(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, symlinks=True)
    return copy


def _meta(run) -> tuple[dict, os.PathLike]:
    path = run / (run / "latest").read_text().strip() / "meta.json"
    return json.loads(path.read_text()), path


# -- the latest pointer ---------------------------------------------------------------------------

@pytest.mark.parametrize("pointer", ["../outside/step-000002", "ABSOLUTE", "step-000002/../../outside/step-000002",
                                     "", "step-000009"])
def test_latest_never_leads_outside_the_run_directory(run, tmp_path, pointer):
    outside = tmp_path / "outside"
    shutil.copytree(run, outside)
    if pointer == "ABSOLUTE":
        pointer = str(outside / "step-000002")
    (run / "latest").write_text(pointer + "\n")
    with pytest.raises(CheckpointError, match=r"latest names .*not a step-\* directory inside.*Fix: write the name"):
        load_checkpoint(str(run))


def test_symlinked_checkpoints_latest_and_files_are_refused(run, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(run / "step-000002", outside)
    shutil.rmtree(run / "step-000002")
    os.symlink(outside, run / "step-000002")  # the named checkpoint is a link
    with pytest.raises(CheckpointError, match="not a step-.* directory inside"):
        load_checkpoint(str(run))
    (run / "step-000002").unlink()
    shutil.copytree(outside, run / "step-000002")
    (run / "latest").unlink()
    os.symlink(tmp_path / "elsewhere-latest", run / "latest")
    (tmp_path / "elsewhere-latest").write_text("step-000002\n")
    with pytest.raises(CheckpointError, match="latest is not the small regular file"):
        load_checkpoint(str(run))
    (run / "latest").unlink()
    (run / "latest").write_text("step-000002\n")
    meta = run / "step-000002" / "meta.json"
    shutil.move(meta, tmp_path / "meta.json")
    os.symlink(tmp_path / "meta.json", meta)
    with pytest.raises(CheckpointError, match=r"meta.json is a symbolic link"):
        load_checkpoint(str(run))


# -- tampered checkpoints -------------------------------------------------------------------------

@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(step=-5), r"'step' must be an integer >= 0, got -5"),
    (lambda m: m.update(step="2"), r"'step' must be an integer"),
    (lambda m: m.update(model_kind="bogus"), r"'model_kind' must be one of \('gpt', 'lstm'\), got 'bogus'"),
    (lambda m: m.pop("model_config"), r"'model_config' is missing"),
    (lambda m: m.update(history=m["history"][:1]), r"'history' has 1 entries for step 2"),
    (lambda m: m.update(history="x"), r"'history' must be a JSON array"),
    (lambda m: m.update(optimizer={"param_groups": 1}), r"'optimizer' must hold"),
    (lambda m: m["model_config"].update(num_heads="four"), r"the stored config is not valid"),
    (lambda m: m["model_config"].update(vocab_size=5_000_000), r"does not describe the stored weights.*nothing was"),
    (lambda m: m["model_config"].update(num_layers=10**7), r"num_layers=10000000 but the weights hold only"),
])
def test_tampered_meta_is_refused_naming_the_file(run, edit, message):
    meta, path = _meta(run)
    edit(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=message) as info:
        load_model(str(run))
    assert "meta.json" in str(info.value) or str(run) in str(info.value)
    assert "Fix:" in str(info.value)


@pytest.mark.parametrize("content", [b"", b"{not json", b"[1, 2]", b"\xff\xfe\x00"])
def test_unreadable_meta_is_a_clear_error(run, content):
    _, path = _meta(run)
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"meta.json.*Fix:"):
        load_checkpoint(str(run))


def test_oversized_meta_is_refused_before_reading(run, monkeypatch):
    monkeypatch.setattr(layout, "META_LIMIT_BYTES", 100)
    with pytest.raises(ValueError, match=r"meta.json: \d+ bytes, more than the 100"):
        load_checkpoint(str(run))


@pytest.mark.parametrize("name", ["model.safetensors", "state.safetensors"])
@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_safetensors_are_a_clear_error(run, name, damage):
    path = run / "step-000002" / name
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x10" * 64, "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=rf"{name}: not a readable safetensors file.*Fix:"):
        load_checkpoint(str(run))


def test_optimizer_state_that_does_not_fit_is_a_clear_error_on_resume(run):
    import safetensors.torch as st

    path = run / "step-000002" / "state.safetensors"
    state = st.load_file(str(path))
    state = {(k.replace("optim.0.", "optim.x.") if k.startswith("optim.0.") else k): v for k, v in state.items()}
    st.save_file(state, str(path))
    with pytest.raises(CheckpointError, match="optimizer or RNG state does not fit"):
        train(TrainConfig(resume=str(run), steps=3, device="cpu"))


# -- save_pretrained directories -------------------------------------------------------------------

def _small_gpt(**kw):
    return GPT(TransformerConfig(vocab_size=50, max_len=32, embed_dim=16, num_layers=1, num_heads=2, **kw))


def _peak_rss_growth(fn) -> int:
    """Bytes the process's peak RSS grew while ``fn`` ran (Linux: reset the peak, read VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    before = int(status["VmRSS"].split()[0])
    try:
        fn()
    finally:
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return (int(status["VmHWM"].split()[0]) - before) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the peak memory")
def test_a_config_claiming_a_huge_model_is_refused_before_allocating(tmp_path):
    _small_gpt().save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["config"]["vocab_size"] = 5_000_000  # 5M x 16 floats = 305 MiB of embedding, tied
    meta["config"]["embed_dim"] = 64  # 1.2 GiB
    (tmp_path / "config.json").write_text(json.dumps(meta))

    def load():
        with pytest.raises(CheckpointError, match=r"config.json: the stored config does not describe the stored "
                                                  r"weights.*mismatched.*5000000.*nothing was allocated"):
            load_pretrained(tmp_path)

    assert _peak_rss_growth(load) < 64 * 2**20


@pytest.mark.parametrize("tamper, message", [
    (lambda d: d["config"].update(num_layers=3), r"missing \['layers.1"),
    (lambda d: d["config"].update(num_layers=10**8), r"num_layers=100000000"),
    (lambda d: d.update(model="Decoder", model_type="decoder"), r"does not describe the stored weights"),
    (lambda d: d.update(model="os.system"), r"unknown model 'os.system'"),
    (lambda d: d.update(model_type="bert"), r"model_type 'bert' disagrees with model 'GPT'"),
    (lambda d: d.update(config=[1]), r"'config' is missing or not an object"),
    (lambda d: d["config"].update(embed_dim=-3), r"the stored config is not valid"),
    (lambda d: d.update(backend_options={"fields": {"block_size": 4}}), r"the stored config is not valid"),
])
def test_tampered_pretrained_configs_are_refused(tmp_path, tamper, message):
    _small_gpt().save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    tamper(meta)
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=message):
        load_pretrained(tmp_path)


def test_oversized_symlinked_and_garbage_pretrained_files_are_refused(tmp_path):
    _small_gpt().save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    good = config.read_text()
    config.write_text(good[:-2] + " " * 2**20 + "}\n")
    with pytest.raises(ValueError, match=r"config.json: \d+ bytes, more than the 1048576"):
        load_pretrained(tmp_path)
    config.unlink()
    (tmp_path / "real-config.json").write_text(good)
    os.symlink(tmp_path / "real-config.json", config)
    with pytest.raises(ValueError, match=r"config.json: is a symbolic link"):
        load_pretrained(tmp_path)
    config.unlink()
    config.write_text(good)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        load_pretrained(tmp_path)


# -- writes never follow symbolic links already in the directory ----------------------------------

def test_save_pretrained_replaces_planted_links_instead_of_writing_through_them(tmp_path):
    victim_config, victim_weights = tmp_path / "victim.json", tmp_path / "victim.bin"
    victim_config.write_text("precious")
    victim_weights.write_text("precious")
    out = tmp_path / "model"
    out.mkdir()
    os.symlink(victim_config, out / "config.json")
    os.symlink(victim_weights, out / "model.safetensors")
    model = _small_gpt()
    model.save_pretrained(out)
    assert victim_config.read_text() == victim_weights.read_text() == "precious"
    assert not (out / "config.json").is_symlink() and not (out / "model.safetensors").is_symlink()
    loaded = GPT.from_pretrained(out)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_a_resumed_run_replaces_planted_links_instead_of_writing_through_them(run, tmp_path):
    victims = {}
    for name in ("results.json", "metrics.jsonl", "loss.png"):
        victim = tmp_path / f"victim-{name}"
        victim.write_text("precious")
        victims[name] = victim
        if os.path.lexists(run / name):
            (run / name).unlink()
        os.symlink(victim, run / name)
    train(TrainConfig(resume=str(run), steps=3, device="cpu"))
    for name, victim in victims.items():
        assert victim.read_text() == "precious", name
        assert not (run / name).is_symlink(), name
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


def test_appending_through_a_link_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "metrics.jsonl")
    with pytest.raises(ValueError, match=r"metrics.jsonl: is a symbolic link; refusing to write through it"):
        append_line(tmp_path / "metrics.jsonl", "{}")
    assert victim.read_text() == "precious"


def test_from_pretrained_reads_run_directories_and_checks_the_class(run):
    model = GPT.from_pretrained(run)
    reference, _ = load_model(str(run))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    assert GPT.from_pretrained(run / "step-000002").config == model.config
    with pytest.raises(TypeError, match=r"holds a GPT, not a Encoder.*GPT.from_pretrained"):
        Encoder.from_pretrained(run)


# -- measured dispatch tables (calibration.json) -------------------------------------------------

GOOD_POINT = {"n": 64, "order": ["sdpa", "naive"], "times": {"sdpa": 1e-4, "naive": 2e-4}}
KEY = "cpu|float32|Causal|forward|H2|D16"


def _table(entries, **fields) -> str:
    """A version-3 table of this machine with ``entries``; ``fields`` replace or add top-level keys."""
    return json.dumps({"version": 3, "machine_id": hardware.machine_id(), "entries": entries, **fields})


@pytest.mark.parametrize("content", [
    "", "{", "[]", "null", json.dumps({"version": 3}), "[" * 100_000,
    _table({KEY: [GOOD_POINT]}, version=2),  # an older format
    _table({KEY: [GOOD_POINT]}, machine_id=None),
    _table(None),
    _table({KEY: []}),
    _table({KEY: [{"order": ["sdpa"], "times": {"sdpa": 1}}]}),
    _table({KEY: [dict(GOOD_POINT, n=-4)]}),
    _table({KEY: [dict(GOOD_POINT, n="64")]}),
    _table({KEY: [dict(GOOD_POINT, n=float("inf"))]}),
    _table({KEY: [dict(GOOD_POINT, n=True)]}),
    _table({KEY: [dict(GOOD_POINT, order=[])]}),
    _table({KEY: [dict(GOOD_POINT, order=["sdpa", "sdpa"])]}),
    _table({KEY: [dict(GOOD_POINT, times={})]}),
    _table({KEY: [dict(GOOD_POINT, times={"sdpa": 1e-4, "naive": 0})]}),
    _table({KEY: [dict(GOOD_POINT, order="sdpa")]}),
    _table({KEY: [dict(GOOD_POINT, interleaved={"ratio": -1, "rounds": 5})]}),
    _table({KEY: [dict(GOOD_POINT, interleaved=1.3)]}),
    _table({"cpu|Causal": [GOOD_POINT]}),
    _table({"cpu|float32|Causal|backward|H2|D16": [GOOD_POINT]}),
    _table({"cpu|float32|Causal|forward|H0|D16": [GOOD_POINT]}),
    _table({KEY: "x"}),
    _table({KEY: [None]}),
])
def test_a_malformed_table_is_ignored_with_one_warning(tmp_path, monkeypatch, content):
    path = tmp_path / "calibration.json"
    path.write_text(content)
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    q = torch.randn(1, 2, 8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table.reload()
        out1 = attention(q, q, q, mask=Causal())
        out2 = attention(q, q, q, mask=Causal())
    relevant = [w for w in caught if "calibration" in str(w.message)]
    assert len(relevant) == 1 and str(path) in str(relevant[0].message) and "attnkit bench" in str(relevant[0].message)
    assert relevant[0].category is RuntimeWarning and "ignored" in table.status()
    torch.testing.assert_close(out1, out2)


def test_the_table_is_written_atomically_and_never_through_a_link(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "calibration.json"
    os.symlink(victim, path)
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    table.save({"entries": {KEY: [GOOD_POINT]}})
    assert victim.read_text() == "precious" and not path.is_symlink()
    assert table.load()["entries"][KEY] == [GOOD_POINT]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    with pytest.raises(ValueError, match="not saving an unusable table"):
        table.save({"entries": {KEY: []}})
    assert table.load()["entries"][KEY] == [GOOD_POINT]


def test_save_merges_only_into_this_machines_usable_table(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    other = "cpu|float32|none|forward|H2|D16"
    table.save({"entries": {KEY: [GOOD_POINT]}})
    table.save({"entries": {other: [GOOD_POINT]}}, merge=True)
    assert set(table.load()["entries"]) == {KEY, other}
    newer = dict(GOOD_POINT, order=["naive", "sdpa"], times={"sdpa": 2e-4, "naive": 1e-4})
    table.save({"entries": {KEY: [newer]}}, merge=True)  # a key measured again replaces the old rows
    assert table.load()["entries"] == {KEY: [newer], other: [GOOD_POINT]}
    table.save({"entries": {other: [GOOD_POINT]}})  # no merge: the file holds what was given
    assert set(table.load()["entries"]) == {other}
    data = json.loads(path.read_text())
    data["machine_id"]["cpu"] = "Another CPU 9000"
    path.write_text(json.dumps(data))
    table.save({"entries": {KEY: [GOOD_POINT]}}, merge=True)  # another machine's rows are not kept
    assert set(table.load()["entries"]) == {KEY}


def test_an_lstm_baseline_run_is_not_an_attnkit_model(tmp_path):
    from attnkit.train import LSTMConfig

    out = tmp_path / "lstm"
    train(tiny_train_config(out, steps=1, model="lstm"), LSTMConfig(embed_dim=4, hidden_dim=4, num_layers=1))
    with pytest.raises(TypeError, match=r"run of the 'lstm' baseline.*attnkit.train.load_model"):
        GPT.from_pretrained(out)
    model, _ = load_model(str(out))
    assert model.config.hidden_dim == 4
