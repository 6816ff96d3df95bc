"""attention(backend="auto") against a direct F.scaled_dot_product_attention call.

Figures: the per-call overhead at the decode shape (B=1, H=8, Tq=1, Tk=512, D=64, causal; aim
<= 10 us above the direct call) and the time ratio auto / direct SDPA for dense and causal
attention at B=1, H=8, D=64, n in {1024, 4096} (aim <= 1.03), at each thread count asked for.

With ``--baseline REF`` the same cases also run on attnkit as of the git revision REF (extracted
with ``git archive`` and imported as a second package), interleaved with the current tree in the
same process, so "before" and "after" share the machine's load. Every case is timed with
torch.utils.benchmark (blocked_autorange) in interleaved rounds; the table prints medians, and
overhead is the median of the per-round differences to the direct call.

    python benchmarks/bench_overhead.py --baseline main --threads 1,2     # about 3 minutes
    python benchmarks/bench_overhead.py --quick                           # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tb

import attnkit

ROOT = Path(__file__).resolve().parent.parent


def load_baseline(ref: str, where: Path):
    """attnkit as of git revision ``ref``, imported as the package ``attnkit_baseline``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "attnkit"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    (where / "attnkit").rename(where / "attnkit_baseline")
    sys.path.insert(0, str(where))
    return importlib.import_module("attnkit_baseline")


def median_time(stmt: str, env: dict, min_run_time: float, threads: int) -> float:
    return tb.Timer(stmt=stmt, globals=env, num_threads=threads).blocked_autorange(min_run_time=min_run_time).median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="git revision to compare against (e.g. main)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds for the prefill cases")
    parser.add_argument("--decode-repeats", type=int, default=30, help="interleaved rounds for the decode case")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (a smoke run, not figures)")
    parser.add_argument("--out", default="bench-results", help="directory for overhead.json")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    sizes = (128,) if args.quick else (1024, 4096)
    repeats, decode_repeats = (1, 3) if args.quick else (args.repeats, args.decode_repeats)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        impls = {"attnkit": attnkit}
        if args.baseline:
            impls[f"baseline {args.baseline}"] = load_baseline(args.baseline, Path(tmp))
        cases = [("decode Tq=1 Tk=512 causal", 1, 512, True)]
        cases += [(f"{'causal' if causal else 'dense'} n={n}", n, n, causal) for n in sizes for causal in (False, True)]
        rows = []
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for name, Tq, Tk, causal in cases:
                q = torch.randn(1, 8, Tq, 64)
                k, v = torch.randn(1, 8, Tk, 64), torch.randn(1, 8, Tk, 64)
                env = dict(F=F, q=q, k=k, v=v, is_causal=causal and Tq == Tk,
                           **{f"m{i}": m for i, m in enumerate(impls.values())})
                stmts = {"sdpa": "F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)"}
                for i, (label, module) in enumerate(impls.items()):
                    env[f"mask{i}"] = module.Causal() if causal else None
                    stmts[label] = f"m{i}.attention(q, k, v, mask=mask{i})"
                min_run = 0.05 if Tq == 1 else (0.2 if args.quick else 1.0)
                times = {label: [] for label in stmts}
                for _ in range(decode_repeats if Tq == 1 else repeats):
                    for label, stmt in stmts.items():  # interleaved: every round times every variant
                        times[label].append(median_time(stmt, env, min_run, n_threads))
                for label in impls:
                    diffs = [a - d for a, d in zip(times[label], times["sdpa"])]
                    ratios = [a / d for a, d in zip(times[label], times["sdpa"])]
                    module = impls[label]
                    rows.append(dict(
                        threads=n_threads, case=name, variant=label,
                        backend=module.explain(q, k, v, mask=env[f"mask{list(impls).index(label)}"]).chosen,
                        sdpa_us=statistics.median(times["sdpa"]) * 1e6, ours_us=statistics.median(times[label]) * 1e6,
                        ratio=statistics.median(ratios), overhead_us=statistics.median(diffs) * 1e6,
                    ))
    print(f"torch {torch.__version__}, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}; medians of "
          f"{repeats} interleaved rounds ({decode_repeats} for decode); overhead = median of per-round differences")
    print(f"{'thr':>3s} {'case':28s} {'variant':16s} {'backend':8s} {'SDPA us':>10s} {'ours us':>10s} {'ratio':>7s} "
          f"{'overhead us':>12s}")
    for r in rows:
        print(f"{r['threads']:3d} {r['case']:28s} {r['variant']:16s} {r['backend']:8s} {r['sdpa_us']:10.1f} "
              f"{r['ours_us']:10.1f} {r['ratio']:7.3f} {r['overhead_us']:12.1f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(torch=torch.__version__, load_average=os.getloadavg(), quick=args.quick, baseline=args.baseline)
    (out / "overhead.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"saved -> {out / 'overhead.json'}")


if __name__ == "__main__":
    main()
