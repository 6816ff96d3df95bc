"""The probed machine constants' cache (``machine.json``): read back while it describes this machine,
torch, thread count and native build; probed again when the build changes or a quick re-check finds
it measured under load; a corrupt or foreign file is ignored with one warning and never breaks a call."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import attnkit
from attnkit import calibration, hardware

from .conftest import uniform_constants

FAKE = uniform_constants(overhead=3e-5)


@pytest.fixture
def probes(tmp_path, monkeypatch):
    """A count of probes (each returns FAKE), with the constants cached under tmp_path and a quick
    re-check that finds the stored rates plausible."""
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "cal.json"))
    count: list[int] = []
    monkeypatch.setattr(calibration, "probe_constants", lambda: count.append(1) or json.loads(json.dumps(FAKE)))
    monkeypatch.setattr(hardware, "quick_rates", lambda **kw: {"tile_gflops": FAKE["tile_gflops"],
                                                               "op_seconds": FAKE["op_seconds"]})
    monkeypatch.setattr(calibration, "build_stamp", lambda: "build-1")
    calibration.reload(constants=True)
    yield count
    calibration.reload(constants=True)


def _fresh() -> dict:
    """The constants a new process would get."""
    calibration.reload(constants=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning unless a test expects one
        return calibration.machine_constants()


def test_probed_once_then_read_back(probes):
    assert calibration.machine_constants() == FAKE and len(probes) == 1
    assert _fresh() == FAKE and len(probes) == 1  # read back, not probed again
    stored = json.loads(calibration.constants_path().read_text())
    assert stored["machine"]["torch"] == torch.__version__ and "threads" not in stored["machine"]
    assert stored["entries"][str(torch.get_num_threads())]["build"] == "build-1"


def test_a_changed_native_build_is_probed_again(probes, monkeypatch):
    _fresh()
    monkeypatch.setattr(calibration, "build_stamp", lambda: "build-2")
    _fresh()
    assert len(probes) == 2
    _fresh()
    assert len(probes) == 2  # the new build's constants are stored
    assert json.loads(calibration.constants_path().read_text())["entries"][str(torch.get_num_threads())][
        "build"] == "build-2"


def test_the_real_build_stamp_follows_the_stamp_file(tmp_path, monkeypatch):
    from attnkit.csrc import build as csrc_build

    stamp, library = tmp_path / "stamp.json", tmp_path / "lib.so"
    monkeypatch.setattr(csrc_build, "STAMP", stamp)
    monkeypatch.setattr(csrc_build, "library_path", lambda: library)
    assert calibration.build_stamp() == "none"
    stamp.write_text(json.dumps({"torch": torch.__version__, "sources": "aaaa", "build_seconds": 50.0}))
    library.write_bytes(b"")
    first = calibration.build_stamp()
    assert first != "none" and hardware.machine_id()["native"] == first
    stamp.write_text(json.dumps({"torch": torch.__version__, "sources": "aaaa", "build_seconds": 51.0}))
    assert calibration.build_stamp() == first  # the same sources rebuilt: the same kernel
    stamp.write_text(json.dumps({"torch": torch.__version__, "sources": "bbbb", "build_seconds": 50.0}))
    assert first != calibration.build_stamp() != "none"  # other sources: another kernel
    stamp.write_text(json.dumps({"torch": "0.0-other", "sources": "aaaa"}))
    assert calibration.build_stamp() == "none" and hardware.machine_id()["native"] is None  # not usable here


def test_constants_probed_under_load_are_probed_again(probes, monkeypatch):
    _fresh()
    busy = json.loads(calibration.constants_path().read_text())
    entry = busy["entries"][str(torch.get_num_threads())]["constants"]
    entry["op_seconds"] *= 10  # as a probe on a busy machine measures
    calibration.constants_path().write_text(json.dumps(busy))
    _fresh()
    assert len(probes) == 2
    # the machine busy now instead: the re-check is slower, the stored constants stay
    monkeypatch.setattr(hardware, "quick_rates", lambda **kw: {"tile_gflops": FAKE["tile_gflops"] / 10,
                                                               "op_seconds": FAKE["op_seconds"] * 10})
    _fresh()
    assert len(probes) == 2


def test_the_real_quick_recheck_is_quick_and_agrees_with_the_probe():
    import time

    hardware.quick_rates()
    start = time.perf_counter()
    now = hardware.quick_rates()
    assert time.perf_counter() - start < 0.25
    assert now["tile_gflops"] > 0 and now["op_seconds"] > 0


@pytest.mark.parametrize("content", ["{ not json", "[1, 2]",
                                     '{"version": %d, "machine": 3, "entries": {}}' % calibration.CONSTANTS_VERSION,
                                     '{"version": 99, "machine": {}, "entries": {}}', '{"version": "3"}'])
def test_a_corrupt_file_is_refused_with_one_line_and_no_call_breaks(probes, content):
    path = calibration.constants_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    calibration.reload(constants=True)
    with pytest.warns(RuntimeWarning) as record:
        x = torch.randn(1, 2, 8, 8)
        out = attnkit.attention(x, x, x, mask=attnkit.Causal(), q_offset=3, kv_offset=3)  # decided afresh
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "\n" not in messages[0] and str(path) in messages[0], messages
    assert out.shape == x.shape and len(probes) == 1
    assert _fresh() == FAKE and len(probes) == 1  # replaced by the probe's


def test_an_unusable_entry_is_refused_with_one_line(probes):
    _fresh()
    data = json.loads(calibration.constants_path().read_text())
    data["entries"][str(torch.get_num_threads())]["constants"]["op_seconds"] = -1
    calibration.constants_path().write_text(json.dumps(data))
    calibration.reload(constants=True)
    with pytest.warns(RuntimeWarning, match="unusable"):
        calibration.machine_constants()
    assert len(probes) == 2


@pytest.mark.parametrize("field", ["torch", "cpu"])
def test_a_file_from_another_machine_or_torch_is_ignored_with_a_warning(probes, field):
    _fresh()
    data = json.loads(calibration.constants_path().read_text())
    data["machine"][field] = "0.0-other"
    calibration.constants_path().write_text(json.dumps(data))
    calibration.reload(constants=True)
    with pytest.warns(RuntimeWarning, match=f"another machine, torch version or attnkit build.*{field} '0.0-other'"):
        assert calibration.machine_constants() == FAKE
    assert len(probes) == 2
    assert _fresh() == FAKE and len(probes) == 2  # replaced by this machine's


def test_each_thread_count_keeps_its_own_entry(probes):
    threads = torch.get_num_threads()
    _fresh()
    try:
        torch.set_num_threads(threads + 1)
        _fresh()
        assert len(probes) == 2
    finally:
        torch.set_num_threads(threads)
    _fresh()
    assert len(probes) == 2  # the first entry is still there: no probe each time the count changes
    assert len(json.loads(calibration.constants_path().read_text())["entries"]) == 2


def test_reprobe_measures_now_and_forgets_decisions_taken_from_the_old_constants(probes):
    _fresh()
    generation = calibration.generation()
    assert calibration.reprobe() == FAKE and len(probes) == 2
    assert calibration.generation() != generation and calibration.machine_constants() == FAKE
    assert len(probes) == 2


def test_a_new_thread_count_takes_its_own_constants_and_decides_afresh(probes, monkeypatch):
    from attnkit import dispatch

    def probe():
        probes.append(1)
        constants = uniform_constants(overhead=1e-5 * torch.get_num_threads())
        if torch.get_num_threads() > 1:  # another count, another winner
            constants["backend_seconds"]["tiled"] = 1e-9
            constants["reference_seconds"]["tiled"] = {c: 1e-7 for c in ("causal", "band", "layout", "decode")}
        return constants

    monkeypatch.setattr(calibration, "probe_constants", probe)
    monkeypatch.setattr(dispatch, "_CALLS", {})
    ran = []
    monkeypatch.setattr(attnkit.list_backends()["tiled"], "forward",
                        classmethod(lambda cls, inp, options: ran.append(cls.name) or inp.q.clone()))
    threads = torch.get_num_threads()
    x = torch.randn(1, 2, 16, 8)
    attnkit.attention(x, x, x, mask=attnkit.Causal())
    one = calibration.machine_constants()["backend_seconds"]["sdpa"]
    try:
        torch.set_num_threads(threads + 1)
        attnkit.attention(x, x, x, mask=attnkit.Causal())  # no reload: the count alone
        now = calibration.machine_constants()["backend_seconds"]["sdpa"]
        assert now == pytest.approx(one * (threads + 1) / threads)
        assert ran == ["tiled"]
    finally:
        torch.set_num_threads(threads)
    attnkit.attention(x, x, x, mask=attnkit.Causal())
    assert ran == ["tiled"] and len(probes) == 2


def test_an_older_attnkits_file_is_replaced_quietly(probes):
    path = calibration.constants_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 1, "machine": "{}", "constants": FAKE}))
    assert _fresh() == FAKE and len(probes) == 1  # no warning (an upgrade), probed
    assert json.loads(path.read_text())["version"] == calibration.CONSTANTS_VERSION
