"""Context-parallel gated delta rule on this machine (gloo, CPU): 2 ranks against one process.

    python benchmarks/bench_context_parallel_gated.py            # T = 4096 and 16384, H=8, D=128 (minutes)
    python benchmarks/bench_context_parallel_gated.py --quick    # tiny sizes: a smoke run

For each length ``T`` (B=1, fp32, L2-normalized q and k as Gated DeltaNet), forward and
forward + backward of:

* **one process**, ``gated_linear_attention`` over the whole sequence, with 1 thread and with
  ``--threads`` threads (the same cores the 2 ranks use);
* **2 ranks**, ``context_parallel_gated_linear_attention`` over a contiguous split, 1 thread each
  (``--threads-per-rank``): rank 1 runs its tokens with ``Dk`` extra state columns (the transition
  it sends), then corrects its output with the incoming state; rank 0 (position 0, zero state) runs
  the plain rule. Two splits: even halves, and rank 0 holding ``--first-share`` of the tokens
  (the extra columns make a rank-1 token dearer, so a larger first share balances the ranks).

Rounds are interleaved inside one group of 2 processes (the one-process runs on rank 0 while rank 1
waits at a barrier); the best of ``--rounds`` is kept, and a rank pair's time is the slower rank's.
Also reported: the bytes each rank sends per forward (the state summary, independent of ``T``),
the fraction of the 2-rank forward + backward spent waiting on the exchange (profiler label
``context_parallel.wait``), and the largest relative difference of the 2-rank output from the one
process's. Writes ``--out`` (default ``bench-results/context_parallel_gated.json``) and prints a
table; the load average is recorded, since other work on the machine changes every figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark's process group
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's attnkit
from bench_context_parallel import run_group  # noqa: E402

from attnkit import gated_linear_attention  # noqa: E402
from attnkit.bench.report import write_json  # noqa: E402
from attnkit.bench.runner import machine_description  # noqa: E402
from attnkit.distributed import SequenceLayout, context_parallel_gated_linear_attention  # noqa: E402
from attnkit.distributed.comm import WAIT_LABEL  # noqa: E402


def _inputs(T: int, H: int, D: int):
    """The whole sequence's inputs (the same on every rank: one seed)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T, D, generator=gen) for _ in range(3))
    g = -F.softplus(torch.randn(1, H, T, generator=gen)) * 0.1
    beta = torch.sigmoid(torch.randn(1, H, T, generator=gen))
    return q, k, v, g, beta


def _run(xs, backward: bool, group=None, layout=None):
    xs = [x.detach().requires_grad_(backward) for x in xs]
    if layout is None:
        o = gated_linear_attention(*xs, qk_l2norm=True)
    else:
        o = context_parallel_gated_linear_attention(*xs, qk_l2norm=True, group=group, layout=layout)
    if backward:
        o.sum().backward()
    return o.detach()


def _timed(fn, group=None) -> float:
    """Seconds of ``fn()``; with ``group``, the slowest rank's (every rank starts together)."""
    if group is not None:
        dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def _job(rank, world, lengths, H, D, rounds, threads, threads_per_rank, first_share):
    torch.set_num_threads(threads_per_rank)
    pair = dist.new_group(list(range(world)))
    results = {}
    for T in lengths:
        full = _inputs(T, H, D)
        first = round(first_share * T)
        layouts = {"even split": SequenceLayout.even(T, world),
                   f"rank 0 holds {first_share:.0%}": SequenceLayout.contiguous([first, T - first])}
        layout = layouts["even split"]
        local = [layout.shard(x, rank) for x in full]
        best = {}
        keep = lambda name, s: best.__setitem__(name, min(best.get(name, float("inf")), s))  # noqa: E731
        for r in range(rounds + 1):  # round 0 warms up (first-call costs, connections)
            for backward in (False, True):
                what = "fwd+bwd" if backward else "fwd"
                dist.barrier()
                if rank == 0:
                    for n in (1, threads):
                        torch.set_num_threads(n)
                        s = _timed(lambda: _run(full, backward))
                        if r:
                            keep(f"one process, {n} thread(s), {what}", s)
                    torch.set_num_threads(threads_per_rank)
                for split, lay in layouts.items():
                    dist.barrier()
                    mine = [lay.shard(x, rank) for x in full]
                    s = _timed(lambda: _run(mine, backward, pair, lay), pair)
                    if r:
                        keep(f"{world} ranks, {threads_per_rank} thread(s) each, {split}, {what}", s)
        # waiting and exactness, once
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            dist.barrier(pair)
            t0 = time.perf_counter()
            out = _run(local, True, pair, layout)
            wall = time.perf_counter() - t0
        waited = sum(e.cpu_time_total for e in prof.key_averages() if e.key == WAIT_LABEL) / 1e6
        pieces = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(pieces, out.contiguous(), group=pair)
        entry = {"waiting_fraction": waited / wall}
        if rank == 0:
            torch.set_num_threads(threads)
            ref = _run(full, False)
            got = layout.unshard(pieces)
            entry.update(seconds=best, max_relative_difference=float((got - ref).abs().max() / ref.abs().max()),
                         summary_bytes_sent_per_rank=H * D * (D + D) * 4 * len(layout.segments[rank]))
            torch.set_num_threads(threads_per_rank)
        results[T] = entry
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after a warm-up (best is kept)")
    parser.add_argument("--threads", type=int, default=2, help="threads of the one-process comparison")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--first-share", type=float, default=0.64,
                        help="rank 0's share of the tokens in the uneven split")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--out", default="bench-results/context_parallel_gated.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.heads, args.head_dim, args.rounds = [256], 2, 32, 1
    world = 2
    load_before = os.getloadavg()
    results = run_group(world, _job, args.lengths, args.heads, args.head_dim, args.rounds, args.threads,
                        args.threads_per_rank, args.first_share)
    report = {
        "machine": {**machine_description("cpu"), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "config": {"rule": "gated_delta", "batch": 1, "heads": args.heads, "head_dim": args.head_dim,
                   "dtype": "float32", "layout": "contiguous, even and uneven", "ranks": world, "rounds": args.rounds,
                   "threads_one_process": args.threads, "threads_per_rank": args.threads_per_rank,
                   "first_share": args.first_share},
        "lengths": {str(T): {**results[0][T], "waiting_fraction_per_rank":
                             [results[r][T]["waiting_fraction"] for r in range(world)]} for T in args.lengths},
    }
    for entry in report["lengths"].values():
        entry.pop("waiting_fraction")
    print(f"gated delta rule, H={args.heads}, D={args.head_dim}, fp32; load average {load_before[0]:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    for T, entry in report["lengths"].items():
        print(f"T={T}: summary sent per rank {entry['summary_bytes_sent_per_rank'] / 2**20:.2f} MiB, waiting "
              f"{', '.join(f'{w:.0%}' for w in entry['waiting_fraction_per_rank'])}, max relative difference "
              f"{entry['max_relative_difference']:.1e}")
        for name, s in entry["seconds"].items():
            print(f"  {name:<56} {s * 1e3:>10.1f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"wrote {write_json(report, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
