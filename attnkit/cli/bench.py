"""Measure every attention backend on this machine: table, JSON, plots and a Markdown report, and
(by default) this machine's calibration table for ``auto``.

Sweeps backends x lengths x masks x dtypes x {forward, forward+backward}; per case the median time
and its spread, peak memory, GFLOP/s and % of this machine's matmul peak, and the error against a
float64 reference. Cases predicted to exceed the time budget per call (default 0.25 s) or the memory
budget (default 4 GiB) are skipped with the reason; cases left when the run's budget (--budget,
default a few minutes) is spent are skipped too (the longest lengths come last).

With no --backends, the run measures every exact backend and writes the calibration table that
``auto`` follows (lengths 256-8192, float32 and, where this CPU multiplies bfloat16 fast, bfloat16;
backends within the sweep's noise of a point's fastest are timed again, interleaved, before it
is written), then times ``auto`` against the best backend wherever it still picks another one.
Every run that measures ``auto`` also times the picks it made during the sweep against the best
the same way (the report's "before" column). It estimates its duration before it starts and shows
progress.

Examples:
    python -m attnkit bench                      # calibrate this machine (a few minutes on 2 cores)
    python -m attnkit bench --no-calibrate --lengths 256,1024     # measure only: the table is left alone
    python -m attnkit bench --backends sdpa,tiled,sliding_window --lengths 1024,4096,16384 \\
        --masks causal,window --passes forward --time-budget 10
    python -m attnkit bench --backends sdpa,tiled,auto --passes forward --device cuda
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from ..dispatch import table as calibration
from .._compat import progress_bar_class
from ..bench.cases import DTYPES, MASK_SPECS, PASSES, BenchConfig
from ..bench.plots import missing_extra, write_plots
from ..bench.report import (
    auto_table,
    command_line,
    crossover_table,
    recommendations,
    skip_hint,
    terminal_table,
    write_json,
    write_markdown,
)
from ..bench.runner import (
    TIE_MARGIN,
    build_calibration,
    confirmed,
    correct_calibration,
    estimate_seconds,
    resolve_ties,
    run_sweep,
    sweep_cases,
    sweep_names,
    verify_auto,
    verify_auto_before,
)
from ..registry import list_backends
from .options import device, int_list, name_list

# A calibration's lengths (a lookup takes the nearest on a log scale) and the run's default budget.
CALIBRATE_LENGTHS = [256, 1024, 4096, 8192]
DEFAULT_RUN_BUDGET_S = 600.0
CALIBRATE_TIME_BUDGET_S = 3.0  # per call: the promised n=8192 training cells of the fused kernels fit


def calibrate_dtypes() -> list[str]:
    """float32, and bfloat16 where this CPU multiplies it at least as fast (measured)."""
    from ..hardware import half_matmul_is_fast

    return ["float32", "bfloat16"] if half_matmul_is_fast(torch.bfloat16) else ["float32"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument("--backends", type=name_list(), default=None,
                        help="comma-separated backend names and/or 'auto' (default: every registered backend + auto)")
    parser.add_argument("--lengths", type=int_list(), default=None,
                        help=f"sequence lengths (default {','.join(map(str, CALIBRATE_LENGTHS))} when calibrating, "
                             f"else {','.join(map(str, d.lengths))})")
    parser.add_argument("--masks", type=name_list(MASK_SPECS), default=d.masks,
                        help=f"some of {','.join(MASK_SPECS)} (default {','.join(d.masks)})")
    parser.add_argument("--dtypes", type=name_list(DTYPES), default=None,
                        help="default float32, and when calibrating also bfloat16 where this CPU has fast bfloat16 "
                             "matmuls; float16 on CPU is often ~100x slower")
    parser.add_argument("--passes", type=name_list(PASSES), default=d.passes,
                        help="forward and/or train (forward+backward); default both")
    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default cuda when available, else cpu")
    parser.add_argument("--batch", type=int, default=d.batch, help=f"batch size B (default {d.batch})")
    parser.add_argument("--heads", type=int, default=d.heads, help=f"heads H (default {d.heads})")
    parser.add_argument("--head-dim", type=int, default=d.head_dim, help=f"head dim D (default {d.head_dim})")
    parser.add_argument("--window", type=int, default=d.window,
                        help=f"sliding window width, also for Longformer/BigBird (default {d.window})")
    parser.add_argument("--time-budget", type=float, default=None,
                        help=f"skip a case predicted (from the shorter lengths) to take longer than this many seconds "
                             f"per call (default {d.time_budget_s:g} s; {CALIBRATE_TIME_BUDGET_S:g} s when "
                             "calibrating); raise it to measure long sequences")
    parser.add_argument("--memory-budget", type=float, default=d.memory_budget_bytes / 2**30,
                        help=f"skip a case predicted to need more than this many GiB "
                             f"(default {d.memory_budget_bytes / 2**30:g} GiB)")
    parser.add_argument("--budget", type=float, default=DEFAULT_RUN_BUDGET_S,
                        help=f"seconds for the sweep (default {DEFAULT_RUN_BUDGET_S:g} s): cases left when it is "
                             "spent are skipped, the longest lengths first; when calibrating, timing its ties "
                             "interleaved then takes at most an eighth of it (at least 15 s); "
                             "then timing auto's picks against the best "
                             "takes at most a quarter of it (at least 30 s) per column, before and after calibration; "
                             "the estimate is printed before it starts")
    parser.add_argument("--min-run-time", type=float, default=d.min_run_time,
                        help=f"seconds of timing per case (default {d.min_run_time:g} s)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="output directory (default bench-results)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--calibrate", action="store_true",
                       help="write the calibration table even when --backends names only some backends (the default "
                            f"run writes it: {calibration.calibration_path()}; ATTNKIT_CALIBRATION overrides)")
    which.add_argument("--no-calibrate", action="store_true",
                       help="measure only: leave this machine's calibration table as it is")
    # no effect: the rules of thumb moved to benchmarks/claims.py; kept so old command lines still run
    parser.add_argument("--no-claims", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots (they need the bench extra)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it needs the bench extra)")


def _progress(disabled: bool):
    if disabled:
        return None
    tqdm = progress_bar_class()
    if tqdm is None:
        print("(no progress bar: pip install 'attnkit[bench]')", file=sys.stderr)
        return None
    # disable=None: a bar on a terminal only, so a log file gets no carriage-return soup
    return lambda cases: tqdm(cases, desc="bench", unit="case", file=sys.stderr, dynamic_ncols=True, disable=None)


def calibrating(args: argparse.Namespace) -> bool:
    """Whether this run writes the calibration table: by default when it measures every backend,
    with ``--calibrate`` always, with ``--no-calibrate`` never."""
    return args.calibrate or (not args.no_calibrate and args.backends is None)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The sweep the flags describe; every value is checked here (``ValueError`` naming the flag)."""
    calibrate = calibrating(args)
    lengths = args.lengths or (CALIBRATE_LENGTHS if calibrate else BenchConfig().lengths)
    dtypes = args.dtypes or (calibrate_dtypes() if calibrate else ["float32"])
    if not math.isfinite(args.memory_budget) or args.memory_budget <= 0:
        raise ValueError(f"--memory-budget: expected a finite number of GiB > 0, got {args.memory_budget!r}")
    backends = args.backends
    if backends is None and calibrate:
        # the exact backends auto ranks, and auto itself; approximate ones are measured when named or with
        # --no-calibrate, backends that compile on first use (flex) only when named
        backends = [name for name, impl in list_backends().items()
                    if impl.exact and not impl.compiles] + ["auto"]
    return BenchConfig(
        backends=backends, lengths=lengths, masks=args.masks, dtypes=dtypes, passes=args.passes,
        device=args.device, batch=args.batch, heads=args.heads, head_dim=args.head_dim, window=args.window,
        time_budget_s=(CALIBRATE_TIME_BUDGET_S if calibrate else BenchConfig().time_budget_s)
        if args.time_budget is None else args.time_budget,
        memory_budget_bytes=max(1, int(args.memory_budget * 2**30)),
        min_run_time=args.min_run_time, run_budget_s=args.budget,
    )


