"""Shows that dividing scores by sqrt(d_k) keeps their variance ~1, while unscaled scores saturate
the softmax (rows with max weight -> 1, softmax Jacobian -> 0: no gradient flows through them).

    python benchmarks/claim_scaling.py [--n 256] [--dims 16,64,256,1024]
"""

from __future__ import annotations

import argparse

from claims import scaling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--dims", default="16,64,256,1024")
    args = parser.parse_args()
    print(f"{'d_k':>5} {'scale':>7} {'score var':>10} {'max w':>6} {'sat rows':>8} {'med |J|':>8} {'|dL/ds|':>8} "
          f"{'|dL/dq|':>8}")
    for r in scaling(tuple(int(d) for d in args.dims.split(",")), n=args.n):
        print(f"{r['d_k']:>5} {'1/sqrt' if r['scaled'] else 'none':>7} {r['score_var']:>10.2f} "
              f"{r['mean_max_weight']:>6.3f} "
              f"{r['saturated_rows']:>8.0%} {r['median_softmax_jacobian']:>8.3g} {r['grad_norm_scores']:>8.3g} "
              f"{r['grad_norm_q']:>8.3g}")


if __name__ == "__main__":
    main()
