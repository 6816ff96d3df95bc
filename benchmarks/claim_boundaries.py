"""Tests the rule of thumb "standard attention below 4k tokens, flash from 4k to 32k, sparse beyond":
where do this machine's boundaries fall? Reads a `attnkit bench` results.json (or runs a sweep) and prints the
fastest exact backend family per length for each mask.

    python benchmarks/claim_boundaries.py bench-results/results.json
    python benchmarks/claim_boundaries.py --lengths 512,2048,8192 --masks none,causal,window,bigbird
"""

from __future__ import annotations

import argparse
import json

from attnkit.bench import BenchConfig, crossovers, run_sweep
from claims import boundaries
from attnkit.registry import list_backends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", help="results.json of an `attnkit bench` run")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--masks", default="none,causal,window,bigbird")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if args.results:
        results = json.load(open(args.results))
    else:
        exact = [name for name, impl in list_backends().items() if impl.exact]
        config = BenchConfig(backends=exact, lengths=[int(n) for n in args.lengths.split(",")],
                             masks=args.masks.split(","), dtypes=[args.dtype], passes=["forward"], time_budget_s=2.0)
        results = run_sweep(config)
    print("rule of thumb: standard < 4096 <= flash < 32768 <= sparse.  Here (fastest exact family per length):")
    for r in boundaries(crossovers(results)):
        print(f"  {r['dtype']} {r['passes']} {r['mask']}: {r['families']}")


if __name__ == "__main__":
    main()
