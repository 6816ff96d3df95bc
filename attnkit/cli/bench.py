"""Measure every attention backend on this machine: table, JSON, plots and a Markdown report.

Sweeps backends x lengths x masks x dtypes x {forward, forward+backward}; per case the median time
and its spread, peak memory, GFLOP/s and % of this machine's matmul peak, and the error against a
float64 reference. Cases predicted to exceed the time budget (default 0.25 s per call) or the memory
budget (default 4 GiB) are skipped with the reason: raise --time-budget to measure long sequences.
With no arguments it takes about a minute on 2 CPU cores.

Examples:
    python -m attnkit bench
    python -m attnkit bench --backends sdpa,tiled,sliding_window --lengths 1024,4096,16384 \\
        --masks causal,window --passes forward --time-budget 10
    python -m attnkit bench --backends sdpa,tiled,auto --passes forward --device cuda
    python -m attnkit bench --calibrate          # store crossovers for `auto` in the user cache dir
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from .. import calibration
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
from ..bench.runner import build_calibration, run_sweep, verify_auto
from ..registry import list_backends
from .options import device, int_list, name_list

# A calibration needs more points than the quick default sweep: the lengths where crossovers happen.
CALIBRATE_LENGTHS = [256, 512, 1024, 2048, 4096, 8192]


def calibrate_dtypes() -> list[str]:
    """float32, and bfloat16 where this CPU multiplies it at least as fast (measured)."""
    from ..hardware import half_matmul_is_fast

    return ["float32", "bfloat16"] if half_matmul_is_fast(torch.bfloat16) else ["float32"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument("--backends", type=name_list(), default=None,
                        help="comma-separated backend names and/or 'auto' (default: every registered backend + auto)")
    parser.add_argument("--lengths", type=int_list(), default=None,
                        help=f"sequence lengths (default {','.join(map(str, d.lengths))}; "
                             f"with --calibrate {','.join(map(str, CALIBRATE_LENGTHS))})")
    parser.add_argument("--masks", type=name_list(MASK_SPECS), default=d.masks,
                        help=f"some of {','.join(MASK_SPECS)} (default {','.join(d.masks)})")
    parser.add_argument("--dtypes", type=name_list(DTYPES), default=None,
                        help="default float32 (with --calibrate also bfloat16 where this CPU has fast bfloat16 "
                             "matmuls); float16 on CPU is often ~100x slower")
    parser.add_argument("--passes", type=name_list(PASSES), default=d.passes,
                        help="forward and/or train (forward+backward); default both")
    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default cuda when available, else cpu")
    parser.add_argument("--batch", type=int, default=d.batch, help=f"batch size B (default {d.batch})")
    parser.add_argument("--heads", type=int, default=d.heads, help=f"heads H (default {d.heads})")
    parser.add_argument("--head-dim", type=int, default=d.head_dim, help=f"head dim D (default {d.head_dim})")
    parser.add_argument("--window", type=int, default=d.window,
                        help=f"sliding window width, also for Longformer/BigBird (default {d.window})")
    parser.add_argument("--time-budget", type=float, default=d.time_budget_s,
                        help=f"skip a case predicted (from the shorter lengths) to take longer than this many seconds "
                             f"per call (default {d.time_budget_s:g} s); raise it to measure long sequences")
    parser.add_argument("--memory-budget", type=float, default=d.memory_budget_bytes / 2**30,
                        help=f"skip a case predicted to need more than this many GiB "
                             f"(default {d.memory_budget_bytes / 2**30:g} GiB)")
    parser.add_argument("--min-run-time", type=float, default=d.min_run_time,
                        help=f"seconds of timing per case (default {d.min_run_time:g} s)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="output directory (default bench-results)")
    parser.add_argument("--calibrate", action="store_true",
                        help="store the measured crossovers for `auto` in the user cache directory "
                             f"({calibration.calibration_path()}; ATTNKIT_CALIBRATION overrides), then verify auto "
                             "against the best backend")
    # no effect: the rules of thumb moved to benchmarks/claims.py; kept so old command lines still run
    parser.add_argument("--no-claims", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-plots", action="store_true", help="write no PNG plots (they need the bench extra)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it needs the bench extra)")


def _progress(disabled: bool):
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print("(no progress bar: pip install 'attnkit[bench]')", file=sys.stderr)
        return None
    # disable=None: a bar on a terminal only, so a log file gets no carriage-return soup
    return lambda cases: tqdm(cases, desc="bench", unit="case", file=sys.stderr, dynamic_ncols=True, disable=None)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The sweep the flags describe; every value is checked here (``ValueError`` naming the flag)."""
    lengths = args.lengths or (CALIBRATE_LENGTHS if args.calibrate else BenchConfig().lengths)
    dtypes = args.dtypes or (calibrate_dtypes() if args.calibrate else ["float32"])
    registry = list_backends()
    backends = args.backends
    if backends is None and args.calibrate:
        # auto is verified after; backends that compile on first use (flex) are ranked only when named
        backends = [name for name, impl in registry.items() if impl.exact and not getattr(impl, "compiles", False)]
    if not math.isfinite(args.memory_budget) or args.memory_budget <= 0:
        raise ValueError(f"--memory-budget: expected a finite number of GiB > 0, got {args.memory_budget!r}")
    return BenchConfig(
        backends=backends, lengths=lengths, masks=args.masks, dtypes=dtypes, passes=args.passes, device=args.device,
        batch=args.batch, heads=args.heads, head_dim=args.head_dim, window=args.window, time_budget_s=args.time_budget,
        memory_budget_bytes=max(1, int(args.memory_budget * 2**30)), min_run_time=args.min_run_time,
    )


def estimate_line(config: BenchConfig) -> str:
    """How long a sweep takes at most, said before it starts: each case is timed for at least
    ``min_run_time`` after a warm-up call, and none runs past the time budget per call."""
    backends = len(config.backends or list_backends()) + (config.backends is None)
    cases = backends * len(config.lengths) * len(config.masks) * len(config.dtypes) * len(config.passes)
    low = cases * config.min_run_time
    high = cases * (config.min_run_time + 2 * config.time_budget_s)
    return (f"calibrate: {cases} cases; estimated {low / 60:.0f}-{high / 60:.0f} min (each timed >= "
            f"{config.min_run_time:g} s, cases predicted over {config.time_budget_s:g} s per call skipped); "
            "progress below")


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if not args.no_plots and missing_extra():
        raise ValueError(f"{missing_extra()}, or pass --no-plots")
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out}: exists and is not a directory; "
                         "name a directory (it is created if missing)")
    command = command_line(f"{getattr(args, '_prog', 'attnkit')} bench", getattr(args, "_argv", None) or [])
    if args.calibrate:
        print(estimate_line(config), file=sys.stderr)
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
    if args.calibrate:
        table = build_calibration(results)
        path = calibration.save({**table, "command": results["command"]})
        print(f"\ncalibration: {sum(len(v) for v in table['entries'].values())} points in "
              f"{len(table['entries'])} entries written to {path}")
        results["auto_verification"] = verify_auto(results, config)
    if any(r["backend"] == "auto" for r in results["results"]) or args.calibrate:
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