def verification_budget_s(config: BenchConfig) -> float | None:
    """Seconds for timing one column of auto's picks against the best after the sweep (the report's
    auto/best before or after calibration): a quarter of ``--budget``, at least 30 s; None: no limit."""
    return None if config.run_budget_s is None else max(30.0, config.run_budget_s / 4)


def tie_budget_s(config: BenchConfig) -> float | None:
    """Seconds for timing the calibration's ties interleaved (:func:`resolve_ties`): an eighth of
    ``--budget``, at least 15 s; None: no limit."""
    return None if config.run_budget_s is None else max(15.0, config.run_budget_s / 8)


def verified_columns(config: BenchConfig, calibrate: bool) -> list[str]:
    """Which of auto's picks a run times against the best: those in the sweep where it measures
    auto, and those after calibration where it calibrates."""
    return ["in the sweep"] * ("auto" in sweep_names(config)) + ["after calibration"] * calibrate


def estimate_line(config: BenchConfig, calibrate: bool = True) -> str:
    """What the run will do and about how long it takes, said before it starts (from the cost
    each case's FLOPs at a tenth of this machine's float32 matmul rate; capped by ``--budget``), and the most the
    verification of auto's picks after it may add."""
    cases = len(sweep_cases(config, sweep_names(config)))
    seconds = estimate_seconds(config)
    budget = config.run_budget_s
    capped = f", capped by --budget {budget:g} s" if budget is not None and seconds >= budget else ""
    columns = verified_columns(config, calibrate)
    per_column = verification_budget_s(config)
    verify = ""
    if calibrate and tie_budget_s(config) is not None:
        verify = f", then at most {_duration(tie_budget_s(config))} timing its ties interleaved"
    if columns and per_column is not None:
        verify += (f", then at most {_duration(per_column * len(columns))} timing auto's picks "
                   f"{' and '.join(columns)} against the best")
    what = "calibrate" if calibrate else "bench"
    return (f"{what}: {cases} cases ({','.join(config.dtypes)}; n = {','.join(map(str, sorted(config.lengths)))}); "
            f"estimated {_duration(seconds)}{capped}{verify}, from each case's FLOPs at a tenth of this machine's "
            "matmul rate; progress below")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _say_verifying(which: str, config: BenchConfig) -> None:
    budget = verification_budget_s(config)
    limit = "" if budget is None else f" (at most {_duration(budget)})"
    print(f"timing auto's picks {which} against the best{limit}", file=sys.stderr, flush=True)


