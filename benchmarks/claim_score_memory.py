"""Checks that one fp32 score matrix at n = 16384 is ~1 GB (16384^2 * 4 B = 1.07 GB = 1 GiB).

Measures the peak memory of `q @ k.T` for B = H = 1, D = 64 with the same method as `attnkit bench`
(peak RSS delta on CPU, the CUDA allocator's peak on GPU). Allocates about 1 GiB.

    python benchmarks/claim_score_memory.py [--n 16384] [--device cpu]
"""

from __future__ import annotations

import argparse

from claims import score_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    r = score_memory(args.n, args.device)
    measured = "n/a" if r["measured_bytes"] is None else f"{r['measured_bytes'] / 2**30:.3f} GiB"
    print(f"n={r['n']}: predicted {r['predicted_bytes'] / 2**30:.3f} GiB ({r['predicted_bytes'] / 1e9:.2f} GB), "
          f"measured {measured} [{r['method']}]")


if __name__ == "__main__":
    main()
