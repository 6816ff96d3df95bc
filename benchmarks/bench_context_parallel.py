"""Context parallelism on this machine (gloo, CPU): memory per rank, time per token, waiting.

    python benchmarks/bench_context_parallel.py            # ~3-4 min on 2 quiet cores
    python benchmarks/bench_context_parallel.py --quick    # tiny sizes: a smoke run (process starts dominate)

The memory figure defaults to n = 16384, not 65536: on 2 cores one causal fwd+bwd through the
pure-PyTorch blocks takes ~1 min per process count at 32768 and ~4 min at 65536 (pass
``--mem-len 65536`` on a larger machine). Four figures, all for causal attention forward + backward through
``attnkit.distributed.context_parallel_attention`` (ring, zigzag layout), B=1, fp32:

1. **memory** — peak resident memory above the process's baseline (measured after the imports,
   from a *fresh* group of processes for each P) over ``--mem-len`` positions with P = 1, 2, 4;
   reported per rank and as a ratio to P = 1 (ideal: 1/P plus one K/V block in flight).
2. **time** — seconds per token of the whole sequence at a fixed total length ``--time-len``
   for P = 1, 2, 4, interleaved in rounds inside one group of 4 processes (P = 1 runs on rank 0,
   P = 2 on ranks 0-1, while the others wait at a barrier); ratios against P = 1 of the same run.
   With 2 cores, P = 4 oversubscribes them: read this as a correctness-and-overlap figure.
3. **training memory** — peak resident memory of ``python -m attnkit train`` (one process) and
   of each rank of ``torchrun --nproc_per_node=4 -m attnkit train --context-parallel 4`` for one
   step at ``--train-len`` (a 2-layer GPT), so a memory budget between the two is one that only
   the 4-process run fits.
4. **waiting** — the fraction of each rank's fwd+bwd wall time blocked on communication (the
   profiler label ``context_parallel.wait``: ring transfers not hidden by compute, plus the
   per-call plan exchange), for P = 2 and 4.

Writes ``--out`` (default ``bench-results/context_parallel.json``) and prints a table; the load
average is recorded, since other work on the machine changes every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils import benchmark

from attnkit import Causal
from attnkit.distributed import SequenceLayout, context_parallel_attention
from attnkit.distributed.comm import WAIT_LABEL

HEADS, HEAD_DIM = 2, 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process in MiB, from /proc (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _local_inputs(total: int, world: int, rank: int, seed: int = 0):
    layout = SequenceLayout.zigzag(total, world) if world > 1 else SequenceLayout.contiguous([total])
    n = layout.local_len(rank)
    g = torch.Generator().manual_seed(seed + rank)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=g).requires_grad_() for _ in range(3))
    return layout, q, k, v


def _fwd_bwd(q, k, v, layout, group):
    out = context_parallel_attention(q, k, v, mask=Causal(), group=group, layout=layout, strategy="ring")
    out.sum().backward()
    q.grad = k.grad = v.grad = None


def _memory_job(rank, world, total):
    layout, q, k, v = _local_inputs(16 * world, world, rank)
    _fwd_bwd(q, k, v, layout, None)  # first-call costs (kernels, connections) are not the figure
    baseline = _rss_mb("VmRSS")  # after the imports, the process group and a tiny call
    layout, q, k, v = _local_inputs(total, world, rank)
    t0 = time.perf_counter()
    _fwd_bwd(q, k, v, layout, None)
    return {"peak_above_baseline_mb": _rss_mb("VmHWM") - baseline, "seconds": time.perf_counter() - t0}


def _time_job(rank, world, total, rounds):
    sizes = [p for p in (1, 2, 4) if p <= world]
    groups = {p: dist.new_group(list(range(p))) for p in sizes}  # collective: every rank makes every group
    best = {p: float("inf") for p in sizes}
    waiting = {}
    for r in range(rounds + 1):
        for p in sizes:
            dist.barrier()
            if rank >= p:
                continue
            layout, q, k, v = _local_inputs(total, p, rank)
            if r == 0:  # warm-up round: connections, first-call costs; then one profiled call
                _fwd_bwd(q, k, v, layout, groups[p])
                if p > 1:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                        dist.barrier(groups[p])  # start together (profilers start at different times)
                        t0 = time.perf_counter()
                        _fwd_bwd(q, k, v, layout, groups[p])
                        wall = time.perf_counter() - t0
                    waited = sum(e.cpu_time_total for e in prof.key_averages() if e.key == WAIT_LABEL) / 1e6
                    waiting[p] = waited / wall
                continue
            timer = benchmark.Timer("f()", globals={"f": lambda: _fwd_bwd(q, k, v, layout, groups[p])})
            best[p] = min(best[p], timer.timeit(1).median)
    return {"seconds": best if rank == 0 else None, "waiting_fraction": waiting}


def _entry(rank, world, port, fn, args, results):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        results.put((rank, fn(rank, world, *args)))
        dist.destroy_process_group()
    except BaseException as exc:
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def run_group(world: int, fn, *args) -> dict:
    """Fresh spawned processes (so peak memory is this run's alone); ``{rank: result}``."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=1200) for _ in range(world))
    for p in procs:
        p.join()
    errors = {r: v["error"] for r, v in out.items() if "error" in v}
    if errors:
        raise SystemExit(f"benchmark failed: {errors}")
    return out


_TRAIN_FLAGS = ["--steps", "1", "--batch-size", "1", "--warmup-steps", "1", "--eval-every", "0", "--eval-batches",
                "1", "--sample-tokens", "0", "--no-progress", "--device", "cpu", "--data", "stdlib",
                "--embed-dim", "128", "--num-layers", "2", "--num-heads", "4"]

# Runs the training command in this interpreter and reports its own peak RSS (one fresh process).
_SINGLE = """import resource, runpy, sys
sys.argv = ["attnkit"] + sys.argv[1:]
try:
    runpy.run_module("attnkit", run_name="__main__")
except SystemExit as exc:
    if exc.code:
        raise
print("PEAK_RSS_MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def _training_memory(seq_len: int) -> dict:
    """Peak RSS (MiB) of one training step at ``seq_len``: one process vs each of 4 ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    flags = _TRAIN_FLAGS + ["--seq-len", str(seq_len)]
    with tempfile.TemporaryDirectory() as tmp:
        one = subprocess.run([sys.executable, "-c", _SINGLE, "train", *flags, "--out", os.path.join(tmp, "one")],
                             capture_output=True, text=True, env=env, timeout=1200)
        if one.returncode:
            raise SystemExit(f"single-process training failed:\n{one.stderr[-3000:]}")
        single = float(one.stdout.rsplit("PEAK_RSS_MB", 1)[1].split()[0])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), "-m", "attnkit", "train", *flags, "--context-parallel", "4",
               "--out", os.path.join(tmp, "cp")]
        four = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
        if four.returncode:
            raise SystemExit(f"context-parallel training failed:\n{four.stderr[-3000:]}")
        with open(os.path.join(tmp, "cp", "results.json")) as f:
            per_rank = json.load(f)["peak_rss_mb_per_rank"]
    return {"seq_len": seq_len, "one_process_peak_mb": single, "context_parallel_4_peak_mb_per_rank": per_rank}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mem-len", type=int, default=16384, help="sequence length of the memory figure")
    parser.add_argument("--time-len", type=int, default=8192, help="fixed total length of the timing figure")
    parser.add_argument("--train-len", type=int, default=16384, help="sequence length of the training-memory figure")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (best is kept)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--out", default="bench-results/context_parallel.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.mem_len, args.time_len, args.rounds, args.train_len = 1024, 512, 1, 512
    load_before = os.getloadavg()
    memory = {}
    for p in (1, 2, 4):
        per_rank = run_group(p, _memory_job, args.mem_len)
        memory[p] = {"peak_above_baseline_mb_per_rank": [per_rank[r]["peak_above_baseline_mb"] for r in range(p)],
                     "seconds": max(per_rank[r]["seconds"] for r in range(p))}
    timing = run_group(4, _time_job, args.time_len, args.rounds)
    training = _training_memory(args.train_len)
    seconds = timing[0]["seconds"]
    waiting = {p: [timing[r]["waiting_fraction"][p] for r in range(p)] for p in (2, 4)}
    base_mem = max(memory[1]["peak_above_baseline_mb_per_rank"])
    report = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0],
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "config": {"heads": HEADS, "head_dim": HEAD_DIM, "batch": 1, "dtype": "float32", "mask": "Causal",
                   "layout": "zigzag", "strategy": "ring", "mem_len": args.mem_len, "time_len": args.time_len,
                   "rounds": args.rounds},
        "memory": {str(p): {**m, "ratio_vs_1": max(m["peak_above_baseline_mb_per_rank"]) / base_mem,
                            "ideal_ratio": 1 / p} for p, m in memory.items()},
        "time": {str(p): {"seconds": s, "seconds_per_token": s / args.time_len, "ratio_vs_1": s / seconds[1]}
                 for p, s in seconds.items()},
        "waiting_fraction_per_rank": {str(p): w for p, w in waiting.items()},
        "training_memory": training,
    }
    print(f"causal fwd+bwd, H={HEADS}, D={HEAD_DIM}; load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'P':>2} | {'peak MiB/rank (max)':>19} | {'vs P=1':>6} | {'ideal':>5} | "
          f"{'us/token':>9} | {'time vs P=1':>11} | waiting (per rank)")
    for p in (1, 2, 4):
        m, t = report["memory"][str(p)], report["time"][str(p)]
        w = ", ".join(f"{x:.0%}" for x in waiting.get(p, [])) or "-"
        print(f"{p:>2} | {max(m['peak_above_baseline_mb_per_rank']):>19.1f} | {m['ratio_vs_1']:>6.2f} | "
              f"{m['ideal_ratio']:>5.2f} | {t['seconds_per_token'] * 1e6:>9.2f} | {t['ratio_vs_1']:>11.2f} | {w}")
    print(f"training one step at seq-len {training['seq_len']}: one process {training['one_process_peak_mb']:.0f} MiB; "
          f"4 context-parallel ranks {max(training['context_parallel_4_peak_mb_per_rank']):.0f} MiB each (peak RSS)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
