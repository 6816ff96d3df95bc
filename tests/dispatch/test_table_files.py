"""No table file can break a call: the whole schema (keys, types, ranges) is checked when the file is
read; anything unusable is ignored with one warning and the static rule decides."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import Causal, hardware
from attnkit.dispatch import table

KEY = table.entry_key("cpu", "float32", "Causal", "forward", heads=2, head_dim=8)
GOOD_POINT = {"n": 32, "order": ["tiled", "sdpa"], "times": {"tiled": 1e-3, "sdpa": 2e-3},
              "interleaved": {"ratio": 2.0, "rounds": 5}}


def _good():
    return {"version": table.VERSION, "machine_id": hardware.machine_id(), "entries": {KEY: [dict(GOOD_POINT)]}}


def _call():
    q = torch.randn(1, 2, 32, 8)
    return attnkit.attention(q, q, q, mask=Causal())


def _use(tmp_path, monkeypatch, text: str):
    path = tmp_path / "calibration.json"
    path.write_text(text)
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table.reload()
        out = _call()
    assert torch.isfinite(out).all()
    return [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_good_table_is_used(tmp_path, monkeypatch):
    assert _use(tmp_path, monkeypatch, json.dumps(_good())) == []
    q = torch.randn(1, 2, 32, 8)
    assert attnkit.explain(q, q, q, mask=Causal()).chosen == "tiled"


def _deep(n):
    return "[" * n + "]" * n


BAD = {
    "not json": "{",
    "a list": "[]",
    "nested 100000 deep": _deep(100_000),
    "an int past float": json.dumps({**_good(), "entries": {KEY: [{**GOOD_POINT, "n": 10**400}]}}),
    "a time past float": json.dumps({**_good(), "entries": {KEY: [{**GOOD_POINT, "times": {"tiled": 10**400,
                                                                                           "sdpa": 1}}]}}),
    "no machine_id": json.dumps({k: v for k, v in _good().items() if k != "machine_id"}),
    "a key of 5 parts": json.dumps({**_good(), "entries": {"cpu|float32|Causal|forward|H2": [GOOD_POINT]}}),
    "an unknown pass": json.dumps({**_good(), "entries": {KEY.replace("forward", "both"): [GOOD_POINT]}}),
    "heads not a number": json.dumps({**_good(), "entries": {KEY.replace("H2", "Hx"): [GOOD_POINT]}}),
    "order of numbers": json.dumps({**_good(), "entries": {KEY: [{**GOOD_POINT, "order": [1, 2]}]}}),
    "order repeats": json.dumps({**_good(), "entries": {KEY: [{**GOOD_POINT, "order": ["tiled", "tiled"]}]}}),
    "a missing time": json.dumps({**_good(), "entries": {KEY: [{**GOOD_POINT, "times": {"tiled": 1e-3}}]}}),
    "NaN time": json.dumps({**_good(), "entries": {KEY: [{**GOOD_POINT, "times": {"tiled": float("nan"),
                                                                                 "sdpa": 1.0}}]}}),
    "negative n": json.dumps({**_good(), "entries": {KEY: [{**GOOD_POINT, "n": -4}]}}),
    "bool n": json.dumps({**_good(), "entries": {KEY: [{**GOOD_POINT, "n": True}]}}),
    "interleaved a string": json.dumps({**_good(), "entries": {KEY: [{**GOOD_POINT, "interleaved": "yes"}]}}),
    "an old version": json.dumps({**_good(), "version": 2}),
    "another machine": json.dumps({**_good(), "machine_id": {**hardware.machine_id(), "cpu": "elsewhere"}}),
    "not utf-8": b"\xff\xfe{".decode("latin-1"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_an_unusable_table_is_ignored_with_one_warning(tmp_path, monkeypatch, name):
    caught = _use(tmp_path, monkeypatch, BAD[name])
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "calibration: ignoring" in str(caught[0].message) and "Fix:" in str(caught[0].message)
    q = torch.randn(1, 2, 32, 8)
    assert "static rule" in attnkit.explain(q, q, q, mask=Causal()).measured


def test_an_unknown_backend_name_in_a_row_is_passed_over(tmp_path, monkeypatch):
    data = _good()
    data["entries"][KEY] = [{**GOOD_POINT, "order": ["gone", "tiled"], "times": {"gone": 1e-4, "tiled": 1e-3}}]
    assert _use(tmp_path, monkeypatch, json.dumps(data)) == []
    q = torch.randn(1, 2, 32, 8)
    assert attnkit.explain(q, q, q, mask=Causal()).chosen == "tiled"


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4),
                     max_leaves=20)


def _mutations():
    """A good table with one value anywhere in it replaced by random JSON."""
    return st.tuples(st.sampled_from(["root", "machine_id", "entries", "point", "order", "times", "interleaved",
                                      "n"]), _json)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=_mutations())
def test_random_json_never_breaks_a_call(tmp_path_factory, monkeypatch, mutation):
    where, value = mutation
    data = _good()
    point = data["entries"][KEY][0]
    if where == "root":
        data = value
    elif where in ("machine_id", "entries"):
        data[where] = value
    elif where == "point":
        data["entries"][KEY] = [value]
    else:
        point[where] = value
    tmp = tmp_path_factory.mktemp("fuzz")
    caught = _use(tmp, monkeypatch, json.dumps(data))
    assert len(caught) <= 1
