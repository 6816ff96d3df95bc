"""`attnkit bench` harness and measured dispatch, on tiny sizes (no timing is asserted)."""

from __future__ import annotations

import json

import pytest
import torch

import attnkit
from attnkit.bench import BenchConfig, build_calibration, run_sweep
from attnkit.cli.main import main
from attnkit.dispatch import table as calibration
from attnkit.inputs import AttentionInputs

from .test_bench_calibrate import confirm_at_32  # noqa: F401  (a fixture)
from .inputs import qkv

TINY = ["--lengths", "16,32", "--heads", "2", "--head-dim", "8", "--window", "8", "--min-run-time", "0.001",
        "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny sweep through the CLI, shared by the schema and output tests."""
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", *TINY, "--backends", "naive,sdpa,tiled,linear,auto",
                 "--masks", "none,causal,window,bigbird,padding", "--out", str(out)])
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
            assert r["gflops"] > 0
            pct = r["pct_of_matmul_peak"]
            assert (pct is None) if not r["exact"] else (pct is None or 0 < pct <= 100), r
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
    for stem in ("time_vs_length", "memory_vs_length", "error_vs_speed"):  # one PNG, or one per pass and dtype
        pngs = sorted(out.glob(f"{stem}*.png"))
        assert pngs and all(p.stat().st_size > 1000 for p in pngs), stem
        assert all(f"]({p.name})" in (out / "report.md").read_text() for p in pngs)
    report = (out / "report.md").read_text()
    assert "crossovers" in report and "results.json" in report
    assert str(out) not in report and str(out) not in (out / "results.json").read_text()  # no machine paths


def test_skip_by_memory_budget(tmp_path):
    # the inputs fit (32 KiB), naive's scores do not (+64 KiB), sdpa runs
    config = BenchConfig(backends=["naive", "sdpa"], lengths=[64], masks=["none"], passes=["forward"], heads=2,
                         head_dim=8, memory_budget_bytes=40 * 1024, min_run_time=0.001)
    rows = run_sweep(config)["results"]
    assert [r["status"] for r in rows] == ["skipped", "ok"]
    assert "predicted memory" in rows[0]["reason"] and rows[0]["memory_estimate_bytes"] > 40 * 1024


def test_skip_by_time_budget():
    config = BenchConfig(backends=["naive"], lengths=[16, 64], masks=["none"], passes=["forward"], heads=2, head_dim=8,
                         time_budget_s=1e-9, min_run_time=0.001)
    rows = run_sweep(config)["results"]
    assert [r["status"] for r in rows] == ["ok", "skipped"]  # the first length is measured, then extrapolated
    assert "predicted" in rows[1]["reason"] and "budget" in rows[1]["reason"]


def _qkv(n=64):
    return qkv(1, 2, 2, n, n, 8)


def test_without_a_table_the_static_rule_decides_and_info_says_so(capsys):
    q, k, v = _qkv()
    explanation = attnkit.explain(q, k, v)
    assert explanation.chosen == ("native" if attnkit.list_backends()["native"].can_run(
        AttentionInputs.create(q, k, v)) else "sdpa")  # the first fused kernel that can run
    assert explanation.measured.startswith("the static rule") and "no table at" in explanation.measured
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "auto policy: the static rule" in out and "no table" in out


def test_calibration_changes_auto_and_info_explains(tmp_path, monkeypatch, capsys):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    calibration.reload()
    entries = {calibration.entry_key("cpu", "float32", "none", "forward", heads=2, head_dim=8): [
        {"n": 32, "order": ["sdpa", "tiled"], "times": {"sdpa": 1e-4, "tiled": 2e-4}},
        {"n": 128, "order": ["tiled", "sdpa"], "times": {"tiled": 1e-3, "sdpa": 1.8e-3}},
    ]}
    calibration.save({"entries": entries, "command": "test"})
    short, long_ = _qkv(24), _qkv(256)  # 24 queries: past a decoding step's, which the table never ranks
    assert attnkit.explain(*short).chosen == "sdpa"  # the table's leader, before the static order's native
    explanation = attnkit.explain(*long_)
    assert explanation.chosen == "tiled"  # the measured table beats the static rule (fused kernels first)
    assert "measured on this machine: tiled 1.80x faster than sdpa at n=128" in str(explanation)
    with torch.no_grad():
        out = attnkit.attention(*long_)
    torch.testing.assert_close(out, attnkit.attention(*long_, backend="sdpa"), atol=1e-5, rtol=1e-5)
    # kinds without an entry follow the static rule, and say so
    assert attnkit.explain(*long_, mask=attnkit.Causal()).measured.startswith("the static rule")
    assert main(["info", "--shape", "1,2,256,8"]) == 0
    out = capsys.readouterr().out
    assert out.count("policy:") == 1  # said once, by the explanation
    assert "chosen: tiled" in out and "tiled 1.80x faster than sdpa" in out
    assert main(["info"]) == 0
    assert f"table at {path}: 2 points" in capsys.readouterr().out.replace("\n    ", " ")


