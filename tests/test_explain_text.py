"""explain()'s text is true in every case: a named backend that cannot run, backends that were not
named, a measured table that ranks naive among its backends (naive still last, each listed once),
and the policy line (the table's figures or the static rule)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.dispatch import priority, table
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
def measured(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "calibration.json"))
    key = table.entry_key("cpu", "float32", "none", "forward", heads=2, head_dim=8)
    table.save({"entries": {key: [{"n": 24, "order": ["naive", "tiled", "sdpa"],
                                   "times": {"naive": 1e-5, "tiled": 2e-5, "sdpa": 3e-5}}]}})
    yield
    monkeypatch.delenv("ATTNKIT_CALIBRATION")
    table.reload()


def test_a_measured_order_lists_each_backend_once_and_naive_last(measured):
    q = torch.randn(1, 2, 24, 8)
    order = priority(AttentionInputs.create(q, q, q))
    assert order[:2] == ("tiled", "sdpa") and order[-1] == "naive"
    assert len(order) == len(set(order)), order
    e = attnkit.explain(q, q, q)
    lines = [line.strip().split(":")[0] for line in str(e).splitlines() if line.startswith("  ")]
    assert e.chosen == "tiled" and len(lines) == len(set(lines)), lines
    assert "policy: measured on this machine: " in str(e)


def test_the_policy_line_names_the_static_rule_and_the_table_status_without_a_table():
    q = torch.randn(1, 2, 24, 8)
    text = str(attnkit.explain(q, q, q))
    assert "policy: the static rule (fused kernels that read the mask's structure first" in text
    assert f"no table at {table.calibration_path()}" in text and "`python -m attnkit bench`" in text
    named = str(attnkit.explain(q, q, q, backend="tiled"))
    assert "policy:" not in named  # a named backend follows no policy
