"""Measure every attention backend on this machine: table, JSON, plots and a Markdown report.

Sweeps backends x lengths x masks x dtypes x {forward, forward+backward}; per case the median time
and its spread, peak memory, GFLOP/s and % of this machine's matmul peak, and the error against a
float64 reference. Cases predicted to exceed the time or memory budget are skipped with the reason.
With no arguments it takes about a minute on 2 CPU cores.

Examples:
    python -m attnkit bench
    python -m attnkit bench --lengths 1024,4096,16384 --masks causal,window --dtypes float32,bfloat16
    python -m attnkit bench --backends sdpa,tiled,auto --passes forward --device cuda
    python -m attnkit bench --calibrate          # store crossovers for `auto` in the user cache dir
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from .. import calibration
from ..bench import claims as claim_lib
from ..bench.cases import MASK_SPECS, PASSES, BenchConfig
from ..bench.plots import missing_extra, write_plots
from ..bench.report import auto_table, crossover_table, crossovers, terminal_table, write_json, write_markdown
from ..bench.runner import build_calibration, run_sweep, verify_auto

# A calibration needs more points than the quick default sweep: the lengths where crossovers happen.
CALIBRATE_LENGTHS = [256, 512, 1024, 2048, 4096]
CALIBRATE_DTYPES = ["float32", "bfloat16"]


def _csv(kind: type, choices=None):
    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")
        bad = [x for x in values if choices is not None and x not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected some of {sorted(choices)}, got {text!r}")
        if kind is int and min(values) < 1:
            raise argparse.ArgumentTypeError(f"lengths must be positive, got {text!r}")
        return values

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    parser.add_argument("--backends", type=_csv(str), default=None,
                        help="comma-separated backend names and/or 'auto' (default: every registered backend + auto)")
    parser.add_argument("--lengths", type=_csv(int), default=None,
                        help=f"sequence lengths (default {','.join(map(str, d.lengths))}; "
                             f"with --calibrate {','.join(map(str, CALIBRATE_LENGTHS))})")
    parser.add_argument("--masks", type=_csv(str, set(MASK_SPECS)), default=d.masks, help=f"some of {','.join(MASK_SPECS)}")
    parser.add_argument("--dtypes", type=_csv(str, {"float32", "bfloat16", "float16", "float64"}), default=None,
                        help="default float32 (with --calibrate float32,bfloat16); float16 on CPU is ~100x slower")
    parser.add_argument("--passes", type=_csv(str, set(PASSES)), default=d.passes, help="forward and/or train (forward+backward)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=d.batch)
    parser.add_argument("--heads", type=int, default=d.heads)
    parser.add_argument("--head-dim", type=int, default=d.head_dim)
    parser.add_argument("--window", type=int, default=d.window, help="sliding window width (also for Longformer/BigBird)")
    parser.add_argument("--time-budget", type=float, default=d.time_budget_s,
                        help="skip a case predicted to take longer than this many seconds per call")
    parser.add_argument("--memory-budget", type=float, default=d.memory_budget_bytes / 2**30,
                        help="skip a case predicted to need more than this many GiB")
    parser.add_argument("--min-run-time", type=float, default=d.min_run_time, help="seconds of timing per case")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    parser.add_argument("--calibrate", action="store_true",
                        help=f"store the measured crossovers for `auto` in {calibration.calibration_path()} "
                             "(ATTNKIT_CALIBRATION overrides), then verify auto against the best backend")
    parser.add_argument("--no-claims", action="store_true", help="skip measuring the seeds' claims")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def _progress(disabled: bool):
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print("(no progress bar: pip install 'attnkit[bench]')", file=sys.stderr)
        return None
    return lambda cases: tqdm(cases, desc="bench", unit="case", file=sys.stderr, dynamic_ncols=True)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    lengths = args.lengths or (CALIBRATE_LENGTHS if args.calibrate else BenchConfig().lengths)
    dtypes = args.dtypes or (CALIBRATE_DTYPES if args.calibrate else ["float32"])
    backends = args.backends
    if backends is None and args.calibrate:
        from ..registry import list_backends

        # auto is verified after; backends that compile on first use (flex) are ranked only when named
        backends = [name for name, impl in list_backends().items() if impl.exact and not getattr(impl, "compiles", False)]
    return BenchConfig(
        backends=backends, lengths=lengths, masks=args.masks, dtypes=dtypes, passes=args.passes, device=args.device,
        batch=args.batch, heads=args.heads, head_dim=args.head_dim, window=args.window, time_budget_s=args.time_budget,
        memory_budget_bytes=int(args.memory_budget * 2**30), min_run_time=args.min_run_time,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    command = "python -m attnkit bench " + shlex.join(getattr(args, "_argv", None) or [])
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    results = run_sweep(config, progress=_progress(args.no_progress))
    results["command"] = command.strip()
    print(terminal_table(results, group_skips=True))
    print()
    print(crossover_table(results))
    if args.calibrate:
        table = build_calibration(results)
        path = calibration.save({**table, "command": results["command"]})
        print(f"\ncalibration: {sum(len(v) for v in table['entries'].values())} points in "
              f"{len(table['entries'])} entries written to {path}")
        results["calibration_path"] = str(path)
        results["auto_verification"] = verify_auto(results, config)
    if any(r["backend"] == "auto" for r in results["results"]) or args.calibrate:
        print()
        print(auto_table(results))
    claims_md = None
    if not args.no_claims:
        results["claims"] = {
            "scaling": claim_lib.scaling(),
            "score_memory": claim_lib.score_memory(n=4096, device=config.device),
            "multihead": claim_lib.multihead(lengths=(2048,), rounds=2, min_run_time=0.05, device=config.device),
            "boundaries": claim_lib.boundaries(crossovers(results)),
        }
        c = results["claims"]
        claims_md = claim_lib.claims_markdown(c["scaling"], c["score_memory"], c["multihead"], c["boundaries"])
    plots = []
    if not args.no_plots:
        why = missing_extra()
        if why:
            print(f"\n(no plots: {why})")
        else:
            plots = write_plots(results, out_dir)
    json_path = write_json(results, out_dir / "results.json")
    report = write_markdown(results, out_dir, plots, claims_md)
    print(f"\n{len(results['results'])} cases in {results['elapsed_s']:.0f} s; "
          f"wrote {json_path}, {report}" + "".join(f", {p}" for p in plots))
    return 0
