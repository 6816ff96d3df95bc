"""`attnkit bench` harness and measured dispatch, on tiny sizes (no timing is asserted)."""

from __future__ import annotations

import json

import pytest
import torch

import attnkit
from attnkit import calibration
from attnkit.bench import BenchConfig, build_calibration, run_sweep
from attnkit.cli.main import main

TINY = ["--lengths", "16,32", "--heads", "2", "--head-dim", "8", "--window", "8", "--min-run-time", "0.001",
        "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny sweep through the CLI, shared by the schema and output tests."""
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", *TINY, "--backends", "naive,sdpa,tiled,linear,auto", "--masks", "none,causal,window,bigbird,padding",
                 "--out", str(out)])
    assert code == 0
    return out, json.loads((out / "results.json").read_text())


def test_json_schema(tiny_run):
    _, results = tiny_run
    assert results["schema"] == "attnkit.bench/1"
    assert {"torch", "device", "cpu_count"} <= set(results["machine"])
    assert results["matmul_peak_gflops"]["float32"] > 0
    assert results["memory_method"]
    statuses = {r["status"] for r in results["results"]}
    assert statuses <= {"ok", "skipped", "error"} and "ok" in statuses
    assert not [r for r in results["results"] if r["status"] == "error"]
    for r in results["results"]:
        assert {"backend", "n", "mask", "dtype", "passes"} <= set(r)
        if r["status"] == "ok":
            assert r["median_s"] > 0 and r["iqr_s"] >= 0 and r["runs"] >= 1
            assert r["gflops"] > 0 and r["pct_of_matmul_peak"] > 0
            assert r["peak_bytes"] is None or r["peak_bytes"] >= 0
            assert r["error_kind"] == ("max abs" if r["exact"] else "relative")
            if r["exact"]:
                assert r["error"] < 1e-4, r  # exact backends agree with the float64 reference
        else:
            assert r["reason"]
    # both passes, every mask, and auto records what it chose
    ok = [r for r in results["results"] if r["status"] == "ok"]
    assert {r["passes"] for r in ok} == {"forward", "train"}
    assert {r["mask"] for r in ok} == {"none", "causal", "window", "bigbird", "padding"}
    assert all(r["chosen"] in attnkit.list_backends() for r in ok if r["backend"] == "auto")
    # an unsupported combination is skipped with the backend's own reason
    linear_window = [r for r in results["results"] if r["backend"] == "linear" and r["mask"] == "window"]
    assert linear_window and all(r["status"] == "skipped" and "SlidingWindow" in r["reason"] for r in linear_window)


def test_outputs_written(tiny_run):
    out, results = tiny_run
    pytest.importorskip("matplotlib")
    for name in ("time_vs_length.png", "memory_vs_length.png", "error_vs_speed.png"):
        assert (out / name).stat().st_size > 1000
        assert f"]({name})" in (out / "report.md").read_text()
    report = (out / "report.md").read_text()
    assert "crossovers" in report and "The seeds' claims" in report and "results.json" in report
    claims = results["claims"]
    scaled = {r["d_k"]: r for r in claims["scaling"] if r["scaled"]}
    unscaled = {r["d_k"]: r for r in claims["scaling"] if not r["scaled"]}
    assert 0.5 < scaled[1024]["score_var"] < 2 and unscaled[1024]["score_var"] > 500  # the claim itself
    assert unscaled[1024]["saturated_rows"] > 0.3 and scaled[1024]["saturated_rows"] == 0
    assert unscaled[1024]["median_softmax_jacobian"] < scaled[1024]["median_softmax_jacobian"] / 10


def test_skip_by_memory_budget(tmp_path):
    config = BenchConfig(backends=["naive"], lengths=[64], masks=["none"], passes=["forward"], heads=2, head_dim=8,
                         memory_budget_bytes=1024, min_run_time=0.001)
    rows = run_sweep(config)["results"]
    assert [r["status"] for r in rows] == ["skipped"]
    assert "predicted memory" in rows[0]["reason"] and rows[0]["memory_estimate_bytes"] > 1024


