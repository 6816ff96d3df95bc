"""Top-k sparse attention (``TopK(idx) & Causal()`` on the ``topk`` backend) against dense causal attention.

Forward + backward of one layer's attention, batch 1, ``--heads`` query heads over ``--kv-heads``
key/value heads of ``--head-dim``, at T = 2048, 8192 and 16384 with k = T/8 keys per query
(``--k-divisor``), one list per query shared by every head, as DeepSeek-V3.2's indexer gives
(random lists, the -1 padding of the first queries included). Every case is interleaved in one
process (torch.utils.benchmark, median of ``--rounds``):

* ``topk``: ``attention(q, k, v, mask=TopK(idx) & Causal())``, which ``auto`` runs on ``topk``;
* ``dense``: ``attention(q, k, v, mask=Causal())`` on the fused ``native`` kernel (``tiled`` when the
  extension is not built; the table says which);

and prints both times, the speed-up of ``topk`` over ``dense``, and ``topk`` against ``(k/T) x dense``:
the time dense attention would take if its cost fell in proportion to the pairs kept (1.0 = as fast as
that ideal; a gather per listed key costs more than a dense tile per key, so expect more).
Figures taken under load are indicative; the load average is printed. ``--json PATH`` writes the rows.

    python benchmarks/bench_topk.py            # the figures (T up to 16384: minutes)
    python benchmarks/bench_topk.py --quick    # smoke: T=512, one round
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.utils import benchmark

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's attnkit

import attnkit  # noqa: E402
from attnkit import Causal, TopK  # noqa: E402
from attnkit.inputs import AttentionInputs  # noqa: E402


def lists(T: int, k: int, seed: int) -> torch.Tensor:
    """``(1, 1, T, k)`` random key lists over each query's past (``-1`` where it has fewer than k keys)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(T)[:, None]
    idx = (torch.rand(T, k, generator=g) * (pos + 1)).long()  # keys 0..i of query i
    idx = torch.where(torch.arange(k)[None, :] <= pos, idx, -1)
    return idx.view(1, 1, T, k)


def dense_backend(q, k, v) -> str:
    inp = AttentionInputs.create(q, k, v, mask=Causal())
    return "native" if not attnkit.get_backend("native").not_supported_reasons(inp) else "tiled"


def case(T: int, args) -> dict:
    g = torch.Generator().manual_seed(T)
    shape = lambda H: (1, H, T, args.head_dim)  # noqa: E731
    q = torch.randn(*shape(args.heads), generator=g).requires_grad_()
    k = torch.randn(*shape(args.kv_heads), generator=g).requires_grad_()
    v = torch.randn(*shape(args.kv_heads), generator=g).requires_grad_()
    do = torch.randn(*shape(args.heads), generator=g)
    kk = max(1, T // args.k_divisor)
    sparse = TopK(lists(T, kk, T)) & Causal()
    chosen = attnkit.dispatch.select(AttentionInputs.create(q, k, v, mask=sparse)).name
    dense = dense_backend(q, k, v)

    def run(mask, backend):
        def step():
            attnkit.attention(q, k, v, mask=mask, backend=backend).backward(do)
            q.grad = k.grad = v.grad = None
        return step

    return {"T": T, "k": kk, "chosen": chosen, "dense_backend": dense,
            "fns": {"topk": run(sparse, "auto"), "dense": run(Causal(), dense)}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="T=512, one round (a smoke test)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k-divisor", type=int, default=8,
                        help="k = T / this (8: k = T/8, as DeepSeek-V3.2 keeps 2048 of 16384)")
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.rounds = [512], 1
    cases = [case(T, args) for T in args.lengths]
    times = {(c["T"], name): [] for c in cases for name in c["fns"]}
    for _ in range(args.rounds):  # interleaved: every case once per round
        for c in cases:
            for name, fn in c["fns"].items():
                fn()  # warm
                m = benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.2)
                times[(c["T"], name)].append(m.median)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"top-k forward+backward, B=1, heads {args.heads}/{args.kv_heads}, D={args.head_dim}, "
          f"{torch.get_num_threads()} threads, load average {load:.2f}")
    print(f"{'T':>6} {'k':>5} {'topk ms':>9} {'dense ms':>9} {'dense on':>9} {'speed-up':>9} {'vs (k/T)x dense':>16}")
    rows = []
    for c in cases:
        t_sparse = sorted(times[(c["T"], "topk")])[len(times[(c["T"], "topk")]) // 2]
        t_dense = sorted(times[(c["T"], "dense")])[len(times[(c["T"], "dense")]) // 2]
        ideal = c["k"] / c["T"] * t_dense
        row = {"T": c["T"], "k": c["k"], "topk_backend": c["chosen"], "dense_backend": c["dense_backend"],
               "topk_ms": 1e3 * t_sparse, "dense_ms": 1e3 * t_dense, "speedup": t_dense / t_sparse,
               "vs_proportional": t_sparse / ideal, "load_average": load}
        rows.append(row)
        print(f"{c['T']:>6} {c['k']:>5} {row['topk_ms']:>9.1f} {row['dense_ms']:>9.1f} {c['dense_backend']:>9} "
              f"{row['speedup']:>8.2f}x {row['vs_proportional']:>15.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
