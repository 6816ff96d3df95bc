"""Tests the statement that multi-head attention is "3-5x faster" than single-head at equal model width for n > 1024.

Times SDPA forward with H heads of width/H against one head of the full width (the same FLOPs for
Q K^T and P V), interleaved, and prints the ratio single / multi.

    python benchmarks/claim_multihead.py [--lengths 1024,2048,4096] [--width 512] [--heads 8]
"""

from __future__ import annotations

import argparse

import torch

from claims import multihead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}; "
          f"medians of {args.rounds} interleaved rounds")
    lengths = tuple(int(n) for n in args.lengths.split(","))
    for r in multihead(lengths, args.width, args.heads, args.rounds, device=args.device):
        print(f"n={r['n']:>6}  {r['heads']} heads x {r['width'] // r['heads']}: {r['multi_s'] * 1e3:8.2f} ms   "
              f"1 head x {r['width']}: {r['single_s'] * 1e3:8.2f} ms   single/multi = {r['single_over_multi']:.2f}")


if __name__ == "__main__":
    main()