def test_skip_by_time_budget():
    config = BenchConfig(backends=["naive"], lengths=[16, 64], masks=["none"], passes=["forward"], heads=2, head_dim=8,
                         time_budget_s=0.0, min_run_time=0.001)
    rows = run_sweep(config)["results"]
    assert [r["status"] for r in rows] == ["ok", "skipped"]  # the first length is measured, then extrapolated
    assert "predicted" in rows[1]["reason"] and "budget" in rows[1]["reason"]


def _qkv(n=64):
    return torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)


def test_no_calibration_uses_defaults_and_info_says_so(capsys):
    q, k, v = _qkv()
    explanation = attnkit.explain(q, k, v)
    assert explanation.chosen == "sdpa"
    assert "built-in defaults" in explanation.measured
    assert main(["info"]) == 0
    assert "built-in defaults" in capsys.readouterr().out


def test_calibration_changes_auto_and_info_explains(tmp_path, monkeypatch, capsys):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    calibration.reload()
    entries = {calibration.entry_key("cpu", "float32", "none", "forward"): [
        {"n": 32, "order": ["sdpa", "naive"], "times": {"sdpa": 1e-4, "naive": 2e-4}},
        {"n": 128, "order": ["naive", "sdpa"], "times": {"naive": 1e-3, "sdpa": 1.8e-3}},
    ]}
    calibration.save({"entries": entries, "command": "test"})
    short, long_ = _qkv(16), _qkv(256)
    assert attnkit.explain(*short).chosen == "sdpa"
    explanation = attnkit.explain(*long_)
    assert explanation.chosen == "naive"  # the measured table beats the built-in rule (sdpa first)
    assert "measured on this machine: naive 1.80x faster than sdpa at n=128" in str(explanation)
    with torch.no_grad():
        out = attnkit.attention(*long_)
    torch.testing.assert_close(out, attnkit.attention(*long_, backend="sdpa"), atol=1e-5, rtol=1e-5)
    # kinds without an entry keep the defaults, and say so
    assert "no entry" in attnkit.explain(*long_, mask=attnkit.Causal()).measured
    assert main(["info", "--shape", "1,2,256,8"]) == 0
    out = capsys.readouterr().out
    assert "measured on this machine (1 device/dtype/mask/pass entries" in out
    assert "chosen: naive" in out and "naive 1.80x faster than sdpa" in out


def test_calibrate_command_writes_table(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    calibration.reload()
    code = main(["bench", *TINY, "--calibrate", "--backends", "naive,sdpa", "--masks", "none,causal",
                 "--dtypes", "float32", "--passes", "forward", "--no-claims", "--no-plots", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads(path.read_text())
    assert set(data["entries"]) == {"cpu|float32|none|forward", "cpu|float32|Causal|forward"}
    for points in data["entries"].values():
        assert [p["n"] for p in points] == [16, 32]
        assert all(sorted(p["order"]) == ["naive", "sdpa"] for p in points)
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["auto_verification"]) == 4
    # auto now follows the measured order at each point
    for point in data["entries"]["cpu|float32|none|forward"]:
        q, k, v = _qkv(point["n"])
        assert attnkit.explain(q, k, v).chosen == point["order"][0]


def test_build_calibration_pools_block_sparse_patterns():
    results = {
        "config": {**BenchConfig().__dict__, "device": "cpu"},
        "machine": {},
        "results": [
            {"status": "ok", "backend": b, "exact": True, "n": 256, "mask": m, "dtype": "float32", "passes": "forward",
             "median_s": t}
            for b, m, t in [("sdpa", "bigbird", 1.0), ("block_sparse", "bigbird", 0.5),
                            ("sdpa", "longformer", 1.0), ("block_sparse", "longformer", 2.0), ("linear", "bigbird", 0.1)]
        ],
    }
    results["results"][-1]["exact"] = False
    table = build_calibration(results)["entries"]
    (point,) = table["cpu|float32|BlockSparse|forward"]
    assert point["order"] == ["sdpa", "block_sparse"]  # 2.0 s vs 2.5 s summed; approximate ones never ranked
