"""Decode attention at long context: the split-K decode kernel vs SDPA over a contiguous cache.

One query token per sequence (B=1 by default), GQA 32 query / 8 key-value heads, D=128, context
16k. Cases, interleaved in one process (torch.utils.benchmark, median of ``--rounds`` rounds):

* ``sdpa fp32``     F.scaled_dot_product_attention(enable_gqa=True) over a contiguous float32 cache
                    — the named baseline every ratio is against;
* ``decode fp32``   the decode kernel over the same contiguous cache;
* ``decode bf16``   over a bfloat16 copy (converted segment by segment);
* ``decode int8``   over an int8 cache with per-token, per-head scales (QuantizedLayerCache storage);
* ``paged fp32`` / ``paged int8``  over a paged cache (block 16, blocks shuffled), read page-wise.

For each case: ms per call (one layer, one token), bytes of K/V (and scales) it must read, the
achieved GB/s and its share of this machine's copy bandwidth, measured in the same run by a
STREAM-style triad (``a = b + s * c`` over arrays much larger than the caches: 3 x 4 bytes per
element). Peak memory per case comes from a fresh process (``--memory``: the peak RSS growth of
one call over its inputs, Linux only).
The machine's load average is printed; read the ratios, not the absolute numbers.

    python benchmarks/bench_decode_attention.py                      # the figures (about 1-2 minutes)
    python benchmarks/bench_decode_attention.py --context 2048 --rounds 2 --memory   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import gc
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's attnkit

from attnkit.backends.decode import decode_attention, paged_decode_attention  # noqa: E402
from attnkit.cache import quantize_int8  # noqa: E402

CASES = ("sdpa fp32", "decode fp32", "decode bf16", "decode int8", "paged fp32", "paged int8")
BLOCK = 16


def build(case: str, B: int, Hq: int, Hkv: int, T: int, D: int, seed: int = 0):
    """(callable, bytes read per call) for one case."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=g)
    k = torch.randn(B, Hkv, T, D, generator=g)
    v = torch.randn(B, Hkv, T, D, generator=g)
    kind, fmt = case.split()
    if kind == "sdpa":
        return (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)), 2 * k.numel() * 4
    if fmt == "bf16":
        k, v = k.bfloat16(), v.bfloat16()
        qb = q.bfloat16()
        return (lambda: decode_attention(qb, k, v)), 2 * k.numel() * 2
    scales = {}
    if fmt == "int8":
        (k, ks), (v, vs) = quantize_int8(k), quantize_int8(v)
        scales = dict(k_scale=ks, v_scale=vs)
    nbytes = 2 * k.numel() * k.element_size() + sum(s.numel() * 4 for s in scales.values())
    if kind == "decode":
        return (lambda: decode_attention(q, k, v, **scales)), nbytes
    nb = T // BLOCK
    table = torch.randperm(B * nb, generator=g).view(B, nb)

    def pool(x):
        shape = x.shape[3:]
        paged = torch.empty(Hkv, B * nb, BLOCK, *shape, dtype=x.dtype)
        pages = x.view(B, Hkv, nb, BLOCK, *shape).transpose(0, 1)  # (Hkv, B, nb, BLOCK, ...)
        paged[:, table.flatten()] = pages.reshape(Hkv, B * nb, BLOCK, *shape)
        return paged

    kp, vp = pool(k), pool(v)
    sp = {name: pool(s) for name, s in scales.items()}
    return (lambda: paged_decode_attention(q, kp, vp, table, **sp)), nbytes


def triad(n: int):
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    return (lambda: torch.add(b, c, alpha=1.5, out=a)), 3 * n * 4


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure_memory(case: str, args) -> int:
    """Peak RSS growth (bytes) of one call of ``case`` in a fresh process, over its setup."""
    out = subprocess.run([sys.executable, __file__, "--one", case, "--context", str(args.context), "--batch",
                          str(args.batch), "--threads", str(args.threads)], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", default="32/8", help="query/key-value heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per case per round")
    parser.add_argument("--triad-mib", type=int, default=512, help="size of each triad array")
    parser.add_argument("--memory", action="store_true", help="also measure peak memory per case (fresh processes)")
    parser.add_argument("--out", default="bench-results/decode_attention.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    Hq, Hkv = (int(x) for x in args.heads.split("/"))
    shape = (args.batch, Hq, Hkv, args.context, args.head_dim)
    if args.one:  # child of --memory: setup, then one call; print the peak RSS growth of the call
        fn, _ = build(args.one, *shape)
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:  # Linux: reset the peak (VmHWM) to the current RSS
            f.write("5")
        base = _status_kib("VmRSS")
        fn()
        print((_status_kib("VmHWM") - base) * 1024)
        return
    print(f"threads={args.threads} load average={os.getloadavg()} B={args.batch} heads={Hq}/{Hkv} "
          f"T={args.context} D={args.head_dim}")
    fns = {case: build(case, *shape) for case in CASES}
    fns["triad"] = triad(args.triad_mib * 2**20 // 4)
    ref = fns["sdpa fp32"][0]()
    for case in CASES[1:]:  # a benchmark of wrong results is worth nothing
        err = (fns[case][0]().float() - ref).abs().max().item()
        assert err < (0.05 if "int8" in case or "bf16" in case else 1e-4), (case, err)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):  # interleaved: load on the machine hits every case alike
        for name, (fn, _) in fns.items():
            t = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=args.threads)
            times[name].append(t.blocked_autorange(min_run_time=args.min_run_time).median)
    med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    bandwidth = fns["triad"][1] / med["triad"] / 1e9
    print(f"copy bandwidth (triad): {bandwidth:.1f} GB/s")
    rows = []
    print(f"{'case':<12} {'ms/token':>9} {'MB read':>8} {'GB/s':>7} {'% bw':>6} {'vs sdpa':>8}")
    for case in CASES:
        nbytes = fns[case][1]
        gbs = nbytes / med[case] / 1e9
        row = dict(case=case, ms=med[case] * 1e3, bytes=nbytes, gb_per_s=gbs, pct_bandwidth=100 * gbs / bandwidth,
                   speedup_vs_sdpa=med["sdpa fp32"] / med[case])
        if args.memory:
            row["peak_rss_growth_bytes"] = measure_memory(case, args)
        rows.append(row)
        print(f"{case:<12} {row['ms']:9.3f} {nbytes / 1e6:8.1f} {gbs:7.1f} {row['pct_bandwidth']:6.1f} "
              f"{row['speedup_vs_sdpa']:7.2f}x" + (f"  peak +{row['peak_rss_growth_bytes'] / 2**20:.1f} MiB"
                                                    if args.memory else ""))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(threads=args.threads, load_average=os.getloadavg(), shape=dict(
            B=args.batch, Hq=Hq, Hkv=Hkv, T=args.context, D=args.head_dim), triad_gb_per_s=bandwidth, cases=rows,
            rounds=args.rounds), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
