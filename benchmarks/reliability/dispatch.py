"""Reliability probes of dispatch: the measured table, ``explain()``, ``use_backend`` and ``autotune``.

A table from ``python -m attnkit bench`` ranks square problems (``Tq == Tk``): ``auto`` follows it
there and nowhere else, and ``explain()`` must say what ``auto`` really does (a decoding step's
policy line never quotes a table row the rule did not read). A table file of any content never
breaks a call or changes its result. Bad names and flags are refused naming the argument.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings

import probe_reliability as pr
import torch

import attnkit
from attnkit.dispatch import select, table
from attnkit.inputs import AttentionInputs


@contextlib.contextmanager
def _table_file(content: str | None = None, *, heads=2, head_dim=8, n=32, order=("tiled", "sdpa")):
    """ATTNKIT_CALIBRATION pointed at a table of this machine ranking ``order`` at ``n`` (or at a file
    holding ``content``), read; the previous setting restored and read again on exit."""
    before = os.environ.get("ATTNKIT_CALIBRATION")
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = os.path.join(folder, "calibration.json")
        os.environ["ATTNKIT_CALIBRATION"] = path
        try:
            if content is None:
                key = table.entry_key("cpu", "float32", "none", "forward", heads=heads, head_dim=head_dim)
                times = {b: 1e-4 * (i + 1) for i, b in enumerate(order)}
                table.save({"entries": {key: [{"n": n, "order": list(order), "times": times}]}})
            else:
                with open(path, "w") as f:
                    f.write(content)
                table.reload()
            yield
        finally:
            if before is None:
                os.environ.pop("ATTNKIT_CALIBRATION", None)
            else:
                os.environ["ATTNKIT_CALIBRATION"] = before
            table.reload()


def _inputs(Tq, Tk, H=2, D=8, Hkv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, Tq, D, generator=g), torch.randn(1, Hkv or H, Tk, D, generator=g),
            torch.randn(1, Hkv or H, Tk, D, generator=g))


def v_decode_policy(Tq, Tk, H=2, D=8, n=32):
    """A table row at the length sqrt(Tq * Tk) maps to: a decoding step neither follows it nor is
    explained by it; explain's pick is the backend selection runs."""
    def run():
        with _table_file(heads=H, head_dim=D, n=n):
            q, k, v = _inputs(Tq, Tk, H, D)
            e = attnkit.explain(q, k, v)
            picked = select(AttentionInputs.create(q, k, v)).name
            return e.chosen == picked != "tiled" and "measured on this machine" not in e.measured
    return run


def v_table_followed(T, H=2, D=8, n=32):
    """A square call near the table's point runs the table's leader, explains it by the table's
    figures, and gives the reference's result."""
    def run():
        with _table_file(heads=H, head_dim=D, n=n):
            q, k, v = _inputs(T, T, H, D)
            e = attnkit.explain(q, k, v)
            out = attnkit.attention(q, k, v)
            return (e.chosen == "tiled" and e.measured.startswith("measured on this machine: tiled")
                    and pr.close(out, pr.reference(q, k, v)))
    return run


def v_any_file_any_call(content, Tq=24, Tk=24):
    """A table file of any content: the call runs, right, and explain names what runs."""
    def run():
        with _table_file(content):
            q, k, v = _inputs(Tq, Tk)
            e = attnkit.explain(q, k, v, mask=attnkit.Causal())
            out = attnkit.attention(q, k, v, mask=attnkit.Causal())
            keep = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
            return e.chosen == select(AttentionInputs.create(q, k, v, mask=attnkit.Causal())).name and pr.close(
                out, pr.reference(q, k, v, keep))
    return run


def r_use_backend(*names):
    def run():
        with attnkit.use_backend(*names):
            pass
    return run


def r_attention_backend(name):
    return lambda: attnkit.attention(*pr.qkv(), backend=name)


_GOOD_POINT = {"n": 32, "order": ["tiled", "sdpa"], "times": {"tiled": 1e-4, "sdpa": 2e-4}}
_KEY = "cpu|float32|Causal|forward|H2|D8"

PROBES = [
    # a decoding step with a table row at sqrt(Tq * Tk): fixed at (1, 1024); the others are extra shapes
    ("decode step 1x1024 with a table row at n=32", "value", v_decode_policy(1, 1024), None),
    ("decode step 16x64 with a table row at n=32", "value", v_decode_policy(16, 64), None),
    ("decode step 4x256, H4 D16, table row at n=32", "value", v_decode_policy(4, 256, 4, 16), None),
    ("decode step 8x8 with a table row at n=8", "value", v_decode_policy(8, 8, n=8), None),
    # the table is followed for square calls near its point, with the reference's result
    ("square T=32 follows the table", "value", v_table_followed(32), None),
    ("square T=40 H4 D16 follows the table at n=48", "value", v_table_followed(40, 4, 16, 48), None),
    ("square T=17 (just past a decode step) follows the table", "value", v_table_followed(17), None),
    # table files of any content never break a call
    ("empty table file", "value", v_any_file_any_call(""), None),
    ("table file of deep nesting", "value", v_any_file_any_call("[" * 100_000), None),
    ("table of an older version", "value", v_any_file_any_call(json.dumps(
        {"version": 2, "machine_id": {}, "entries": {_KEY: [_GOOD_POINT]}})), None),
    ("table from another machine", "value", v_any_file_any_call(json.dumps(
        {"version": 3, "machine_id": {"cpu": "Another CPU 9000"}, "entries": {_KEY: [_GOOD_POINT]}})), None),
    ("table with an unknown backend first", "value", v_any_file_any_call(json.dumps(
        {"version": 3, "machine_id": None, "entries": {_KEY: [dict(_GOOD_POINT, order=["warp", "sdpa"])]}})), None),
    ("table with a huge n", "value", v_any_file_any_call(json.dumps(
        {"version": 3, "machine_id": {}, "entries": {_KEY: [dict(_GOOD_POINT, n=10**400)]}})), None),
    ("decode step 3x40 under a causal mask, table file empty", "value", v_any_file_any_call("", 3, 40), None),
    # bad names and flags
    ("use_backend of an unknown name", "reject", r_use_backend("fastest"), "fastest"),
    ("use_backend of nothing", "reject", r_use_backend(), "use_backend"),
    ("use_backend of a non-string", "reject", r_use_backend(3), "backend"),
    ("attention(backend=...) unknown", "reject", r_attention_backend("fastest"), "backend"),
    ("autotune('yes')", "reject", lambda: attnkit.autotune("yes"), "autotune"),
]
