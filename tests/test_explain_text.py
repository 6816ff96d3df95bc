"""explain()'s text is true in every case: a named backend that cannot run, backends that were not
named, and a calibrated order that ranks naive among the measured backends (listed once)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import calibration
from attnkit.dispatch import priority
from attnkit.inputs import AttentionInputs
from attnkit.masks import SlidingWindow


def test_a_named_backend_that_cannot_run_is_said_so_and_nothing_comes_after_none():
    q = torch.randn(2, 3, 10, 8)
    text = str(attnkit.explain(q, q, q, backend="block_sparse"))  # no BlockSparse layout: it cannot run
    assert "None" not in text, text
    assert "chosen: none: the backend(s) named (block_sparse) cannot run this input" in text
    assert "could run, but was not named (block_sparse was)" in text


def test_a_named_backend_that_runs_is_not_said_to_be_first_in_priority_order():
    q = torch.randn(1, 2, 12, 8)
    e = attnkit.explain(q, q, q, mask=SlidingWindow(3, 0), backend="sliding_window")
    text = str(e)
    assert e.chosen == "sliding_window"
    assert "the first named" in text and "comes after" not in text, text
    with attnkit.use_backend("block_sparse", "tiled"):
        text = str(attnkit.explain(q, q, q))
    assert "chosen: tiled" in text and "not named (block_sparse, tiled was)" in text, text


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "calibration.json"))
    calibration.reload()
    key = calibration.entry_key("cpu", "float32", "none", "forward", heads=2, head_dim=8)
    calibration.save({"entries": {key: [{"n": 24, "order": ["naive", "tiled", "sdpa"],
                                         "times": {"naive": 1e-5, "tiled": 2e-5, "sdpa": 3e-5}}]}})
    yield
    monkeypatch.delenv("ATTNKIT_CALIBRATION")
    calibration.reload()


def test_a_calibrated_order_lists_each_backend_once(calibrated):
    q = torch.randn(1, 2, 24, 8)
    order = priority(AttentionInputs.create(q, q, q))
    assert order[:3] == ("naive", "tiled", "sdpa")
    assert len(order) == len(set(order)), order
    e = attnkit.explain(q, q, q)
    lines = [line.strip().split(":")[0] for line in str(e).splitlines() if line.startswith("  ")]
    assert e.chosen == "naive" and len(lines) == len(set(lines)), lines