@pytest.mark.usefixtures("confirm_at_32")
def test_a_subset_sweep_never_overrides_the_rule_with_a_backend_it_did_not_time_against(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(path))
    calibration.reload()
    code = main(["bench", *TINY, "--calibrate", "--backends", "naive,sdpa", "--masks", "none,causal",
                 "--dtypes", "float32", "--passes", "forward", "--no-claims", "--no-plots", "--out", str(tmp_path)])
    assert code == 0
    # A row is written only where a confirmed leader beats the static rule's pick timed beside it. With the
    # native kernel built the rule picks native, which this sweep did not time: no row. Without it the rule
    # picks sdpa, and a row may say naive was confirmed faster at these tiny sizes, never sdpa itself.
    from attnkit.dispatch import rule

    data = json.loads(path.read_text()) if path.exists() else {"entries": {}}
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["auto_verification"]) == 4
    q, k, v = _qkv(32)
    pick = next(b for b in rule.builtin_order(attnkit.inputs.AttentionInputs.create(q, k, v))
                if attnkit.list_backends()[b].can_run(attnkit.inputs.AttentionInputs.create(q, k, v)))
    points = [p for ps in data["entries"].values() for p in ps]
    assert all(p["order"][0] != pick and pick in p["times"] and "interleaved" in p for p in points)
    if pick not in ("naive", "sdpa"):
        assert points == [] and "static rule" in attnkit.explain(q, k, v).measured


def test_build_calibration_pools_block_sparse_patterns():
    results = {
        "config": {**BenchConfig().__dict__, "device": "cpu"},
        "machine": {},
        "results": [
            {"status": "ok", "backend": b, "exact": True, "n": 256, "mask": m, "dtype": "float32", "passes": "forward",
             "median_s": t}
            for b, m, t in [("sdpa", "bigbird", 1.0), ("block_sparse", "bigbird", 0.5),
                            ("sdpa", "longformer", 1.0), ("block_sparse", "longformer", 2.0),
                            ("linear", "bigbird", 0.1)]
        ],
    }
    results["results"][-1]["exact"] = False
    table = build_calibration(results)["entries"]
    (point,) = table["cpu|float32|BlockSparse|forward|H8|D64"]
    assert point["order"] == ["sdpa", "block_sparse"]  # 2.0 s vs 2.5 s summed; approximate ones never ranked


# --- flags and configuration: every bad value refused before any work, one line, exit status 2 ---

BAD_FLAGS = [
    (["--min-run-time", "nan"], "--min-run-time"),
    (["--min-run-time", "0"], "--min-run-time"),
    (["--time-budget", "-1"], "--time-budget"),
    (["--time-budget", "inf"], "--time-budget"),
    (["--memory-budget", "nan"], "--memory-budget"),
    (["--memory-budget", "-2"], "--memory-budget"),
    (["--lengths", "1e8"], "--lengths"),
    (["--lengths", "100000000"], "--lengths 100000000"),
    (["--lengths", "0,16"], "--lengths"),
    (["--heads", "0"], "--heads"),
    (["--batch", "-1"], "--batch"),
    (["--head-dim", "0"], "--head-dim"),
    (["--window", "0"], "--window"),
    (["--backends", "nope"], "unknown backend 'nope'"),
    (["--masks", "bogus"], "--masks"),
    (["--dtypes", "int8"], "--dtypes"),
    (["--out", __file__], "is not a directory"),
]