def _resolve_ties(table: dict, results: dict, config: BenchConfig) -> dict:
    """:func:`resolve_ties` within :func:`tie_budget_s`, saying how many it resolved and how many stayed."""
    ties = sum(bool(p.get("tie")) for v in table["entries"].values() for p in v)
    if not ties:
        return table
    budget = tie_budget_s(config)
    limit = "" if budget is None else f" (at most {_duration(budget)})"
    print(f"timing the calibration's {ties} ties interleaved{limit}", file=sys.stderr, flush=True)
    table = resolve_ties(table, results, config, budget_s=budget)
    points = [p for v in table["entries"].values() for p in v]
    resolved = sum("interleaved" in p and not p.get("tie") for p in points)
    close = sum("interleaved" in p and bool(p.get("tie")) for p in points)
    untimed = ties - resolved - close
    print(f"\nties: {resolved} of {ties} resolved by timing the backends within noise interleaved (the fastest "
          f"> {TIE_MARGIN:.0%} ahead), {close} stayed ties (within {TIE_MARGIN:.0%})"
          + (f", {untimed} not timed (the step's budget was spent)" if untimed else ""))
    return table


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    calibrate = calibrating(args)
    if not args.no_plots and missing_extra():
        raise ValueError(f"{missing_extra()}, or pass --no-plots")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out}: exists and is not a directory; "
                         "name a directory (it is created if missing)")
    sweep_names(config)  # unknown backend names are refused before anything is measured
    command = command_line(f"{getattr(args, '_prog', 'attnkit')} bench", getattr(args, "_argv", None) or [])
    print(estimate_line(config, calibrate), file=sys.stderr, flush=True)
    results = run_sweep(config, progress=_progress(args.no_progress))  # checks the backend names first
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    results["command"] = command
    print(terminal_table(results, group_skips=True))
    hint = skip_hint(results)
    if hint:
        print("\n" + hint)
    print()
    print(crossover_table(results))
    if any(r["backend"] == "auto" and r["status"] == "ok" for r in results["results"]):
        # the sweep's auto rows were single timings back to back: its picks are timed interleaved
        # against the best (before the table is written: a pick found faster corrects it)
        _say_verifying("in the sweep", config)
        results["auto_before_verification"] = verify_auto_before(
            results, config, budget_s=verification_budget_s(config))
    if calibrate:
        table = build_calibration(results)
        if table["entries"]:
            table = _resolve_ties(table, results, config)
            table, corrected = correct_calibration(table, results, results.get("auto_before_verification") or ())
            measured = sum(len(v) for v in table["entries"].values())
            table = confirmed(table)
            written = sum(len(v) for v in table["entries"].values())
            path = calibration.save({**table, "command": results["command"]}, merge=True)
            print(f"\ncalibration: {written} points confirmed by an interleaved timing in {len(table['entries'])} "
                  f"entries written to {path} ({measured - written} not written: unconfirmed, or the static rule's "
                  "pick already; the rule decides there)"
                  + (f"; {corrected} led by a backend that timed faster than the sweep's best interleaved"
                     if corrected else ""))
            _say_verifying("after calibration", config)
            results["auto_verification"] = verify_auto(results, config, budget_s=verification_budget_s(config),
                                                       known=results.get("auto_before_verification") or ())
        else:
            print("\ncalibration: nothing measured, no table written")
    if any(r["backend"] == "auto" for r in results["results"]) or results.get("auto_verification"):
        print()
        print(auto_table(results))
        print()
        print(recommendations(results))
    plots = [] if args.no_plots else write_plots(results, out_dir)
    json_path = write_json(results, out_dir / "results.json")
    report = write_markdown(results, out_dir, plots)
    print(f"\n{len(results['results'])} cases in {results['elapsed_s']:.0f} s; "
          f"wrote {json_path}, {report}" + "".join(f", {p}" for p in plots))
    return 0
