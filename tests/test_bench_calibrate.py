"""The main job calibrates: `python -m attnkit bench` writes this machine's table by default (tiny
grids here: no timing is asserted, and no test depends on which backend wins on this machine). Only
points an interleaved timing confirmed are written."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import attnkit
from attnkit.bench import BenchConfig, build_calibration
from attnkit.cli.main import main
from attnkit.dispatch import select, table as calibration
from attnkit.inputs import AttentionInputs

TINY = ["--lengths", "16,32", "--heads", "2", "--head-dim", "8", "--window", "8", "--min-run-time", "0.001",
        "--no-progress", "--no-claims", "--no-plots", "--masks", "none,causal", "--passes", "forward",
        "--dtypes", "float32"]
KEY = "cpu|float32|none|forward|H2|D8"


@pytest.fixture
def table_path(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "calibration.json"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    calibration.reload()
    yield path
    calibration.reload()


@pytest.fixture
def confirm_at_32(monkeypatch):
    """The bench's interleaved timing of ties, replaced: at n=32 it confirms a leader other than the static
    rule's pick (1.5x; the rule's pick last), and leaves the points at n=16 ties, as a timing within the margin
    would."""
    from attnkit.cli import bench

    def resolve(table, results, config, budget_s=None):
        entries = {key: [dict(p) for p in points] for key, points in table["entries"].items()}
        for point in (p for points in entries.values() for p in points if p["n"] == 32 and p.get("tie")):
            del point["tie"]
            point["order"] = [b for b in point["order"] if b != point["rule"]] + [point["rule"]]
            point["interleaved"] = {"ratio": 1.5, "rounds": 5}
        return {**table, "entries": entries}

    monkeypatch.setattr(bench, "resolve_ties", resolve)


def _auto_pick(order: list[str]) -> str:
    """The backend auto runs for a point of the table ranked ``order`` (naive is always tried last)."""
    return next(b for b in order if b != "naive")


def test_the_default_run_writes_only_confirmed_points_and_reports_auto_before_and_after(
        table_path, tmp_path, capsys, confirm_at_32):
    assert main(["bench", *TINY, "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "cases" in err and "estimated" in err  # said before it starts
    data = json.loads(table_path.read_text())
    assert set(data["entries"]) == {KEY, "cpu|float32|Causal|forward|H2|D8"}
    exact = {n for n, impl in attnkit.list_backends().items() if impl.exact and not impl.compiles}
    for points in data["entries"].values():
        # n=32 confirmed; n=16 written only where the verification of auto's picks confirmed another leader
        assert 32 in [p["n"] for p in points] and {p["n"] for p in points} <= {16, 32}
        assert all(set(p["order"]) <= exact and len(p["order"]) >= 2 for p in points)
        assert all("tie" not in p and p["interleaved"]["ratio"] > 1 for p in points)
    written = sum(len(points) for points in data["entries"].values())
    assert f"calibration: {written} points confirmed by an interleaved timing in 2 entries written to {table_path}" \
        in out and f"({4 - written} not written: unconfirmed, or the static rule's pick already" in out
    assert "auto/best before calibration" in out and "auto/best after calibration" in out
    assert f"auto: table at {table_path}: {written} points" in out
    x = torch.randn(1, 2, 32, 8)
    (point,) = [p for p in data["entries"][KEY] if p["n"] == 32]
    assert attnkit.explain(x, x, x).chosen == _auto_pick(point["order"])
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    verified = results["auto_verification"]
    assert len(verified) == 4
    before = results["auto_before_verification"]  # the sweep's picks, measured as the ones after
    assert len(before) == 4 and all("auto_over_best_sweep" in v for v in before)
    sweep = {(r["n"], r["mask"]): r for r in results["results"] if r["backend"] == "auto"}
    assert [v["auto_chose"] for v in before] == [sweep[v["n"], v["mask"]]["chosen"] for v in before]
    for v in verified + before:  # a pick is never timed against itself
        assert (v["auto_chose"] == v["best"]) == (not v["timed"]) and (v["timed"] or v["auto_over_best"] == 1.0)
    assert "auto/best in the sweep itself" in out and "by construction" in out
    assert not {r["backend"] for r in results["results"]} - exact - {"auto"}  # approximate ones only when named


CONFIG = BenchConfig(heads=2, head_dim=8, lengths=[32], masks=["none"], passes=["forward"], min_run_time=0.001)
#: What auto picks at the verifications' point (n=32, no mask) by the static rule, without a table.
PICK = select(AttentionInputs.create(*(torch.randn(1, 2, 32, 8) for _ in range(3)))).name


def test_verification_past_its_budget_takes_the_sweeps_times(table_path):
    from attnkit.bench.runner import verify_auto

    assert PICK != "tiled"  # a fused kernel
    rows = [{"status": "ok", "backend": b, "exact": True, "n": 32, "mask": "none", "dtype": "float32",
             "passes": "forward", "median_s": t} for b, t in (("tiled", 1.0), (PICK, 2.0))]
    (point,) = verify_auto({"results": rows}, CONFIG, budget_s=0.0)  # auto's pick here: 2x the best
    assert point["auto_chose"] == PICK and point["auto_over_best"] == 2.0 and not point["timed"]


def _swept(auto: str | None, auto_s: float = 1.3) -> dict:
    """A sweep's results at one point: tiled the best (1 s), PICK 2 s, and auto's row (its pick, time)."""
    rows = [{"status": "ok", "backend": b, "exact": True, "n": 32, "mask": "none", "dtype": "float32",
             "passes": "forward", "median_s": t, "chosen": b} for b, t in (("tiled", 1.0), (PICK, 2.0))]
    if auto:
        rows.append({**rows[0], "backend": "auto", "chosen": auto, "median_s": auto_s})
    # a second point the sweep ran auto at no exact backend for, and one without auto's row
    rows.append({**rows[0], "backend": "auto", "n": 64})
    rows.append({**rows[0], "mask": "causal"})
    return {"results": rows}


@pytest.fixture
def calls(monkeypatch):
    """The backend names the verification times, in order."""
    from attnkit.bench import runner

    names: list[str] = []
    real = runner._call
    monkeypatch.setattr(runner, "_call", lambda *a: names.append(a[4]) or real(*a))
    return names


def test_the_sweeps_pick_when_it_is_the_best_is_one_by_construction(table_path, calls):
    from attnkit.bench.runner import verify_auto_before

    (point,) = verify_auto_before(_swept("tiled"), CONFIG)  # auto's row 1.3x tiled's own: noise
    assert point["auto_chose"] == point["best"] == "tiled" and point["auto_over_best"] == 1.0 and not point["timed"]
    assert point["auto_over_best_sweep"] == 1.3 and not calls  # nothing timed; the sweep's figure kept


def test_the_sweeps_other_pick_is_timed_by_name_against_the_best(table_path, calls):
    from attnkit.bench.runner import verify_auto, verify_auto_before

    (point,) = verify_auto_before(_swept(PICK, 2.5), CONFIG)
    assert point["auto_chose"] == PICK and point["timed"] and point["auto_over_best_sweep"] == 2.5
    assert calls == [PICK, "tiled"] and point["auto_over_best"] > 0  # forced by name: auto may pick another now
    calls.clear()
    dense = {"results": [r for r in _swept(PICK)["results"] if r["mask"] == "none"]}
    (after,) = verify_auto(dense, CONFIG)  # auto picks PICK here now too: timed as auto
    assert calls == ["auto", "tiled"] and after["auto_chose"] == PICK and after["timed"]
    # the same pick timed for the other column is not timed again: one backend, one figure
    calls.clear()
    (point,) = verify_auto_before(_swept(PICK, 2.5), CONFIG, known=[dict(after, auto_over_best=1.7)])
    assert point["auto_over_best"] == 1.7 and point["timed"] and point["from_known"] and not calls
    # past the budget: the sweep's own figure for auto's row, marked untimed
    (point,) = verify_auto_before(_swept(PICK, 2.5), CONFIG, budget_s=0.0)
    assert point["auto_over_best"] == 2.5 and not point["timed"] and not calls
    assert verify_auto_before(_swept(None), CONFIG) == []  # no auto row at the point: no before figure


def test_measuring_only_leaves_the_table_alone(table_path, tmp_path, capsys):
    assert main(["bench", *TINY, "--no-calibrate", "--out", str(tmp_path)]) == 0
    assert not table_path.exists()
    results = json.loads((tmp_path / "results.json").read_text())
    assert "auto_verification" not in results and len(results["auto_before_verification"]) == 4
    out = capsys.readouterr().out
    assert "auto/best (no calibration in this run)" in out and "auto/best after" not in out
    assert main(["bench", *TINY, "--backends", "naive,sdpa,auto", "--out", str(tmp_path)]) == 0
    assert not table_path.exists()  # some backends only: a table from them would rank the rest last
    assert "written to" not in capsys.readouterr().out


def test_a_run_adds_to_this_machines_table_and_replaces_a_foreign_or_corrupt_one(table_path, tmp_path, confirm_at_32):
    other = calibration.entry_key("cpu", "float32", "none", "forward", heads=3, head_dim=8)
    point = {"n": 64, "order": ["sdpa", "naive"], "times": {"sdpa": 1e-4, "naive": 2e-4}}
    calibration.save({"entries": {other: [point]}})
    assert main(["bench", *TINY, "--out", str(tmp_path)]) == 0
    assert set(json.loads(table_path.read_text())["entries"]) == {other, KEY, "cpu|float32|Causal|forward|H2|D8"}
    for damage in ("{ not json", json.dumps({**json.loads(table_path.read_text()),
                                             "machine_id": {"cpu": "Another CPU 9000"}})):
        table_path.write_text(damage)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            calibration.reload()
            assert main(["bench", *TINY, "--out", str(tmp_path)]) == 0
        said = [str(w.message) for w in caught if "calibration" in str(w.message)]
        assert len(said) == 1 and "ignoring" in said[0]  # once, when read; auto ran without it until the new one
        data = calibration.load()
        assert data is not None and other not in data["entries"] and KEY in data["entries"]


def test_the_run_budget_cuts_the_longest_lengths_first(table_path, tmp_path):
    config = BenchConfig(backends=["naive", "sdpa"], lengths=[32, 16], masks=["none"], passes=["forward"], heads=2,
                         head_dim=8, min_run_time=0.001, run_budget_s=1e-9)
    from attnkit.bench import run_sweep

    rows = run_sweep(config)["results"]
    assert [r["n"] for r in rows] == [16, 16, 32, 32]
    assert all(r["status"] == "skipped" and "--budget" in r["reason"] for r in rows)
    with pytest.raises(ValueError, match="--budget"):
        BenchConfig(run_budget_s=float("nan"))


def _results(rows):
    return {"config": {**BenchConfig(heads=2, head_dim=8).__dict__, "device": "cpu"}, "machine": {},
            "results": [{"status": "ok", "backend": b, "exact": True, "n": 64, "mask": "none", "dtype": "float32",
                         "passes": "forward", "median_s": t, "iqr_s": iqr, "runs": runs} for b, t, iqr, runs in rows]}


def test_every_ranking_of_two_backends_waits_for_an_interleaved_timing_whatever_the_sweeps_margin():
    from attnkit.bench.runner import confirmed

    noisy = [("sdpa", 1.0, 0.0, 1), ("naive", 1.03, 0.0, 1), ("tiled", 5.0, 0.5, 20), ("block_sparse", 6.0, 0.6, 20)]
    for rows in (noisy,  # 3% apart, single runs: within the sweep's noise
                 [("sdpa", 1.0, 0.0, 1), ("naive", 1.3, 0.0, 1)] + noisy[2:],  # 30% apart
                 [("sdpa", 1.0, 0.01, 100), ("naive", 3.0, 0.01, 100)]):  # well timed, 3x apart
        (point,) = build_calibration(_results(rows))["entries"][KEY]
        assert point["order"][0] == "sdpa" and point["tie"]
        assert confirmed(build_calibration(_results(rows)))["entries"] == {}  # unconfirmed: not written
    (point,) = build_calibration(_results([("sdpa", 1.0, 0.0, 1)]))["entries"][KEY]  # one backend: nothing to rank
    assert "tie" not in point and confirmed({"entries": {KEY: [point]}})["entries"] == {}  # the rule's pick unmeasured


def test_confirmed_drops_the_ties_and_the_entries_they_empty_and_leaves_its_argument_alone():
    from attnkit.bench.runner import confirmed

    sure = {"n": 32, "order": ["sdpa", "tiled"], "times": {"sdpa": 1.0, "tiled": 2.0},
            "interleaved": {"ratio": 1.9, "rounds": 5}, "rule": "tiled"}
    tie = {"n": 64, "order": ["sdpa", "tiled"], "times": {"sdpa": 1.0, "tiled": 1.01}, "tie": True,
           "interleaved": {"ratio": 1.004, "rounds": 5}, "rule": "tiled"}
    other = "cpu|float32|Causal|forward|H2|D8"
    table = {"machine": {}, "entries": {KEY: [sure, tie], other: [dict(tie)]}}
    kept = confirmed(table)
    assert kept == {"machine": {}, "entries": {KEY: [{k: v for k, v in sure.items() if k != "rule"}]}}
    assert table["entries"][KEY] == [sure, tie] and other in table["entries"]


def test_explain_and_info_after_calibration_name_each_backend_once(table_path, capsys):
    calibration.save({"entries": {KEY: [{"n": 32, "order": ["tiled", "sdpa"],
                                         "times": {"tiled": 1e-5, "sdpa": 3e-5}}]}})
    assert main(["info", "--shape", "1,2,32,8"]) == 0
    out = capsys.readouterr().out
    explained = [line.split(":")[0].strip() for line in out.split("chosen:")[1].splitlines()[1:]
                 if line.startswith("  ") and ":" in line]
    assert explained and len(explained) == len(set(explained)), explained
    assert "chosen: tiled" in out and "None" not in out.split("chosen:")[1]
    assert max(len(line) for line in out.splitlines()) <= 200


def test_the_core_never_imports_rich():
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, torch, attnkit\n"
            "x = torch.randn(1, 2, 8, 4)\n"
            "attnkit.attention(x, x, x, backend='naive'); str(attnkit.explain(x, x, x, backend='sdpa'))\n"
            "print('rich' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert out.stdout.strip() == "False", (out.stdout, out.stderr)


# --- ties timed again, interleaved, before the table is written ---

TIE_CONFIG = BenchConfig(heads=2, head_dim=8, min_run_time=0.001)


def _tied(n=64, mask="none", sdpa_s=1e-4, naive_s=1.03e-4):
    """A sweep where sdpa and naive are 3% apart with one run each: a tie (tiled well behind, well timed)."""
    rows = [("sdpa", sdpa_s, 0.0, 1), ("naive", naive_s, 0.0, 1), ("tiled", 5 * sdpa_s, 0.5 * sdpa_s, 20)]
    return [{"status": "ok", "backend": b, "exact": True, "n": n, "mask": mask, "dtype": "float32",
             "passes": "forward", "median_s": t, "iqr_s": iqr, "runs": runs} for b, t, iqr, runs in rows]


def _sweep(*rows):
    return {"config": {**TIE_CONFIG.__dict__, "device": "cpu"}, "machine": {},
            "results": [r for rs in rows for r in rs]}


@pytest.fixture
def fake_time(monkeypatch):
    """Timings without a clock: each call timed takes the next of ``times`` (cycled) when first
    timed, and keeps it; an interleaved comparison's first round times its calls in the sweep's
    order (later rounds alternate it)."""
    from types import SimpleNamespace

    from attnkit.bench import runner

    times: list[float] = []
    index: dict[int, int] = {}
    held: list = []  # the calls timed, kept alive: their ids stay theirs

    def fake(fn, min_run_time):
        if id(fn) not in index:
            index[id(fn)] = len(index)
            held.append(fn)
        return SimpleNamespace(median=times[index[id(fn)] % len(times)])

    monkeypatch.setattr(runner, "_time", fake)
    return times


@pytest.mark.parametrize("second_over_first, order, tie", [
    (1.005, ["sdpa", "naive"], True),    # within the 1% margin: still a tie
    (1.02, ["sdpa", "naive"], False),    # the sweep's order confirmed
    (1 / 1.02, ["naive", "sdpa"], False),  # the sweep's order was noise: the other one first
])
def test_a_tie_is_resolved_by_the_interleaved_ratio_beyond_the_margin(fake_time, calls, second_over_first, order,
                                                                       tie):
    from attnkit.bench import resolve_ties, runner

    fake_time[:] = [1e-3, second_over_first * 1e-3]
    results = _sweep(_tied())
    table = build_calibration(results)
    assert table["entries"][KEY][0]["tie"]
    resolved = resolve_ties(table, results, TIE_CONFIG)
    (point,) = resolved["entries"][KEY]
    assert point["order"] == [*order, "tiled"] and bool(point.get("tie")) == tie
    assert runner.INTERLEAVED_ROUNDS <= point["interleaved"]["rounds"] <= 3 * runner.INTERLEAVED_ROUNDS
    assert point["interleaved"]["ratio"] == pytest.approx(max(second_over_first, 1 / second_over_first))
    assert calls == ["sdpa", "naive"]  # the two tied backends, on the point's inputs
    assert table["entries"][KEY][0]["tie"] and "interleaved" not in table["entries"][KEY][0]  # not changed


def test_every_backend_within_noise_of_the_leader_is_timed_and_the_fastest_leads(fake_time, calls):
    from attnkit.bench import resolve_ties

    rows = [("sdpa", 1e-4, 0.0, 1), ("naive", 1.03e-4, 0.0, 1), ("tiled", 1.05e-4, 0.0, 1),
            ("block_sparse", 5e-4, 0.5e-4, 20)]  # three within the sweep's 10% noise of each other
    results = _results(rows)
    fake_time[:] = [1e-3, 1e-3, 0.9e-3]  # interleaved, the third of the sweep is the fastest
    (point,) = resolve_ties(build_calibration(results), results, TIE_CONFIG)["entries"][KEY]
    assert sorted(calls) == ["naive", "sdpa", "tiled"]  # the one well behind is not timed
    assert point["order"] == ["tiled", "sdpa", "naive", "block_sparse"] and not point.get("tie")
    assert point["interleaved"]["ratio"] == pytest.approx(1 / 0.9)


def test_a_tie_with_one_backend_measurably_slower_is_resolved_and_auto_follows_it(table_path, monkeypatch):
    import time

    from attnkit.bench import resolve_ties, runner
    from attnkit.bench.runner import confirmed

    real = runner._call

    def slow_sdpa(q, k, v, mask, backend, grad_out):
        fn = real(q, k, v, mask, backend, grad_out)
        return (lambda: time.sleep(0.02) or fn()) if backend == "sdpa" else fn

    monkeypatch.setattr(runner, "_call", slow_sdpa)
    monkeypatch.setattr(runner, "rule_pick", lambda per_mask, config: "sdpa")  # as where native is not built
    rows = [{**row, "backend": {"naive": "tiled", "tiled": "naive"}.get(row["backend"], row["backend"])}
            for row in _tied()]  # the sweep had sdpa 3% ahead of tiled (naive well behind)
    results = _sweep(rows)
    table = resolve_ties(build_calibration(results), results, TIE_CONFIG)
    (point,) = table["entries"][KEY]
    assert point["order"][:2] == ["tiled", "sdpa"] and not point.get("tie") and point["interleaved"]["ratio"] > 1.5
    calibration.save(confirmed(table))
    assert calibration.load() is not None
    x = torch.randn(1, 2, 64, 8)
    explained = attnkit.explain(x, x, x)
    assert explained.chosen == "tiled"  # auto follows the table at a resolved point (the static rule: a fused kernel)
    assert "interleaved" in str(explained) and "tiled" in str(explained)


def test_tie_resolution_keeps_to_its_budget_cheapest_first(fake_time, calls):
    from attnkit.bench import resolve_ties

    fake_time[:] = [1e-3, 1.1e-3]
    results = _sweep(_tied(64), _tied(128, sdpa_s=10.0, naive_s=10.3))
    table = build_calibration(results)
    assert all(p["tie"] for p in table["entries"][KEY])
    untouched = resolve_ties(table, results, TIE_CONFIG, budget_s=0.0)
    assert untouched["entries"] == table["entries"] and not calls  # nothing fits: nothing timed
    # 1 s fits the point at n=64 (a fraction of a millisecond per call), not the one at n=128 (10 s per call)
    cheap, dear = resolve_ties(table, results, TIE_CONFIG, budget_s=1.0)["entries"][KEY]
    assert not cheap.get("tie") and cheap["interleaved"]["ratio"] == pytest.approx(1.1)
    assert dear["tie"] and "interleaved" not in dear and calls == ["sdpa", "naive"]


def test_a_tie_pooling_several_mask_specs_times_them_all(fake_time, calls):
    from attnkit.bench import resolve_ties

    fake_time[:] = [1e-3, 1.1e-3]
    results = _sweep(_tied(256, "bigbird"), _tied(256, "longformer"))
    table = build_calibration(results)
    (key,) = table["entries"]
    assert "BlockSparse" in key and table["entries"][key][0]["tie"]
    (point,) = resolve_ties(table, results, TIE_CONFIG)["entries"][key]
    assert sorted(calls) == ["naive", "naive", "sdpa", "sdpa"] and not point.get("tie")


def test_the_bench_says_how_many_ties_it_resolved(fake_time, capsys):
    from attnkit.cli.bench import _resolve_ties

    fake_time[:] = [1e-3, 1.1e-3]
    results = _sweep(_tied(64), _tied(128, sdpa_s=1e3, naive_s=1.03e3))
    config = BenchConfig(heads=2, head_dim=8, min_run_time=0.001, run_budget_s=240.0)
    table = _resolve_ties(build_calibration(results), results, config)  # the n=128 tie: over its 30 s
    assert sum(bool(p.get("tie")) for p in table["entries"][KEY]) == 1
    out = capsys.readouterr().out
    assert "ties: 1 of 2 resolved" in out and "0 stayed ties" in out and "1 not timed" in out


def test_a_table_with_a_malformed_interleaved_ratio_is_ignored(table_path):
    point = {"n": 32, "order": ["naive", "sdpa"], "times": {"naive": 1e-5, "sdpa": 3e-5},
             "interleaved": {"ratio": 1.04, "rounds": 3}}
    calibration.save({"entries": {KEY: [point]}})
    assert calibration.load() is not None
    with pytest.raises(ValueError, match="interleaved"):
        calibration.save({"entries": {KEY: [{**point, "interleaved": {"ratio": "fast"}}]}})


def test_interleaved_rounds_grow_for_cheap_calls_and_alternate_the_order(monkeypatch):
    from types import SimpleNamespace

    from attnkit.bench import runner

    base = runner.INTERLEAVED_ROUNDS
    assert runner.interleaved_rounds(1.0, base, 0.05) == base  # slow calls: the rounds asked for
    assert runner.interleaved_rounds(1e-3, base, 0.05) == min(3 * base, -(-runner.INTERLEAVED_SECONDS // 0.05))
    assert runner.interleaved_rounds(1e-6, base, 1e-6) == 3 * base  # never more than three times
    order: list[str] = []

    def fake(fn, min_run_time):
        order.append(fn.__name__)
        return SimpleNamespace(median={"a": 1.0, "b": 2.0}[fn.__name__])

    def a():
        pass

    def b():
        pass

    monkeypatch.setattr(runner, "_time", fake)
    per_round = runner._interleaved_times([a, b], base, 10.0)  # blocks of 10 s: the rounds asked for
    assert per_round == [[1.0, 2.0]] * base  # in the order given, whatever order they ran in
    assert order == ["a", "b", "b", "a"] * (base // 2) + ["a", "b"] * (base % 2)


def test_a_pick_timed_faster_than_the_sweeps_best_leads_its_point(monkeypatch):
    """The sweep ranked sdpa 25% ahead of naive, beyond its noise; the interleaved verification of
    the sweep's pick (naive) found naive faster: that point of the table is led by naive, with the
    measured ratio. A verification within the margin, untimed or of a pooled point changes nothing."""
    from attnkit.bench import runner
    from attnkit.bench.runner import confirmed, correct_calibration

    monkeypatch.setattr(runner, "rule_pick", lambda per_mask, config: "sdpa")  # as where native is not built
    rows = [("sdpa", 1.0e-4, 0.0, 20), ("naive", 1.25e-4, 0.0, 20), ("tiled", 5e-4, 0.0, 20)]
    results = _results(rows)
    table = build_calibration(results)
    assert table["entries"][KEY][0]["order"][0] == "sdpa" and table["entries"][KEY][0]["tie"]
    row = {"n": 64, "mask": "none", "dtype": "float32", "passes": "forward", "best": "sdpa", "auto_chose": "naive",
           "timed": True, "rounds": 7}
    fixed, changed = correct_calibration(table, results, [{**row, "auto_over_best": 0.8}])
    (point,) = fixed["entries"][KEY]
    assert changed == 1 and point["order"] == ["naive", "sdpa", "tiled"] and "tie" not in point  # confirmed
    assert point["interleaved"] == {"ratio": pytest.approx(1.25), "rounds": 7}
    assert table["entries"][KEY][0]["order"][0] == "sdpa"  # the table given is left alone
    written = {**confirmed(fixed), "version": calibration.VERSION, "machine_id": {}}
    assert written["entries"] and calibration.problem(written) is None  # dispatch reads it
    for other in ({**row, "auto_over_best": 0.995},  # within the margin: the sweep's order stands
                  {**row, "auto_over_best": 0.8, "timed": False},  # the sweep's own figures: not a measurement
                  {**row, "auto_over_best": 0.8, "dtype": "bfloat16"},  # another point
                  {**row, "auto_over_best": 1.3}):
        assert correct_calibration(table, results, [other])[1] == 0


def test_the_table_keeps_only_confirmed_exceptions_to_the_static_rule():
    from attnkit.bench.runner import confirmed

    point = {"n": 64, "times": {"sdpa": 1.0, "tiled": 2.0}, "interleaved": {"ratio": 2.0, "rounds": 5}}
    table = {"entries": {KEY: [{**point, "order": ["sdpa", "tiled"], "rule": "sdpa"},  # the rule is right: left out
                               {**point, "n": 128, "order": ["tiled", "sdpa"], "rule": "sdpa"},  # an exception
                               {**point, "n": 256, "order": ["tiled", "sdpa"], "rule": "sdpa", "tie": True}]}}
    kept = confirmed(table)["entries"][KEY]
    assert [p["n"] for p in kept] == [128] and "rule" not in kept[0]
