"""attention(backend="auto") against a direct F.scaled_dot_product_attention call.

Figures: the time ratio auto / direct SDPA for dense and causal attention at
B=1, H=8, D=64, n in {1024, 4096} (aim <= 1.03), and the per-call overhead at the decode shape
Tq=1, Tk=512 (aim <= 15 us above the direct call). Both sides are timed interleaved in one run with
torch.utils.benchmark (blocked_autorange); the table prints medians and ratios.

    python benchmarks/bench_overhead.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tb

import attnkit
from attnkit import Causal


def median_time(stmt: str, env: dict, min_run_time: float) -> float:
    # Timer defaults to one thread; measure with the threads attention() would really use.
    return tb.Timer(stmt=stmt, globals=env, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time).median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the median ratio is reported")
    parser.add_argument("--decode-repeats", type=int, default=30,
                        help="interleaved rounds for the (microsecond-scale, noisier) decode case")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = []
    for n in (1024, 4096):
        for causal in (False, True):
            cases.append((f"{'causal' if causal else 'dense'} n={n}", 1, n, n, causal))
    cases.append(("decode Tq=1 Tk=512 causal", 1, 1, 512, True))
    rows = []
    for name, B, Tq, Tk, causal in cases:
        q = torch.randn(B, 8, Tq, 64)
        k, v = torch.randn(B, 8, Tk, 64), torch.randn(B, 8, Tk, 64)
        env = dict(F=F, attnkit=attnkit, q=q, k=k, v=v, mask=Causal() if causal else None,
                   is_causal=causal and Tq == Tk)
        direct = "F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)"
        ours = "attnkit.attention(q, k, v, mask=mask)"
        min_run = 0.1 if Tq == 1 else 1.0
        ratios, d_times, a_times, diffs = [], [], [], []
        for _ in range(args.decode_repeats if Tq == 1 else args.repeats):
            d = median_time(direct, env, min_run)
            a = median_time(ours, env, min_run)
            d_times.append(d)
            a_times.append(a)
            ratios.append(a / d)
            diffs.append(a - d)
        d, a = statistics.median(d_times), statistics.median(a_times)
        rows.append(dict(case=name, sdpa_us=d * 1e6, auto_us=a * 1e6, ratio=statistics.median(ratios),
                         overhead_us=statistics.median(diffs) * 1e6,
                         backend=attnkit.explain(q, k, v, mask=env["mask"]).chosen))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {args.repeats} interleaved rounds "
          f"({args.decode_repeats} for decode); overhead = median of per-round differences")
    print(f"{'case':28s} {'backend':8s} {'SDPA us':>10s} {'auto us':>10s} {'ratio':>7s} {'overhead us':>12s}")
    for r in rows:
        print(f"{r['case']:28s} {r['backend']:8s} {r['sdpa_us']:10.1f} {r['auto_us']:10.1f} {r['ratio']:7.3f} "
              f"{r['overhead_us']:12.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
