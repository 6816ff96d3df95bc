"""Packed variable-length attention, forward + backward: varlen vs padding vs one call per sequence.

    python benchmarks/bench_varlen.py                       # 16 sequences of 64..2048 tokens, fp32 and bf16
    python benchmarks/bench_varlen.py --sequences 4 --max-length 256 --repeats 1   # a quick look

Three ways to run the same causal attention over a batch of sequences of different lengths, timed in
one process with the cases interleaved (``torch.utils.benchmark``, the median of ``--repeats`` rounds):

* ``varlen``: :func:`attnkit.varlen_attention` on the packed ``(total, H, D)`` tokens (``auto``);
* ``padded sdpa``: the batch padded to its longest sequence, ``F.scaled_dot_product_attention`` with
  the bool mask ``causal & key padding`` (what a padded training step does);
* ``per sequence``: one ``F.scaled_dot_product_attention(is_causal=True)`` call per sequence.

Prints times and the ratios against varlen, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import attnkit


def cases(lengths, H, D, dtype):
    g = torch.Generator().manual_seed(0)
    total, T, B = sum(lengths), max(lengths), len(lengths)
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    q, k, v = (torch.randn(total, H, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(total, H, D, generator=g).to(dtype)
    pos = torch.arange(T)
    valid = pos[None, None, None, :] < torch.tensor(lengths)[:, None, None, None]  # (B, 1, 1, T)
    keep = (pos[None, :] <= pos[:, None])[None, None] & valid
    index = torch.cat([b * T + torch.arange(n) for b, n in enumerate(lengths)])  # packed row -> padded row

    def pad(x):  # (total, H, D) -> (B, H, T, D)
        out = x.new_zeros(B * T, H, D)
        out = out.index_copy(0, index, x)
        return out.view(B, T, H, D).transpose(1, 2)

    def run_varlen():
        out = attnkit.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    def run_padded():
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=keep)
        out = out.transpose(1, 2).reshape(B * T, H, D)[index]
        torch.autograd.grad(out, (q, k, v), dout)

    def run_loop():
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qi, ki, vi = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)[0].transpose(0, 1))
        torch.autograd.grad(torch.cat(outs), (q, k, v), dout)

    return {"varlen": run_varlen, "padded sdpa": run_padded, "per sequence": run_loop}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--min-length", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_length, args.max_length + 1, (args.sequences,), generator=g).tolist()
    print(f"{args.sequences} sequences, {sum(lengths)} tokens (longest {max(lengths)}), H={args.heads}, "
          f"D={args.head_dim}, causal, fwd+bwd, {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        fns = cases(lengths, args.heads, args.head_dim, dtype)
        for fn in fns.values():  # warm-up: plans, caches, first-call costs
            fn()
        times = {name: [] for name in fns}
        for _ in range(args.repeats):  # interleaved rounds
            for name, fn in fns.items():
                times[name].append(benchmark.Timer("fn()", globals={"fn": fn}).timeit(1).median)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"\n{dtype_name}:")
        for name, t in med.items():
            print(f"  {name:<13} {t * 1e3:9.1f} ms   {t / med['varlen']:5.2f}x varlen's time")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