@pytest.mark.parametrize("flags, named", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_error_before_work(flags, named, tmp_path, capsys):
    out = tmp_path / "never"
    try:
        code = main(["bench", "--out", str(out), *flags, "--no-progress"])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert named in err[-1] and err[-1].startswith("attnkit bench: error:"), err
    assert "Traceback" not in "\n".join(err)
    assert not out.exists()  # refused before anything was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clean_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--device", "cuda"])
    assert exc.value.code == 2
    assert "cuda is not available on this machine" in capsys.readouterr().err


def test_config_refuses_values_that_would_hang_or_not_fit():
    for bad in (dict(min_run_time=float("nan")), dict(time_budget_s=-1.0), dict(memory_budget_bytes=0),
                dict(lengths=[]), dict(lengths=[16, 0]), dict(heads=True), dict(passes=["fwd"])):
        with pytest.raises(ValueError):
            BenchConfig(**bad)
    with pytest.raises(ValueError, match="inputs alone"):
        BenchConfig(lengths=[10**8])
    BenchConfig(lengths=[16], min_run_time=0.001)  # a good one passes


def test_help_shows_budgets(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default 0.25 s)" in text and "(default 4 GiB)" in text and "(default 0.05 s)" in text


def test_missing_plot_extra_is_refused_before_work(tmp_path, monkeypatch, capsys):
    from attnkit.cli import bench as bench_cli

    monkeypatch.setattr(bench_cli, "missing_extra", lambda: "plots need matplotlib: pip install 'attnkit[bench]'")
    out = tmp_path / "never"
    assert main(["bench", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "attnkit[bench]" in err and "--no-plots" in err and not out.exists()


# --- the terminal table and the report ---

def _row(**kw):
    row = {"backend": "sdpa", "n": 1024, "mask": "none", "dtype": "float32", "passes": "forward", "status": "ok",
           "chosen": "sdpa", "exact": True, "median_s": 0.0123, "iqr_s": 0.0, "runs": 1, "peak_bytes": 3 * 2**20,
           "gflops": 12.5, "pct_of_matmul_peak": 40.0, "error": 1e-7}
    return {**row, **kw}


def test_table_counts_runs_hides_meaningless_spread_and_aligns_numbers():
    from attnkit.bench.report import terminal_table

    rows = [_row(), _row(backend="linear", chosen="linear", exact=False, pct_of_matmul_peak=None, runs=7, iqr_s=0.002),
            _row(backend="tiled", n=64, median_s=1.5)]
    lines = terminal_table({"results": rows}).splitlines()
    header = lines[0]
    sdpa, linear, tiled = lines[2], lines[3], lines[4]
    spread = header.index("IQR ms") + len("IQR ms")
    assert sdpa[spread - 1] == "-" and linear[spread - 3:spread] == "  2"  # IQR only from 4 timed runs
    assert "runs" in header
    peak_end = header.index("% peak") + len("% peak")
    assert linear[peak_end - 1] == "-" and sdpa[peak_end - 3:peak_end] == "40%"  # no % peak for approximations
    n_end = header.index(" n ") + 2
    assert tiled[n_end - 2:n_end] == "64" and sdpa[n_end - 4:n_end] == "1024"  # right-aligned


def test_skipped_reasons_are_never_cut_and_hint_names_the_flag():
    from attnkit.bench.report import skip_hint, terminal_table

    reason = "needs a banded mask: " + "x" * 200 + " END"
    rows = [_row(), {**_row(backend="sliding_window"), "status": "skipped", "reason": reason, "group": reason}]
    rows += [{**_row(n=4096 * i), "status": "skipped", "reason": "predicted 3 s per call > budget 0.25 s",
              "group": "predicted time over budget", "predicted_s": 3.0} for i in (2, 3, 4)]
    results = {"results": rows, "config": {"time_budget_s": 0.25, "memory_budget_bytes": 4 * 2**30}}
    table = terminal_table(results, group_skips=True)  # wrapped to the terminal, never cut
    assert reason.replace(" ", "") in "".join(table.split())
    hint = skip_hint(results)
    assert hint and "4 of 5 cases were skipped" in hint and "--time-budget 3" in hint
    assert skip_hint({**results, "results": rows[:1]}) is None  # nothing skipped: no hint


def test_pct_of_peak_only_where_meaningful():
    from attnkit.bench.runner import pct_of_peak

    assert pct_of_peak(50.0, 100.0, True) == 50.0
    assert pct_of_peak(50.0, 100.0, False) is None  # approximate: not the FLOPs it is credited with
    assert pct_of_peak(150.0, 100.0, True) is None  # above the measured peak: that peak is no ceiling


def test_recorded_command_has_no_output_path():
    from attnkit.bench.report import command_line

    argv = ["--lengths", "16", "--out", "/some/dir", "--out=/x", "--no-plots"]
    assert command_line("attnkit bench", argv) == "attnkit bench --lengths 16 --no-plots"


# --- plots ---

def test_plot_style_is_fixed_per_backend_and_marks_approximations():
    from attnkit.bench.plots import style

    assert style("sdpa") == style("sdpa") and style("sdpa")["linestyle"] == "-"
    assert style("linear")["linestyle"] == "--" and style("auto")["linestyle"] == ":"
    colors = {style(name)["color"] for name in attnkit.list_backends()}
    assert len(colors) == len(attnkit.list_backends())  # every registered backend has its own colour
    assert style("some_new_backend") == style("some_new_backend")  # stable without a table entry


def test_plots_skip_single_point_panels(tmp_path):
    pytest.importorskip("matplotlib")
    from attnkit.bench.plots import write_plots

    one_length = {"results": [_row(), _row(backend="naive", chosen="naive")], "memory_method": "none"}
    assert write_plots(one_length, tmp_path) == []  # no curve anywhere: no plot at all
    two = {"results": one_length["results"] + [_row(n=2048, median_s=0.05)], "memory_method": "none"}
    made = write_plots(two, tmp_path)
    assert [p.name for p in made] == ["time_vs_length.png", "memory_vs_length.png"]


def test_markdown_table_escapes_pipes_in_reasons():
    from attnkit.bench.report import terminal_table

    row = {**_row(backend="sliding_window"), "status": "skipped", "reason": "needs a band | GlobalTokens(...)"}
    md = terminal_table({"results": [_row(), row]}, markdown=True).splitlines()
    skipped = md[-1]
    assert skipped.count(" | ") == 5 and "band \\| GlobalTokens" in skipped  # six cells, the pipe escaped


def test_recommendations_say_what_to_use_and_whether_calibrated(tmp_path, monkeypatch):
    from attnkit.bench.report import calibration_status, recommendation, recommendations

    good = {"n": 300, "mask": "window", "dtype": "bfloat16", "passes": "train", "best": "native",
            "auto_chose": "native", "auto_over_best": 1.0}
    slow = dict(good, best="sliding_window", auto_over_best=1.7)
    assert "use backend='auto'" in recommendation(good) and "window n=300 bfloat16 train" in recommendation(good)
    line = recommendation(slow)
    assert "backend='sliding_window'" in line and "1.70x" in line and "python -m attnkit bench" in line
    assert "auto: no table at" in calibration_status() and "the static rule decides" in calibration_status()
    text = recommendations({"auto_verification": [good, slow, dict(good, n=600)], "results": []})
    assert len(text.splitlines()) == 3  # the status, then one line per mask and length
    assert "sliding window n=300: backend='auto' elsewhere; bfloat16 train: backend='sliding_window'" in text
    assert "sliding window n=600: use backend='auto' (it picks native" in text
    monkeypatch.setenv("ATTNKIT_CALIBRATION", str(tmp_path / "cal.json"))
    key = calibration.entry_key("cpu", "float32", "none", "forward", heads=2, head_dim=8)
    calibration.save({"entries": {key: [{"n": 8, "order": ["sdpa"], "times": {"sdpa": 1e-4}}]}})
    assert f"auto: table at {tmp_path / 'cal.json'}: 1 points" in calibration_status()


def test_calibrate_estimate_is_said_before_it_starts():
    from attnkit.cli.bench import estimate_line

    config = BenchConfig(backends=["naive", "sdpa"], lengths=[16, 32, 64], masks=["none"], dtypes=["float32"],
                         passes=["forward"], min_run_time=0.5, time_budget_s=1.0)
    line = estimate_line(config)
    assert "6 cases" in line and "estimated" in line and "progress" in line
    # the verification of auto's picks after the sweep: a quarter of --budget (at least 30 s) per column
    config.backends, config.run_budget_s = ["naive", "sdpa", "auto"], 160.0
    assert "then at most 80 s timing auto's picks in the sweep and after calibration" in estimate_line(config)
    assert "then at most 40 s timing auto's picks in the sweep against" in estimate_line(config, calibrate=False)
    config.backends = ["naive", "sdpa"]
    assert "timing" not in estimate_line(config, calibrate=False)


def test_plain_tables_wrap_to_the_width():
    from attnkit.bench.report import format_table

    rows = [["sliding_window", "a reason that is far too long to fit on one narrow terminal line at all", "1.23"]]
    text = format_table(rows, ["backend", "why", "ms"], right=frozenset({2}), width=50)
    assert max(len(line) for line in text.splitlines()) <= 50
    assert len(text.splitlines()) > 3 and "1.23" in text and "terminal" in text
    wide = format_table(rows, ["backend", "why", "ms"], right=frozenset({2}), width=500)
    assert len(wide.splitlines()) == 3


def test_auto_vs_best_plot_has_one_panel_per_pass(tmp_path):
    pytest.importorskip("matplotlib")
    from attnkit.bench.plots import _auto_over_best

    rows = [{"n": n, "mask": m, "dtype": d, "passes": p, "best": "sdpa", "auto_chose": "sdpa",
             "auto_over_best": 1.0 + n / 1e4}
            for n in (256, 1024) for m in ("causal", "window") for d in ("float32", "bfloat16")
            for p in ("forward", "train")]
    path = _auto_over_best({"auto_verification": rows, "results": []}, tmp_path / "auto.png")
    assert path is not None and path.stat().st_size > 1000
    assert _auto_over_best({"results": []}, tmp_path / "none.png") is None


def test_timings_run_at_the_process_thread_count():
    # torch.utils.benchmark.Timer times at 1 thread unless told: the sweep (and the table it writes,
    # and auto's decisions inside the timed calls) must see the thread count the process runs at
    from attnkit.bench.runner import _time

    before = torch.get_num_threads()
    seen: list[int] = []
    try:
        torch.set_num_threads(2)
        _time(lambda: seen.append(torch.get_num_threads()), 0.001)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {2}


def test_memory_measurement_leaves_the_allocator_as_a_process_has_it():
    # Measuring pins glibc's mmap threshold low for that call; the calls timed afterwards must not
    # page-fault a fresh mmap for every tensor (allocation-heavy backends would be timed slower).
    import resource

    from attnkit.bench.memory import PeakMemory

    meter = PeakMemory("cpu")
    if meter.method.startswith("none"):
        pytest.skip("no peak-RSS measurement here (not Linux with glibc)")
    size = 4 * 2**20 // 4  # 4 MiB of float32
    peak = meter.measure(lambda: torch.ones(size))
    assert peak is not None and peak >= 3 * 2**20  # the measurement itself still counts the tensor
    for _ in range(3):  # the heap grows to hold it once
        torch.ones(size)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.ones(size)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 20 * 1024 // 2, f"{faults} page faults for 20 reused 4 MiB tensors (1024 pages each)"


def test_a_backend_name_never_wraps_in_the_terminal_table(monkeypatch):
    pytest.importorskip("rich")
    from attnkit.bench.report import terminal_table

    monkeypatch.setenv("COLUMNS", "100")
    rows = [_row(backend="auto", chosen="sliding_window", mask="bigbird", dtype="bfloat16", passes="train", n=16384,
                 median_s=12.3456, iqr_s=0.5, runs=17, peak_bytes=3 * 2**30, gflops=1234.5),
            _row(backend="sliding_window", chosen="sliding_window", mask="window"),
            {**_row(backend="block_sparse"), "status": "skipped", "reason": "a long reason " * 12}]
    text = terminal_table({"results": rows})
    assert text.count("sliding_window") == 2, text  # whole, on one line each time


def _sweep(masks, passes=("forward", "train"), dtypes=("float32",), lengths=(256, 1024), backends=("sdpa", "linear")):
    return {"memory_method": "none", "results": [
        _row(backend=b, chosen="sdpa" if b == "auto" else b, exact=b != "linear", mask=m, passes=p, dtype=d, n=n,
             median_s=n * 1e-6)
        for b in backends for m in masks for p in passes for d in dtypes for n in lengths]}


def test_plots_hold_at_most_six_panels_and_no_single_point_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from attnkit.bench import plots

    panels: list[int] = []
    real = matplotlib.figure.Figure.savefig

    def count(fig, *args, **kwargs):
        drawn = [ax for ax in fig.axes if ax.get_visible() and (ax.lines or ax.collections)]
        panels.append(len(drawn))
        lines = [line for ax in drawn for line in ax.lines if line.get_label()[:1] != "_"]
        assert all(len(line.get_xdata()) >= 2 for line in lines)
        assert all(line.get_label() in plots.APPROXIMATE for line in lines if line.get_linestyle() == "--")
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", count)
    masks = ["none", "causal", "window", "bigbird", "padding"]
    results = _sweep(masks, dtypes=("float32", "bfloat16"), backends=("sdpa", "linear", "auto"))
    results["results"].append(_row(backend="naive", chosen="naive", mask="causal", n=256))  # one point: no line
    made = plots.write_plots(results, tmp_path)
    assert made and panels and max(panels) <= 6, panels
    assert len({p.name for p in made}) == len(made) and all(p.exists() for p in made)
    assert sum(panels[:len([p for p in made if p.name.startswith("time_vs_length")])]) == 2 * 2 * 5  # every panel drawn


def test_dashed_lines_mean_approximate_in_every_plot_and_markers_differ():
    from attnkit.bench.plots import STYLES, style

    markers = [marker for _, marker in STYLES.values()]
    assert len(set(markers)) == len(markers)
    similar = [{"x", "X"}, {"p", "h", "H", "8"}, {"d", "D"}, {"1", "2", "3", "4"}, {".", ","}]
    assert all(len(group & set(markers)) <= 1 for group in similar), markers
    assert style("auto")["linestyle"] != "--" and style("sdpa")["linestyle"] != "--"
